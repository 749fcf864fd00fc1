"""The training progress handed to reward functions as TRL's `trainer_state`, read from the Lightning Trainer."""

from __future__ import annotations

import math
from typing import Any

from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.rewards.binding import TrainerState


def reward_trainer_state(trainer: Any, algo: AlgorithmConfig) -> TrainerState:
    """The progress of `trainer` (None: not attached, all zeros): optimizer steps so far, fractional epochs, and
    the optimizer steps the run will take (`trainer.max_steps`, else the rollouts it will run x the optimizer steps
    per rollout, `ppo_epochs x num_minibatches`; -1 when unbounded)."""
    if trainer is None:
        return TrainerState()
    per_epoch = trainer.num_training_batches
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    epoch = float(trainer.current_epoch)
    if isinstance(per_epoch, int | float) and 0 < per_epoch < math.inf:
        epoch += min(done, per_epoch) / per_epoch
    max_steps = trainer.max_steps
    if max_steps == -1 and trainer.max_epochs not in (None, -1) and 0 < per_epoch < math.inf:
        max_steps = int(per_epoch) * trainer.max_epochs * algo.ppo_epochs * algo.num_minibatches
    return TrainerState(global_step=int(trainer.global_step), epoch=epoch, max_steps=int(max_steps))
