"""`builtin:reasoning_gym/<dataset>` end to end with the family's tiny character model: the training stream, the
held-out set drawn from the held-out share only, and the dataset's entries reaching the reward and metric
functions row by row. Needs reasoning-gym (`pip install 'lit_rlhf[reasoning-gym]'`); skipped without it."""

from __future__ import annotations

import pytest

from conftest import make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

pytest.importorskip("reasoning_gym")

SPEC = "builtin:reasoning_gym/chain_sum?min_terms=2&max_terms=3&max_digits=2"


def test_a_reasoning_gym_task_fits_and_validates_on_its_held_out_share():
    from lit_rlhf.tasks import rgym

    seen: list[tuple[str, str]] = []

    def recording_score(prompts, responses, rg_task, rg_entry, answer_format, **meta):
        seen.extend((prompt, entry["question"]) for prompt, entry in zip(prompts, rg_entry))
        return rgym.score_answer(prompts, responses, rg_task, rg_entry, answer_format)

    module = RLHFModule(
        policy=SPEC,
        reward_fns=[recording_score, "lit_rlhf.tasks.rgym.answer_format_reward"],
        metric_fns=["lit_rlhf.tasks.rgym.solved"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    dm = RolloutDataModule(prompts=SPEC, batch_size=2, max_prompt_length=160, val_prompts=SPEC, val_size=4)
    trainer = make_trainer(max_steps=2, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    trained = {question for _, question in seen}
    assert len(seen) == 2 * 2 * 2  # two steps of 2 prompts x 2 samples
    # the chat template (one line per message) renders the question and the instruction
    assert all(prompt.startswith(question + "\nGive the final answer") for prompt, question in seen)
    held = [row["rg_entry"]["question"] for row in dm.val_rows]
    assert len(set(held)) == 4 and all(rgym.held_out(q) for q in held) and not trained & set(held)
    trainer.validate(module, datamodule=dm, verbose=False)
    assert float(trainer.callback_metrics["val/solved"]) == 0.0  # 4 random characters never end in the answer
