"""Lightning callbacks that cannot act on an RL step, refused when fit starts (before any model loads), each with
the reason and the setting that does the job instead (docs/migrating-from-trl.md, "Lightning's tools")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler, LearningRateFinder

from lit_rlhf.config import ConfigError

REFUSED: dict[type, str] = {
    BackboneFinetuning: (
        "unfreezes the module's `backbone` on an epoch schedule; an RLHFModule has none (the policy trains whole, "
        "or only its LoRA adapters: model.lora); leave the callback out"
    ),
    GradientAccumulationScheduler: (
        "schedules accumulate_grad_batches, which the manual update loop does not use; set "
        "model.algorithm.micro_batch_size (gradients accumulate over a minibatch) or raise data.batch_size"
    ),
    LearningRateFinder: (
        "(what Tuner(trainer).lr_find adds) raises the learning rate step by step and reads the loss each "
        "training_step returns; an RLHF step returns none (manual optimisation), and its PPO loss is re-based on "
        "every rollout, so the curve would not point at a good rate. Compare a few short runs at different "
        "model.lr instead (watch rollout/reward_mean and the KL); remove the lr_find call or the callback"
    ),
}
"""Callback classes (and their subclasses) that are refused, with why and what to use."""


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """A `ConfigError` naming the first callback of a refused kind (`REFUSED`)."""
    for callback in callbacks:
        for kind, why in REFUSED.items():
            if isinstance(callback, kind):
                raise ConfigError(f"trainer.callbacks: {type(callback).__name__} {why}")
