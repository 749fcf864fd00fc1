"""Scoring that overlaps phase 3 (`model.overlap_scoring`): the rollout's scores are computed on one background
thread while the reference's and the sampling policy's forwards run on the training thread.

Phase 3's forwards read the responses, never the scores; only the advantages need them, so the scores are joined
right before those. Generation and decoding (the tokenizer is not thread-safe) stay on the training thread; the
thread runs `compute_scores` and the truncation and over-long shaping after it (`SingleTurnCollector.final_scores`),
i.e. the serial path's exact computation, so scores, experience and update are the same. The thread is a daemon, as in
`lit_rlhf.rewards.parallel`: a stuck checker never blocks the interpreter's exit, and the join waits in short
slices so Ctrl-C reaches the training thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.rollout.collect import RolloutTimings, Sampled, SingleTurnCollector
from lit_rlhf.types import PromptBatch, Rollout

_JOIN_SLICE_S = 0.1  # the join waits this long at a time, so a KeyboardInterrupt is seen between slices


@dataclass
class OverlapTimings(RolloutTimings):
    """`score_s`: decoding plus the scoring thread's own seconds; `score_wait_s`: how long the training thread
    waited for the scores after phase 3's forwards (0 when scoring was fully hidden)."""

    score_wait_s: float = 0.0


class PendingRollout:
    """A sampled rollout whose scores are computed on a daemon thread, started when this is made.

    `unscored`: the rollout for phase 3's forwards, its scores NaN (not known yet); `done`: an event set when the
    thread has finished; `scored()`: the rollout with its scores, once the thread is done (re-raising the thread's
    error, same type and message).
    """

    def __init__(self, sampled: Sampled, compute: Callable[[], Tensor], policy_version: int, timings: OverlapTimings):
        nan = torch.full((len(sampled.responses),), float("nan"), device=sampled.gen.response_ids.device)
        self.unscored = sampled.rollout(nan, policy_version)
        self._sampled = sampled  # its reward_parts are set by the scoring thread
        self.timings = timings
        self._compute = compute
        self.done = threading.Event()
        self._scores: Tensor | None = None
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._thread_state = thread_state()
        threading.Thread(target=self._run, name="lit_rlhf-scoring", daemon=True).start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with self._thread_state():
                self._scores = self._compute()
        except BaseException as err:  # handed to the training thread, which raises it
            self._error = err
        finally:
            self._seconds = time.perf_counter() - start
            self.done.set()

    def scored(self) -> Rollout:
        """Wait for the scores (interruptibly) and return the complete rollout; records the timings."""
        start = time.perf_counter()
        waited = not self.done.is_set()
        while not self.done.wait(_JOIN_SLICE_S):
            pass
        self.timings.score_wait_s = time.perf_counter() - start if waited else 0.0
        self.timings.score_s += self._seconds
        self._seconds = 0.0  # counted once, however often this is called
        if self._error is not None:
            raise self._error
        assert self._scores is not None  # the thread set one of the two
        return dataclasses.replace(self.unscored, scores=self._scores, reward_parts=self._sampled.reward_parts)


def start_rollout(
    collector: SingleTurnCollector, prompts: PromptBatch, policy_version: int = 0
) -> tuple[PendingRollout, OverlapTimings]:
    """`collector.collect`'s contract, except that it returns as soon as the responses are decoded, their scores
    being computed on a background thread (`PendingRollout`)."""
    sampled, sample_timings = collector.sample(prompts)
    timings = OverlapTimings(**dataclasses.asdict(sample_timings))
    return PendingRollout(sampled, lambda: collector.final_scores(sampled), policy_version, timings), timings


def split_pending(rollout: Rollout | PendingRollout) -> tuple[Rollout, Callable[[], Rollout]]:
    """The rollout phase 3's forwards read, and the call that gives the scored rollout (a join when pending)."""
    if isinstance(rollout, PendingRollout):
        return rollout.unscored, rollout.scored
    return rollout, lambda: rollout


def overlap_metrics(timings: Any) -> dict[str, float]:
    """`time/score_wait_s` with overlapped scoring (none without)."""
    return {"time/score_wait_s": timings.score_wait_s} if isinstance(timings, OverlapTimings) else {}


def thread_state() -> Callable[[], contextlib.AbstractContextManager]:
    """The training thread's thread-local torch state that scoring depends on (autocast, e.g. Lightning's
    bf16-mixed around a reward model, and the current CUDA device), to enter on the scoring thread."""
    autocast = [
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    ]
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def enter() -> Any:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        with contextlib.ExitStack() as stack:
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield

    return enter
