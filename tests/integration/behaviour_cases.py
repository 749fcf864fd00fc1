"""Fixed few-step runs of every algorithm family, recorded as numbers: the rollouts' tokens and scores, each
step's losses and gradient norm, and a fingerprint of the weights after each step.

`tests/integration/test_behaviour_unchanged.py` replays them against `behaviour_golden.json`, which was written by
`python tests/integration/behaviour_cases.py` on the code before the 0.5.0 design round (commit 2b21871), so a
refactor that changes what the library computes fails there. Regenerate the file only for a deliberate change of
behaviour, and say so in the commit.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import lightning as L
import torch

GOLDEN = pathlib.Path(__file__).with_name("behaviour_golden.json")
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
STEPS = 3

# name -> RLHFModule keyword arguments (besides the policy, the tokenizer and the reward); data batch size
CASES: dict[str, dict[str, Any]] = {
    "grpo": dict(algorithm=dict(name="grpo", group_size=4, kl_coef=0.04), sampling=dict(max_new_tokens=6)),
    "grpo_micro_generate": dict(
        algorithm=dict(name="grpo", group_size=4, ppo_epochs=2, num_minibatches=2, micro_batch_size=4),
        sampling=dict(max_new_tokens=6, backend="generate"),
    ),
    "grpo_overlap": dict(
        algorithm=dict(name="grpo", group_size=4, micro_batch_tokens=64, kl_estimator="full"),
        sampling=dict(max_new_tokens=6, top_k=8),
        overlap_scoring=True,
    ),
    "ppo": dict(
        algorithm=dict(name="ppo", ppo_epochs=2, num_minibatches=2, entropy_coef=0.01),
        sampling=dict(max_new_tokens=6),
    ),
    "ppo_separate_critic": dict(
        algorithm=dict(name="ppo", group_size=2, whiten_advantages=False),
        sampling=dict(max_new_tokens=5),
        separate_critic=True,
    ),
    "dapo": dict(
        algorithm=dict(
            name="grpo",
            group_size=4,
            kl_coef=0.0,
            clip_eps_high=0.28,
            overlong_buffer=2,
            overlong_penalty=0.5,
            dynamic_sampling=True,
            max_sampling_rounds=3,
        ),
        sampling=dict(max_new_tokens=6),
        reward_fns=["coarse"],
    ),
    "gspo": dict(
        algorithm=dict(
            name="grpo",
            group_size=4,
            ratio_level="sequence",
            loss_aggregation="seq_mean_token_mean",
            num_minibatches=2,
            clip_eps_low=0.003,
            clip_eps_high=0.004,
        ),
        sampling=dict(max_new_tokens=6),
    ),
    "reinforce_pp": dict(
        algorithm=dict(
            name="grpo",
            group_size=2,
            advantage_estimator="reinforce_pp",
            kl_in_reward=True,
            kl_estimator="k1",
            kl_coef=0.05,
            gamma=0.9,
            entropy_top_fraction=0.5,
        ),
        sampling=dict(max_new_tokens=6),
    ),
    "reinforce_pp_baseline": dict(
        algorithm=dict(name="grpo", group_size=4, advantage_estimator="reinforce_pp_baseline"),
        sampling=dict(max_new_tokens=6),
    ),
    "rloo_dr_grpo": dict(
        algorithm=dict(
            name="grpo",
            group_size=4,
            advantage_estimator="rloo",
            loss_aggregation="seq_mean_token_sum_norm",
            mask_truncated=True,
            truncated_score=-0.5,
        ),
        sampling=dict(max_new_tokens=4),
    ),
    "multi_turn": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.0, entropy_coef=0.01),
        sampling=dict(max_new_tokens=2),
        environment=dict(name="builtin:peek", options=dict(ask_bonus=0.1), max_turns=2, max_total_tokens=8),
        reward_fns=None,
    ),
}


def coarse_reward(prompts: list[str], responses: list[str], **meta: Any) -> list[float]:
    """0, 0.5 or 1 (many tied groups, so dynamic sampling refills): a digit answer, sorted as well."""
    from lit_rlhf.tasks.digits import sort_digits_score

    return [0.5 * (r.strip().isdigit()) + 0.5 * (sort_digits_score(p, r) == 1.0) for p, r in zip(prompts, responses)]


class Recorder(L.Callback):
    """Each step's rollout, metrics and weight fingerprint."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        exp = module.recorded
        metrics = {k: v for k, v in module.step_metrics.items() if not k.startswith(("time/", "perf/tokens_per_s"))}
        self.steps.append(
            {
                "response_ids": exp.response_ids.tolist(),
                "scores": exp.scores.tolist(),
                "advantages_sum": float(exp.advantages.double().sum()),
                "metrics": metrics,
                "weights": fingerprint(module.actor_critic),
            }
        )


def fingerprint(model: torch.nn.Module) -> list[float]:
    """Two numbers that move with any weight: the sum, and a fixed random projection, in float64."""
    flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    weights = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [float(flat.sum()), float(flat @ weights)]


def run_case(name: str, make_module: Any) -> list[dict[str, Any]]:
    """Fit `STEPS` steps of case `name`, with `make_module(**settings)` building the module."""
    from lit_rlhf import RolloutDataModule
    from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

    torch.set_num_threads(1)
    settings = dict(CASES[name])
    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    policy = builtin_policy(n_layer=1, n_embd=32, n_head=2)
    rewards = [coarse_reward if fn == "coarse" else fn for fn in settings.pop("reward_fns", [REWARD]) or ()] or None
    module = make_module(policy=policy, tokenizer=builtin_tokenizer(), reward=rewards, **settings)
    original = module.on_experience

    def record(experience: Any) -> None:
        module.recorded = experience
        original(experience)

    module.on_experience = record
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS * module.algorithm.ppo_epochs * module.algorithm.num_minibatches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[recorder],
    )
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16, seed=3))
    return recorder.steps


def old_api(policy: Any, tokenizer: Any, reward: Any, **settings: Any) -> Any:
    """The module as the code before the design round built it (a flat argument list)."""
    from lit_rlhf import RLHFModule

    return RLHFModule(policy=policy, tokenizer=tokenizer, reward_fns=reward, **settings)


if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    for case in names:
        golden[case] = run_case(case, old_api)
        print(case, "recorded", flush=True)
    GOLDEN.write_text(json.dumps(golden, sort_keys=True) + "\n")
