"""Reward functions and an optional reward model, combined with weights into one (B,) score per response.

The reward functions run one after another in the calling thread by default; `workers` runs them on a pool
of threads (a `rowwise` function's batch is split into consecutive chunks across it), and `timeout_s` bounds
each call (`lit_rlhf.rewards.parallel`). `isolation="process"` runs every function in worker processes instead
(max(1, workers) of them), and a function marked `isolated` (such as `math_verify_answer`) always runs there:
a call past `timeout_s` (or the function's own `isolated(timeout_s=...)`) is then killed with its process, a hard
limit. Either way the scores and their order are those of the plain loop. An `async def` function's calls are
awaited, all of a batch's at once on one event loop.

Each function's own scores (before weighting) are handed to whoever scores inside `reward_parts()`: the
collectors keep them on the rollout (`Rollout.reward_parts`), and the module logs their mean and std per function
(`reward/<name>/mean`, `reward/<name>/std`), as TRL logs `rewards/<name>/mean`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lit_rlhf.config import ConfigError
from lit_rlhf.models.reward_model import SequenceRewardModel
from lit_rlhf.rewards.binding import TrainerState
from lit_rlhf.rewards.functions import (
    RewardError,
    RewardFn,
    callable_name,
    check_picklable,
    check_signature,
    is_isolated,
    is_rowwise,
    own_timeout,
)
from lit_rlhf.rewards.isolation import ProcessWorkers
from lit_rlhf.rewards.parallel import RewardCall, chunked, run_calls, run_in_processes

RewardIsolation = Literal["thread", "process"]
"""Where reward functions run (`model.reward_isolation`): threads, or worker processes killed at the time limit."""
ISOLATION = get_args(RewardIsolation)

_PARTS: ContextVar[list[Tensor] | None] = ContextVar("lit_rlhf_reward_parts", default=None)


@contextlib.contextmanager
def reward_parts() -> Iterator[list[Tensor]]:
    """Collect, in the list given, the (B, F) reward-function scores of each `RewardComposer` call made inside
    (this thread's; F >= 1 functions, columns in `reward_fns` order)."""
    parts: list[Tensor] = []
    token = _PARTS.set(parts)
    try:
        yield parts
    finally:
        _PARTS.reset(token)


def one_part(parts: list[Tensor]) -> Tensor | None:
    """The (B, F) scores of the one composer call among `parts`; None for none or several (ambiguous)."""
    return parts[0] if len(parts) == 1 else None


class RewardComposer:
    """Weighted sum of reward functions and an optional reward model -> (B,) scores."""

    def __init__(
        self,
        reward_fns: Sequence[RewardFn] = (),
        weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
        timeout_s: float | None = None,
        workers: int = 0,
        isolation: RewardIsolation = "thread",
    ):
        self.reward_fns = list(reward_fns)
        if weights is None:
            weights = [1.0] * len(self.reward_fns)
        if len(weights) != len(self.reward_fns):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(self.reward_fns)} reward functions; "
                "give one weight per function"
            )
        self.weights = [float(w) for w in weights]
        self.reward_model_weight = reward_model_weight
        self.nan_score = nan_score
        seconds = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if timeout_s is not None and not (seconds and 0 < timeout_s < math.inf):
            raise ConfigError(f"model.reward_timeout_s: {timeout_s!r}; give a number of seconds > 0, or null for none")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(
                f"model.reward_workers: {workers!r}; give a whole number >= 0 (0: call the reward functions in turn)"
            )
        self.timeout_s, self.workers = timeout_s, workers
        if isolation not in ISOLATION:
            raise ConfigError(
                f"model.reward_isolation: {isolation!r}; use 'thread' (threads; a soft limit for code holding the "
                "GIL) or 'process' (worker processes killed on timeout: a hard limit)"
            )
        self.isolation = isolation
        for fn in self.reward_fns:
            check_signature(fn)
            if self.in_process(fn):
                check_picklable(fn)
        self.processes = ProcessWorkers(max(1, workers))

    def names(self) -> list[str]:
        """Each reward function's name in metrics: its short name, numbered (`name_2`, ...) when names repeat."""
        short = [callable_name(fn) for fn in self.reward_fns]
        return [
            name if short.count(name) == 1 else f"{name}_{short[:i].count(name) + 1}" for i, name in enumerate(short)
        ]

    def in_process(self, fn: RewardFn) -> bool:
        """Whether `fn` runs in a worker process (`isolation='process'`, or marked `isolated`)."""
        return self.isolation == "process" or is_isolated(fn)

    def close(self) -> None:
        """End the worker processes (they are daemons: they also end with this process)."""
        self.processes.close()

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        meta: dict[str, list[Any]],
        reward_model: SequenceRewardModel | None = None,
        sequence_ids: Tensor | None = None,
        sequence_mask: Tensor | None = None,
        last_index: Tensor | None = None,
        finished: Tensor | None = None,
        trainer_state: TrainerState | None = None,
    ) -> Tensor:
        """(B,) float32 scores on CPU. The reward model reads `sequence_ids` at `last_index` when it
        shares the policy tokenizer, else the prompt+response texts, with its EOS after each `finished` (B,)
        response (one that ended with the policy's EOS), as in reward-model training. `trainer_state` goes to the
        functions that take it."""
        total = torch.zeros(len(prompts), dtype=torch.float32)
        parts = self.function_scores(prompts, responses, meta, trainer_state)
        for weight, scores in zip(self.weights, parts, strict=True):
            total += weight * scores
        sink = _PARTS.get()
        if sink is not None and parts:
            sink.append(torch.stack(parts, dim=1))
        if reward_model is not None:
            if sequence_ids is None:
                raise ValueError("RewardComposer: a reward model needs sequence_ids (the policy's token ids)")
            if reward_model.tokenizer is None:
                if sequence_mask is None or last_index is None:
                    raise ValueError(
                        "RewardComposer: a reward model that shares the policy's tokenizer needs "
                        "sequence_mask and last_index"
                    )
                rm_scores = reward_model.score_ids(sequence_ids, sequence_mask, last_index)
            else:
                if finished is None:
                    raise ValueError("RewardComposer: a reward model with its own tokenizer needs `finished`")
                texts = [p + r for p, r in zip(prompts, responses, strict=True)]
                rm_scores = reward_model.score_texts(texts, finished, sequence_ids.device)
            total += self.reward_model_weight * rm_scores.cpu()
        if not math.isfinite(float(total.sum())):
            raise RewardError("the combined reward is not finite; check the reward model's outputs")
        return total

    def function_scores(
        self,
        prompts: list[str],
        responses: list[str],
        meta: dict[str, list[Any]],
        trainer_state: TrainerState | None = None,
    ) -> list[Tensor]:
        """Each reward function's checked (B,) scores, in the order of `reward_fns`."""
        calls: list[list[RewardCall]] = [
            chunked(fn, prompts, responses, meta, self.workers if is_rowwise(fn) else 1, trainer_state)
            for fn in self.reward_fns
        ]
        threaded = [
            c for fn, per_fn in zip(self.reward_fns, calls, strict=True) if not self.in_process(fn) for c in per_fn
        ]
        results = dict(
            zip(map(id, threaded), run_calls(threaded, self.nan_score, self.workers, self.timeout_s), strict=True)
        )
        for fn, per_fn in zip(self.reward_fns, calls, strict=True):  # one function at a time: its own limit
            if self.in_process(fn):
                timeout = self.timeout_s if self.timeout_s is not None else own_timeout(fn)
                results.update(
                    zip(map(id, per_fn), run_in_processes(self.processes, per_fn, self.nan_score, timeout), strict=True)
                )
        return [torch.cat([results[id(c)] for c in per_fn]) for per_fn in calls]
