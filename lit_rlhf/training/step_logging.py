"""Phase 5 of a training step: metrics to Lightning's loggers and the progress bar, samples to every logger."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lit_rlhf.training import metrics as logs
from lit_rlhf.training.tensorboard_layout import write_first_screen
from lit_rlhf.types import Experience


class StepLogging(L.LightningModule):
    """`RLHFModule`'s logging of a training step."""

    state: Any
    algorithm: Any
    metric_window: logs.MetricWindow
    step_metrics: dict[str, float]

    def on_train_start(self) -> None:
        """Give every TensorBoard logger the custom-scalars layout it opens on (reward, held-out metrics, KL,
        entropy, step time), once per fit."""
        write_first_screen(self.loggers)

    def log_step(self, metrics: dict[str, float], experience: Experience) -> None:
        """Phase 5: the progress-bar reward every step; every metric, averaged over the steps since the last
        write, on the steps the Trainer writes logs (`log_every_n_steps`); samples every
        `log_samples_every_n_steps` rollouts.

        Lightning's `self.log` costs about 0.25 ms per metric per call on a CPU, several ms per step for the
        ~25 metrics, so they are only handed to it when they will be written.
        """
        self.step_metrics = metrics
        batch_size = experience.batch_size
        reward = metrics["rollout/reward_mean"]
        self.log("reward", reward, prog_bar=True, logger=False, sync_dist=True, batch_size=batch_size)
        self.log("kl", metrics["objective/kl"], prog_bar=True, logger=False, sync_dist=True, batch_size=batch_size)
        self.metric_window.add(metrics)
        if logs.trainer_writes_logs(self.trainer, self.state.rollouts_done):
            self.log_dict(self.metric_window.values(), on_step=True, sync_dist=True, batch_size=batch_size)
            self.metric_window.clear()
        self.expose_metrics(metrics)
        every = self.hparams["log_samples_every_n_steps"]
        if every and self.global_rank == 0 and (self.state.rollouts_done - 1) % every == 0:
            scores, group = experience.scores.tolist(), self.algorithm.filled.group_size
            rows = logs.sample_rows(experience.prompts, experience.responses, scores, group)
            logs.write_samples(self.loggers, rows, self.global_step)

    def expose_metrics(self, metrics: dict[str, float]) -> None:
        """Every metric of this step into the Trainer's callback metrics (this rank's values, a few microseconds),
        so a `ModelCheckpoint`, `EarlyStopping` or scheduler `monitor` finds any of them on every step, not only
        on the steps the Trainer writes logs; what `self.log` handed over takes precedence where both have it."""
        callback_metrics = self.trainer.callback_metrics
        for name, value in metrics.items():
            callback_metrics[name] = torch.tensor(value)
