"""`algorithm.value_lr_scale`: the critic's parameters step at lr x scale, every other parameter at lr."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy, make_trainer
from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.training.module import RLHFModule

LR = 1e-3


def one_step(tokenizer, scale: float, separate_critic: bool = False) -> tuple[RLHFModule, dict[str, torch.Tensor]]:
    """A PPO module after one optimizer step, and its parameters before it."""
    module = RLHFModule(
        policy=make_policy(0),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm={"name": "ppo", "group_size": 2, "kl_coef": 0.0, "value_lr_scale": scale},
        sampling={"max_new_tokens": 4},
        lr=LR,
        separate_critic=separate_critic,
        log_samples_every_n_steps=0,
    )
    before: dict[str, torch.Tensor] = {}

    def snapshot(*_args) -> None:
        before.update({name: p.detach().clone() for name, p in module.named_parameters()})

    module.on_experience = snapshot  # type: ignore[method-assign]  # after the rollout, before the update
    make_trainer(1).fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16))
    return module, before


def largest_moves(module: RLHFModule, before: dict[str, torch.Tensor], prefix: str) -> list[float]:
    moved = {name: (p.detach() - before[name]).abs().max() for name, p in module.named_parameters()}
    return [float(step) for name, step in moved.items() if name.startswith(prefix)]


@pytest.mark.parametrize("separate_critic", [False, True])
def test_the_first_adam_step_moves_critic_weights_by_the_scaled_rate(tokenizer, separate_critic):
    # Adam's first update is lr * g / (|g| + eps): each weight with a gradient moves by almost exactly lr
    module, before = one_step(tokenizer, 10.0, separate_critic)
    policy = largest_moves(module, before, "actor_critic.policy.")
    critic = largest_moves(module, before, "actor_critic.value_head.")
    if separate_critic:
        critic += largest_moves(module, before, "actor_critic.critic_backbone.")
    assert max(policy) == pytest.approx(LR, rel=1e-3)
    assert max(critic) == pytest.approx(10 * LR, rel=1e-3)
    assert min(critic) > 2 * LR  # every critic tensor took the larger step, none stayed in the policy's group


def test_scale_one_keeps_a_single_group(tokenizer):
    module, before = one_step(tokenizer, 1.0)
    assert len(module.optimizers().param_groups) == 1
    assert max(largest_moves(module, before, "actor_critic.value_head.")) == pytest.approx(LR, rel=1e-3)
