"""Running reward-function calls with an optional per-call timeout, on a pool of daemon threads.

A Python thread cannot be killed: a call that overruns `timeout_s` fails the run with a `RewardError`, and its
thread is abandoned as a daemon (it dies with the process, which still exits with the error's non-zero status).
Daemon threads are used instead of `concurrent.futures`, whose workers the interpreter joins at exit (a stuck
call would then hang the exit).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lit_rlhf.rewards.functions import RewardError, RewardFn, check_scores, invoke


@dataclass
class RewardCall:
    """One call of `fn` on rows [offset, offset + len(prompts)) of the batch, checked against the contract."""

    fn: RewardFn
    prompts: list[str]
    responses: list[str]
    meta: dict[str, list[Any]]
    offset: int = 0

    def __call__(self, nan_score: float | None) -> Tensor:
        raw = invoke(self.fn, self.prompts, self.responses, self.meta)
        return check_scores(self.fn, raw, self.prompts, self.responses, nan_score, self.offset)


def chunked(
    fn: RewardFn, prompts: list[str], responses: list[str], meta: dict[str, list[Any]], n: int
) -> list[RewardCall]:
    """`n` calls of `fn` on consecutive slices of the batch (sizes differ by at most one), in order."""
    b, n = len(prompts), max(1, min(n, len(prompts)))
    bounds = [b * i // n for i in range(n + 1)]
    return [
        RewardCall(fn, prompts[lo:hi], responses[lo:hi], {k: v[lo:hi] for k, v in meta.items()}, lo)
        for lo, hi in itertools.pairwise(bounds)
    ]


@dataclass
class _Slot:
    started: float | None = None
    done: bool = False
    value: Tensor | None = None
    error: BaseException | None = None


@dataclass
class _Pool:
    calls: list[RewardCall]
    nan_score: float | None
    slots: list[_Slot] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    next_call: int = 0
    stop: bool = False

    def work(self) -> None:
        while True:
            with self.cond:
                if self.stop or self.next_call == len(self.calls):
                    return
                i, self.next_call = self.next_call, self.next_call + 1
                self.slots[i].started = time.monotonic()
                self.cond.notify_all()  # the caller now watches this call's deadline
            value, error = None, None
            try:
                value = self.calls[i](self.nan_score)
            except BaseException as err:  # handed to the caller's thread, which raises it
                error = err
            with self.cond:
                self.slots[i].value, self.slots[i].error, self.slots[i].done = value, error, True
                self.cond.notify_all()


def run_calls(
    calls: list[RewardCall], nan_score: float | None = None, workers: int = 0, timeout_s: float | None = None
) -> list[Tensor]:
    """Each call's checked (b,) scores, in the order of `calls`, whatever order they finish in.

    workers 0: one call at a time (in this thread when there is no timeout); n: up to n calls at once.
    The first failure seen (lowest call index) or the first call past `timeout_s` raises here.
    """
    if workers == 0 and timeout_s is None:
        return [call(nan_score) for call in calls]
    pool = _Pool(calls, nan_score, [_Slot() for _ in calls])
    for _ in range(max(1, min(workers, len(calls)))):
        threading.Thread(target=pool.work, name="lit_rlhf-reward", daemon=True).start()
    with pool.cond:
        try:
            while not all(s.done for s in pool.slots):
                failed = [s.error for s in pool.slots if s.error is not None]
                if failed:
                    raise failed[0]
                now, deadlines = time.monotonic(), []
                for slot, call in zip(pool.slots, calls, strict=True):
                    if timeout_s is not None and slot.started is not None and not slot.done:
                        if now - slot.started >= timeout_s:
                            raise _timeout_error(call, timeout_s)
                        deadlines.append(slot.started + timeout_s)
                pool.cond.wait(min(deadlines) - now if deadlines else None)
        finally:
            pool.stop = True
    failed = [s.error for s in pool.slots if s.error is not None]
    if failed:
        raise failed[0]
    return [s.value for s in pool.slots if s.value is not None]  # every call returned: all set


def _timeout_error(call: RewardCall, timeout_s: float) -> RewardError:
    name = getattr(call.fn, "__qualname__", None) or type(call.fn).__name__
    return RewardError(
        f"reward function {name} did not return within reward_timeout_s={timeout_s:g} s (batch of "
        f"{len(call.prompts)}, first prompt {call.prompts[0]!r}); the run stops here and its thread is left running "
        "as a daemon (Python cannot stop a thread). Make the function faster or raise model.reward_timeout_s"
    )
