"""Optimizer helpers: learning-rate schedules (multipliers for `LambdaLR`), the gradient norm, and the
non-finite check that decides whether an optimizer step is skipped."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lit_rlhf.config import ConfigError, LRSchedule


def warmup_then_decay(schedule: LRSchedule, warmup_steps: int, total_steps: int | None) -> Callable[[int], float]:
    """Multiplier at optimizer step `step`: linear warm-up over `warmup_steps`, then constant, or a linear or
    cosine decay to 0 at `total_steps` (constant when `total_steps` is None)."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def gradient_norm(parameters: Iterable[nn.Parameter]) -> float:
    """The global L2 norm of the parameters' gradients (0.0 when none has one), before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def non_finite(stats: dict[str, float], grad_norm: float) -> dict[str, float]:
    """The losses in `stats` and the gradient norm that are not finite (empty: the step may be taken)."""
    bad = {k: v for k, v in stats.items() if k.endswith("loss") and not math.isfinite(v)}
    if not math.isfinite(grad_norm):
        bad["optim/grad_norm"] = grad_norm
    return bad


def single_optimizer(optimizers: Any) -> LightningOptimizer:
    """`LightningModule.optimizers()` narrowed to the one optimizer the manual update loop steps."""
    if not isinstance(optimizers, LightningOptimizer):
        raise ConfigError("configure_optimizers: the update loop steps one optimizer; return exactly one")
    return optimizers
