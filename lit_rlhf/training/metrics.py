"""The metrics of a training step (docs/design.md, Metrics), their averaging between log writes, and the
samples table."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from lit_rlhf.algorithms import losses
from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.types import Experience


def rollout_metrics(exp: Experience, algo: AlgorithmConfig) -> dict[str, float]:
    """The rollout and objective metrics of one experience."""
    mask = exp.response_mask
    metrics = {
        "rollout/score_mean": float(exp.scores.mean()),
        "rollout/score_std": float(exp.scores.std()) if exp.batch_size > 1 else 0.0,
        "rollout/response_len_mean": float(mask.sum(1).float().mean()),
        "rollout/frac_truncated": float(exp.truncated.float().mean()),
    }
    kl_per_seq = losses.masked_sum(exp.kl, mask, dim=1) if exp.kl is not None else torch.zeros_like(exp.scores)
    reward = exp.scores - (algo.filled.kl_coef * kl_per_seq if algo.kl_in_reward else 0.0)
    metrics["rollout/reward_mean"] = float(reward.mean())
    metrics["rollout/reward_std"] = float(reward.std()) if exp.batch_size > 1 else 0.0
    metrics["objective/kl"] = float(kl_per_seq.mean())
    group_size = algo.filled.group_size
    if group_size > 1:
        grouped = exp.scores.view(-1, group_size)
        metrics["rollout/frac_reward_zero_std"] = float((grouped.std(1) == 0).float().mean())
    if exp.values is not None and exp.returns is not None:
        metrics["value/explained_variance"] = float(losses.explained_variance(exp.values, exp.returns, mask))
        metrics["value/mean"] = float(losses.masked_mean(exp.values, mask))
    return metrics


class MetricWindow:
    """Each metric's mean over the steps since the last log write (as TRL averages over `logging_steps`).

    Keys in `last_value_keys` (counters, the learning rate) report their latest value instead of a mean.
    """

    def __init__(self, last_value_keys: Iterable[str] = ()):
        self.last_value_keys = frozenset(last_value_keys)
        self.clear()

    def clear(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1
            self._last[key] = value

    def values(self) -> dict[str, float]:
        return {
            key: self._last[key] if key in self.last_value_keys else total / self._counts[key]
            for key, total in self._sums.items()
        }


def mean_over(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over `rows` (all with the same keys)."""
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}


def trainer_writes_logs(trainer: Any, step: int) -> bool:
    """Whether the Trainer writes logged metrics at training batch `step` (1-based, counted over the whole
    run): every `log_every_n_steps` batches and when it is about to stop, as Lightning decides it."""
    every = trainer.log_every_n_steps
    return bool(every) and (step % every == 0 or trainer.should_stop)


def samples_table(exp: Experience, group_size: int, count: int = 4) -> str:
    """A markdown table of prompts, responses and scores, one row from each of `count` different prompts."""
    lines = ["| prompt | response | score |", "|---|---|---|"]
    for i in list(range(0, exp.batch_size, group_size))[:count]:
        lines.append(f"| `{exp.prompts[i]}` | `{exp.responses[i]}` | {float(exp.scores[i]):.3f} |")
    return "\n".join(lines)


def write_samples(logger: Any, table: str, step: int) -> None:
    """The samples table to a logger that takes text (TensorBoard's `add_text`); others are skipped."""
    experiment = getattr(logger, "experiment", None) if logger is not None else None
    if experiment is not None and hasattr(experiment, "add_text"):
        experiment.add_text("samples", table, global_step=step)


class PhaseClock:
    """Wall time of a training step's phases: `mark(name)` ends the phase that ran since the last mark."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now

    def total_s(self) -> float:
        return max(self.last - self.start, 1e-9)

    def metrics(self, rollout_timings: Any) -> dict[str, float]:
        """`time/*` metrics; `time/rollout_s` spans generation, scoring and evaluation, as it always has."""
        return {
            "time/generate_s": rollout_timings.generate_s,
            "time/score_s": rollout_timings.score_s,
            "time/evaluate_s": self.phases["evaluate"],
            "time/rollout_s": self.phases["rollout"] + self.phases["evaluate"],
            "time/update_s": self.phases["update"],
        }
