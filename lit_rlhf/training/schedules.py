"""Learning-rate schedules as multipliers of the base rate, for `torch.optim.lr_scheduler.LambdaLR`."""

from __future__ import annotations

import math
from collections.abc import Callable

from lit_rlhf.config import LRSchedule


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
