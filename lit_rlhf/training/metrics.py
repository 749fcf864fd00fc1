"""The metrics of a training step (docs/design.md, Metrics), their averaging between log writes, and the
prompt/response samples written to every logger."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.loggers import CSVLogger, Logger
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities.rank_zero import WarningCache

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


def reward_part_metrics(exp: Experience, names: list[str]) -> dict[str, float]:
    """`reward/<name>/mean` and `reward/<name>/std` of each reward function's own scores (before weighting and
    truncation handling) in this experience, as TRL logs `rewards/<name>/mean` and `/std`; none when the rollout
    has no such scores (no reward functions, or a `compute_scores` override that bypasses the composer)."""
    parts = exp.reward_parts
    if parts is None or parts.shape[1] != len(names):
        return {}
    metrics: dict[str, float] = {}
    for name, scores in zip(names, parts.float().unbind(1), strict=True):
        metrics[f"reward/{name}/mean"] = float(scores.mean())
        metrics[f"reward/{name}/std"] = float(scores.std()) if exp.batch_size > 1 else 0.0
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


SAMPLE_COLUMNS = ("prompt", "response", "score")

# the characters escaped in a markdown table cell (in one pass), each escape read literally by Python-Markdown
# (TensorBoard's renderer): `|` so a cell never splits; `<`, `>`, `&` as entities so `<|im_start|>` or `<s>` stay
# text; the backslash, backtick, `*`, `_`, `[`, `]` so no code span, emphasis or link appears
_CELL_ESCAPES = {
    "\\": "\\\\",
    "`": "\\`",
    "|": "\\|",
    "*": "\\*",
    "_": "\\_",
    "[": "\\[",
    "]": "\\]",
    "&": "&amp;",
    "<": "&lt;",
    ">": "&gt;",
}
_CELL_SPECIAL = re.compile("|".join(re.escape(c) for c in _CELL_ESCAPES))
_NEWLINE = re.compile(r"\r\n|\r|\n")
_unsupported_loggers = WarningCache()


def sample_rows(
    prompts: list[str], responses: list[str], scores: list[float], group_size: int, count: int = 4
) -> list[dict[str, Any]]:
    """Rows {"prompt", "response", "score"} for up to `count` distinct prompts: the first sample of each group.

    prompts, responses, scores: B = B0 x G entries, each prompt repeated G = `group_size` times in a row.
    """
    return [
        {"prompt": prompts[i], "response": responses[i], "score": float(scores[i])}
        for i in range(0, len(prompts), group_size)[:count]
    ]


def markdown_cell(text: str) -> str:
    """`text` as one markdown table cell's content: no character in it can end the cell or the row, or render as
    markup; line breaks become `<br>`."""
    escaped = _CELL_SPECIAL.sub(lambda m: _CELL_ESCAPES[m.group()], text)
    return _NEWLINE.sub("<br>", escaped)


def samples_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of sample rows, one line per row, the texts escaped (`markdown_cell`)."""
    lines = ["| prompt | response | score |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {markdown_cell(row['prompt'])} | {markdown_cell(row['response'])} | {row['score']:.3f} |")
    return "\n".join(lines)


def write_samples(
    loggers: Sequence[Logger], rows: Sequence[Mapping[str, Any]], step: int, tag: str = "samples"
) -> None:
    """The sample rows to every logger, each in its own way (call on rank 0 only):

    - CSVLogger: JSON lines {"step", "tag", "prompt", "response", "score"} appended to `<log_dir>/samples.jsonl`;
    - a logger with `log_text(key, columns, data, step)` (WandbLogger): a table under `tag`;
    - an experiment with `add_text` (TensorBoardLogger): the escaped markdown table (`samples_markdown`) under `tag`;
    - a logger with a `run_id` whose experiment has `log_dict` (MLFlowLogger): an artifact `<tag>/step_<step>.json`
      holding {"columns", "data"}, MLflow's table layout;
    - any other logger: nothing, and a warning naming its class (once per class).
    """
    data = [[str(row["prompt"]), str(row["response"]), float(row["score"])] for row in rows]
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            append_jsonl(logger.log_dir, step, tag, data)
            continue
        log_text = getattr(logger, "log_text", None)
        if callable(log_text):
            log_text(key=tag, columns=list(SAMPLE_COLUMNS), data=data, step=step)
            continue
        experiment: Any = getattr(logger, "experiment", None)
        if callable(getattr(experiment, "add_text", None)):
            experiment.add_text(tag, samples_markdown(rows), global_step=step)
        elif callable(getattr(experiment, "log_dict", None)) and (run_id := getattr(logger, "run_id", None)):
            table = {"columns": list(SAMPLE_COLUMNS), "data": data}
            experiment.log_dict(run_id, table, f"{tag}/step_{step:08d}.json")
        else:
            _unsupported_loggers.warn(
                f"lit_rlhf writes no prompt/response samples to {type(logger).__name__}: it is not a CSVLogger and"
                " has none of the text APIs it knows (`log_text`, `experiment.add_text`, MLflow's"
                " `experiment.log_dict`)."
            )


def append_jsonl(log_dir: str, step: int, tag: str, data: list[list[Any]]) -> None:
    """Sample rows [prompt, response, score] as JSON lines appended to `<log_dir>/samples.jsonl`."""
    fs = get_filesystem(log_dir)
    fs.makedirs(log_dir, exist_ok=True)
    with fs.open(os.path.join(log_dir, "samples.jsonl"), "a", encoding="utf-8") as file:
        for prompt, response, score in data:
            record = {"step": step, "tag": tag, "prompt": prompt, "response": response, "score": score}
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


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
