"""How long a fit runs, in rollouts and held-out evaluations, read from the Trainer's limits and the prompts.

A rollout is one `training_step` (one prompt batch), which makes `ppo_epochs x num_minibatches` optimizer steps,
so `trainer.max_steps` (optimizer steps) allows `ceil(max_steps / that)` rollouts. Lightning's own defaults apply:
no `max_epochs` and no `max_steps` is 1000 epochs (unless `max_time` bounds the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import Timer

from lit_rlhf.data.datamodule import BUILTIN_ROLLOUTS_PER_EPOCH

LIGHTNING_DEFAULT_EPOCHS = 1000


@dataclass(frozen=True)
class RunLength:
    """The fit's size before `max_time`: rollouts, held-out evaluations and their batches."""

    rollouts: int | None  # None: no limit but max_time
    rollouts_per_epoch: int
    epochs: float | None
    evaluations: int  # held-out validation runs during the fit
    val_batches: int  # batches per held-out evaluation
    sanity_batches: int  # Lightning's sanity check before the first rollout
    max_time_s: float | None
    bound_by: str  # the setting that ends the run first (before max_time)


def duration(seconds: float) -> str:
    """`h:mm:ss`."""
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _limited(batches: int, limit: int | float) -> int:
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def rollouts_per_epoch(datamodule: Any, world_size: int) -> int:
    """Training batches per epoch, as `PromptBatches` counts them."""
    if datamodule.rollouts_per_epoch is not None:
        return int(datamodule.rollouts_per_epoch)
    if isinstance(datamodule.source, str):
        return BUILTIN_ROLLOUTS_PER_EPOCH
    return max(1, len(datamodule.source) // max(1, world_size) // datamodule.batch_size)


def held_out_batches(datamodule: Any, world_size: int) -> int:
    rows = datamodule.val_rows or []
    per_rank = -(-len(rows) // max(1, world_size))
    return -(-per_rank // (datamodule.val_batch_size or datamodule.batch_size))


def max_time_s(trainer: Any) -> float | None:
    durations = [c._duration for c in trainer.callbacks if isinstance(c, Timer) and c._duration is not None]
    return min(durations) if durations else None


def run_length(module: Any, datamodule: Any, trainer: Any) -> RunLength:
    """The number of rollouts and evaluations the Trainer's limits allow (see the module docstring)."""
    world = trainer.world_size
    per_epoch = _limited(rollouts_per_epoch(datamodule, world), trainer.limit_train_batches)
    steps_per_rollout = module.algorithm.ppo_epochs * module.algorithm.num_minibatches
    seconds = max_time_s(trainer)
    epochs = trainer.max_epochs
    if epochs is None and trainer.max_steps == -1 and seconds is None:
        epochs = LIGHTNING_DEFAULT_EPOCHS
    limits = {}
    if epochs is not None and epochs >= 0:
        limits["trainer.max_epochs"] = epochs * per_epoch
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        limits["trainer.max_steps"] = math.ceil(trainer.max_steps / steps_per_rollout)
    bound_by = min(limits, key=lambda k: limits[k]) if limits else "trainer.max_time"
    rollouts = limits[bound_by] if limits else None
    val_batches = _limited(held_out_batches(datamodule, world), trainer.limit_val_batches)
    return RunLength(
        rollouts=rollouts,
        rollouts_per_epoch=per_epoch,
        epochs=None if rollouts is None else rollouts / max(1, per_epoch),
        evaluations=_evaluations(trainer, rollouts, per_epoch) if val_batches else 0,
        val_batches=val_batches,
        sanity_batches=min(val_batches, trainer.num_sanity_val_steps) if val_batches else 0,
        max_time_s=seconds,
        bound_by=bound_by,
    )


def _evaluations(trainer: Any, rollouts: int | None, per_epoch: int) -> int:
    """Validation runs in a fit of `rollouts` rollouts: every `val_check_interval` rollouts (an int), or at the
    given fractions of every `check_val_every_n_epoch`-th epoch."""
    if rollouts is None:
        return 0
    interval = trainer.val_check_interval
    every_epochs = trainer.check_val_every_n_epoch
    if isinstance(interval, int) and every_epochs is None:
        return rollouts // max(1, interval)
    per_epoch_runs = max(1, per_epoch // interval) if isinstance(interval, int) else max(1, int(1 / interval))
    whole_epochs = rollouts // max(1, per_epoch)
    return (whole_epochs // max(1, every_epochs or 1)) * per_epoch_runs
