"""Lightning's own tools, checked against what one RLHF step is, before anything expensive runs.

- `trainer.fit(torch.compile(module))` is refused in `setup`: Lightning would compile the whole training step.
- `Tuner(trainer).lr_find(...)` (the `LearningRateFinder` callback) is refused with the other callbacks that
  cannot act on an RL step (`callback_checks`).
- A checkpoint callback counting optimizer steps (`ModelCheckpoint(every_n_train_steps=k)`) is checked at fit start
  against the optimizer steps of one rollout (`ppo_epochs x num_minibatches`): checkpoints are only considered
  between rollouts, so a k that is not a multiple saves less often than asked; a warning names the multiple.
  `trainer.max_steps` is checked the same way: a run ends only after a whole rollout, past a `max_steps` that is
  not a multiple.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf.config import AlgorithmConfig, ConfigError

COMPILED_MODULE = (
    "trainer.fit(torch.compile(module)): Lightning then compiles the whole training step (the sampling loop, the "
    "reward calls, Python control flow over each rollout), which Dynamo recompiles for every new shape and cannot "
    "capture (minutes, then an internal error). Fit the module itself, trainer.fit(module), and set "
    "sampling.backend: compiled, which compiles the decode loop over static, bucketed shapes"
)


class LightningToolChecks(L.LightningModule):
    """For a module with `algorithm`: refuses a compiled module in `setup`, warns at fit start about
    step-counting checkpoint callbacks that cannot fire as often as asked."""

    algorithm: AlgorithmConfig

    def setup(self, stage: str) -> None:
        if getattr(self, "_compiler_ctx", None) is not None:  # set by Lightning for a torch.compile'd module
            raise ConfigError(COMPILED_MODULE)
        super().setup(stage)

    def on_fit_start(self) -> None:
        messages = checkpoint_cadence_warnings(self.trainer.checkpoint_callbacks, self.algorithm)
        for message in [*messages, max_steps_warning(self.trainer.max_steps, self.algorithm)]:
            if message:
                warnings.warn(message, stacklevel=2)
        super().on_fit_start()


def max_steps_warning(max_steps: int, algo: AlgorithmConfig) -> str | None:
    """A warning when `max_steps` (optimizer steps) is not a multiple of the optimizer steps per rollout: the
    rollout that crosses it runs to its end, so the run takes more steps than asked (and a learning-rate schedule
    that ends at `max_steps` has its last steps past its end)."""
    per_rollout = algo.ppo_epochs * algo.num_minibatches
    if max_steps is None or max_steps <= 0 or max_steps % per_rollout == 0:
        return None
    ends_at = max_steps + per_rollout - max_steps % per_rollout
    return (
        f"trainer.max_steps: {max_steps} counts optimizer steps, and each rollout takes {per_rollout} (ppo_epochs "
        f"{algo.ppo_epochs} x num_minibatches {algo.num_minibatches}); a rollout is not cut short, so the run ends "
        f"at step {ends_at} ({ends_at // per_rollout} rollouts). Use a multiple of {per_rollout}"
    )


def checkpoint_cadence_warnings(callbacks: list[Any], algo: AlgorithmConfig) -> list[str]:
    """One warning per `ModelCheckpoint` whose `every_n_train_steps` is not a multiple of the optimizer steps per
    rollout: it is checked once per rollout, so it saves every lcm(k, per rollout) optimizer steps."""
    per_rollout = algo.ppo_epochs * algo.num_minibatches
    messages = []
    for callback in callbacks:
        every = getattr(callback, "_every_n_train_steps", 0) if isinstance(callback, ModelCheckpoint) else 0
        if not every or every % per_rollout == 0:
            continue
        saves_every = math.lcm(every, per_rollout)
        multiple = every + per_rollout - every % per_rollout  # the next multiple up
        messages.append(
            f"ModelCheckpoint(every_n_train_steps={every}) counts optimizer steps, and each rollout takes "
            f"{per_rollout} (ppo_epochs {algo.ppo_epochs} x num_minibatches {algo.num_minibatches}); checkpoints are "
            f"only considered between rollouts, so it saves every {saves_every} optimizer steps "
            f"({saves_every // per_rollout} rollouts), not every {every}. Use a multiple of {per_rollout}, e.g. "
            f"every_n_train_steps={multiple} (= {multiple // per_rollout} rollouts)"
        )
    return messages
