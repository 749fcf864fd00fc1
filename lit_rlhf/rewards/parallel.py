"""Running reward-function calls with an optional per-call timeout: on daemon threads, or in worker processes.

Two kinds of workers, with different guarantees (docs/settings.md, "Which guarantee each mode gives"):

- threads (`run_calls`): cheap to start and share memory, but a Python thread cannot be killed. A call that
  overruns `timeout_s` fails the run with a `RewardError` as soon as the waiting thread runs again, and its thread
  is abandoned as a daemon (it dies with the process). That is at once for Python code and for C code that
  releases the GIL; a C call that holds the GIL (a big-integer power such as `10**(10**8)`, a regex) keeps the
  waiting thread from running at all, so a C-level watchdog (`faulthandler`) ends the process with status 1 and
  every thread's traceback on stderr when the call is still running `BACKSTOP_GRACE_S` seconds past its limit.
- processes (`lit_rlhf.rewards.isolation.ProcessWorkers`, `run_in_processes`): each call is sent to a worker
  process; one that overruns `timeout_s` is killed (SIGKILL) and replaced, and a `RewardError` is raised within
  `timeout_s` (plus a few milliseconds) whatever the call does: the hard limit. The functions must be picklable
  (defined at module level, named by dotted path) and so must their columns; workers start with the 'forkserver'
  method where there is one (else 'spawn'), never a plain fork of the training process (its threads and CUDA
  state).

An `async def` function's calls do not take a thread: a batch's async calls all run concurrently on one event loop
(`gather_async`), each within `timeout_s` (a call past it is cancelled), before the other calls run.

Daemon threads are used instead of `concurrent.futures`, whose workers the interpreter joins at exit (a stuck
call would then hang the exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lit_rlhf.rewards.binding import TrainerState, is_async, run_on_own_loop, start
from lit_rlhf.rewards.functions import (
    RewardError,
    RewardFn,
    check_scores,
    invoke,
    private_columns,
    raised_error,
    run_in_workers,
    timeout_error,
)
from lit_rlhf.rewards.isolation import ProcessWorkers

BACKSTOP_GRACE_S = 2.0
"""Seconds past a thread call's timeout after which the watchdog ends a process whose waiting thread cannot run."""


@dataclass
class RewardCall:
    """One call of `fn` on rows [offset, offset + len(prompts)) of the batch, checked against the contract."""

    fn: RewardFn
    prompts: list[str]
    responses: list[str]
    meta: dict[str, list[Any]]
    offset: int = 0
    state: TrainerState | None = None

    def __call__(self, nan_score: float | None) -> Tensor:
        return self.checked(invoke(self.fn, self.prompts, self.responses, self.meta, self.state), nan_score)

    def checked(self, raw: Any, nan_score: float | None) -> Tensor:
        """`raw`, this call's answer, checked against the contract -> (b,) scores."""
        return check_scores(self.fn, raw, self.prompts, self.responses, nan_score, self.offset)

    async def awaited(self, nan_score: float | None, timeout_s: float | None) -> Tensor:
        """This call of an async function, awaited within `timeout_s` (cancelled past it) and checked."""
        try:
            answer = start(self.fn, self.prompts, self.responses, private_columns(self.meta), self.state)
            raw = await asyncio.wait_for(answer, timeout_s) if asyncio.iscoroutine(answer) else answer
        except TimeoutError as err:
            raise timeout_error(self.fn, self.prompts, timeout_s or 0.0, "cancelled") from err
        except (KeyboardInterrupt, asyncio.CancelledError):
            raise
        except BaseException as err:  # user code, as `invoke`
            raise raised_error(self.fn, self.prompts, err) from err
        return self.checked(raw, nan_score)


def chunked(
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    meta: dict[str, list[Any]],
    n: int,
    state: TrainerState | None = None,
) -> list[RewardCall]:
    """`n` calls of `fn` on consecutive slices of the batch (sizes differ by at most one), in order."""
    b, n = len(prompts), max(1, min(n, len(prompts)))
    bounds = [b * i // n for i in range(n + 1)]
    return [
        RewardCall(fn, prompts[lo:hi], responses[lo:hi], {k: v[lo:hi] for k, v in meta.items()}, lo, state)
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

    The calls of async functions first, all at once (`gather_async`); then the others: workers 0: one call at a
    time (in this thread when there is no timeout); n: up to n calls at once. The first failure seen (lowest call
    index) or the first call past `timeout_s` raises here.
    """
    waits = [i for i, c in enumerate(calls) if is_async(c.fn)]
    if waits:
        done = dict(zip(waits, gather_async([calls[i] for i in waits], nan_score, timeout_s), strict=True))
        rest = [i for i in range(len(calls)) if i not in done]
        done.update(zip(rest, run_calls([calls[i] for i in rest], nan_score, workers, timeout_s), strict=True))
        return [done[i] for i in range(len(calls))]
    if workers == 0 and timeout_s is None:
        return [call(nan_score) for call in calls]
    pool = _Pool(calls, nan_score, [_Slot() for _ in calls])
    n_threads = max(1, min(workers, len(calls)))
    with _watchdog(timeout_s, len(calls), n_threads):  # armed first: a started call may never give the GIL back
        for _ in range(n_threads):
            threading.Thread(target=pool.work, name="lit_rlhf-reward", daemon=True).start()
        return _wait(pool, calls, timeout_s)


def gather_async(calls: list[RewardCall], nan_score: float | None, timeout_s: float | None) -> list[Tensor]:
    """The checked scores of calls of async functions, in order, all awaited concurrently on one event loop."""

    async def everything() -> list[Tensor]:
        return list(await asyncio.gather(*(call.awaited(nan_score, timeout_s) for call in calls)))

    return run_on_own_loop(everything())


def _wait(pool: _Pool, calls: list[RewardCall], timeout_s: float | None) -> list[Tensor]:
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
    return timeout_error(call.fn, call.prompts, timeout_s, "thread")


def run_in_processes(
    workers: ProcessWorkers, calls: list[RewardCall], nan_score: float | None, timeout_s: float | None
) -> list[Tensor]:
    """Each call's checked scores, in order, from worker processes (`lit_rlhf.rewards.isolation`)."""
    state = calls[0].state if calls else None
    return run_in_workers(
        workers, [(c.fn, c.prompts, c.responses, c.meta, c.offset) for c in calls], nan_score, timeout_s, state
    )


@contextlib.contextmanager
def _watchdog(timeout_s: float | None, n_calls: int, n_threads: int) -> Iterator[None]:
    """End the process (status 1, every thread's traceback on stderr) if the waiting thread is still blocked
    BACKSTOP_GRACE_S after the last call could have timed out: only a call holding the GIL can cause that."""
    stderr = sys.__stderr__
    try:
        fd = stderr.fileno() if stderr is not None and timeout_s is not None else None
    except (OSError, ValueError):
        fd = None
    if fd is None or timeout_s is None:
        yield
        return
    rounds = -(-n_calls // n_threads)  # calls run one after another on each thread
    faulthandler.dump_traceback_later(rounds * timeout_s + BACKSTOP_GRACE_S, exit=True, file=fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
