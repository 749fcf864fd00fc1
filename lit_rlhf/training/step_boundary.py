"""Checkpoints written while a training step is still running (`OnExceptionCheckpoint`, a save on SIGTERM, any
save from an exception handler) hold the state of that step's start, so a resume trains the failed rollout again.

A step moves the counters, the RNG streams and the DataModule's position before its weights change (sampling and
scoring come first). A checkpoint taken after a reward function raised at rollout 3 would otherwise pair the
weights of step 2 with the position after rollout 3: the resumed run never trains that batch. Here the counters,
the update's shuffling generator and the RNG streams saved are those from the step's start, and
`RolloutDataModule` saves the position before the batch (`training_step_running`): resumed == uninterrupted. If
the step had already taken optimizer steps, the weights hold part of its update; that is warned about.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lit_rlhf.data.handoff import training_step_running
from lit_rlhf.training.state import TrainingState


@dataclass
class StepStart:
    """What a training step changes before its update, as it was when the step began."""

    rollouts_done: int
    policy_version: int
    update_generator: Tensor
    torch_rng: Tensor
    cuda_rng: list[Tensor] | None

    @classmethod
    def now(cls, state: TrainingState) -> StepStart:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return cls(
            state.rollouts_done,
            state.policy_version,
            state.update_generator.get_state(),
            torch.get_rng_state(),
            cuda,
        )

    def put_back(self, state: TrainingState) -> None:
        state.rollouts_done = self.rollouts_done
        state.update_generator.set_state(self.update_generator)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


class StepBoundary(L.LightningModule):
    """For a module with `state` (a `TrainingState`) whose `on_save_checkpoint` (further along the MRO) saves it:
    a checkpoint written while `training_step` runs saves the state of the step's start."""

    state: TrainingState
    _step_start: StepStart | None = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self._step_start = StepStart.now(self.state)
        return super().on_train_batch_start(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        start = self._step_start if training_step_running(self._trainer) else None
        if start is None:
            super().on_save_checkpoint(checkpoint)
            return
        if start.policy_version != self.state.policy_version:
            warnings.warn(
                f"checkpoint written during rollout {self.state.rollouts_done}, after "
                f"{self.state.policy_version - start.policy_version} of its optimizer steps: its weights hold part "
                "of that rollout's update, and a resume trains the rollout again from its start",
                stacklevel=2,
            )
        with state_at(self.state, start):
            super().on_save_checkpoint(checkpoint)


@contextlib.contextmanager
def state_at(state: TrainingState, start: StepStart) -> Iterator[None]:
    """`state` and the RNG streams as at `start` inside the block, as they are now after it."""
    now = StepStart.now(state)
    start.put_back(state)
    try:
        yield
    finally:
        now.put_back(state)
