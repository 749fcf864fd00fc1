"""End to end: GRPO on the built-in task with held-out prompts, the best policy kept by a monitored checkpoint,
exported, and reloaded by plain transformers with the same greedy answers."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.tasks.digits import sort_digits_score

pytestmark = pytest.mark.slow  # end-to-end: a real fit, several processes or a pretrained model

DIGITS = "lit_rlhf.tasks.digits"


def test_held_out_accuracy_best_checkpoint_and_export(tmp_path):
    L.seed_everything(0, verbose=False)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[f"{DIGITS}.sort_digits_reward"],
        # as a metric, the partial-credit reward is non-zero from the start: its held-out mean is checked by hand
        metric_fns=[f"{DIGITS}.sorted_exactly", f"{DIGITS}.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=8, kl_coef=0.0, entropy_coef=0.01),
        sampling=SamplingConfig(max_new_tokens=8),
        lr=3e-4,
    )
    data = RolloutDataModule(
        prompts="builtin:digits",
        batch_size=8,
        max_prompt_length=16,
        rollouts_per_epoch=5,
        val_prompts="builtin:digits",
        val_size=24,
        val_batch_size=12,
    )
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/sort_digits_reward", mode="max", save_top_k=1)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[best],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    assert trainer.current_epoch == 3 and trainer.global_step == 15
    assert set(best.best_k_models) and best.best_model_path.endswith(".ckpt")

    # the checkpoint alone rebuilds the module (the functions are named by dotted path)
    restored = RLHFModule.load_from_checkpoint(best.best_model_path)
    # its held-out accuracy, as Lightning's validation loop reports it, is the monitored best score, and equals
    # the metric recomputed here by hand from greedy answers to the same held-out prompts
    (metrics,) = trainer.validate(restored, datamodule=data, verbose=False)
    assert metrics["val/sort_digits_reward"] == pytest.approx(float(best.best_model_score), abs=1e-6)
    data.setup("validate")
    prompts = [text for batch in data.val_dataloader() for text in batch.texts]
    assert len(prompts) == 24
    answers = restored.generate(prompts)
    partial = [sort_digits_score(p, a) for p, a in zip(prompts, answers, strict=True)]
    exact = [float(a.strip() == "".join(sorted(p.rstrip(">")))) for p, a in zip(prompts, answers, strict=True)]
    assert metrics["val/sort_digits_reward"] == pytest.approx(sum(partial) / 24, abs=1e-6) and sum(partial) > 0
    assert metrics["val/sorted_exactly"] == pytest.approx(sum(exact) / 24, abs=1e-6)

    # exported, the policy answers exactly as the module does, under plain transformers
    from transformers import AutoModelForCausalLM

    folder = restored.save_policy(str(tmp_path / "policy"))
    exported = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = restored.tokenizer
    enc = tok(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = exported.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    rows = [row.tolist() for row in out[:, enc["input_ids"].shape[1] :]]
    texts = tok.batch_decode([r[: r.index(tok.eos_token_id)] if tok.eos_token_id in r else r for r in rows])
    assert texts == answers
