"""Running reward-function calls with an optional per-call timeout: on daemon threads, or in worker processes.

Two kinds of workers, with different guarantees (`docs/performance.md`, "Reward timeouts"):

- threads (`run_calls`): cheap to start and share memory, but a Python thread cannot be killed. A call that
  overruns `timeout_s` fails the run with a `RewardError` as soon as the waiting thread runs again, and its thread
  is abandoned as a daemon (it dies with the process). That is at once for Python code and for C code that
  releases the GIL; a C call that holds the GIL (a big-integer power such as `10**(10**8)`, a regex) keeps the
  waiting thread from running at all, so a C-level watchdog (`faulthandler`) ends the process with status 1 and
  every thread's traceback on stderr when the call is still running `BACKSTOP_GRACE_S` seconds past its limit.
- processes (`ProcessWorkers`): each call is sent to a worker process; one that overruns `timeout_s` is killed
  (SIGKILL) and replaced, and a `RewardError` is raised within `timeout_s` (plus a few milliseconds) whatever the
  call does: the hard limit. The functions must be picklable (defined at module level, named by dotted path) and
  so must their columns; workers start with the 'forkserver' method where there is one (else 'spawn'), never a
  plain fork of the training process (its threads and CUDA state).

Daemon threads are used instead of `concurrent.futures`, whose workers the interpreter joins at exit (a stuck
call would then hang the exit).
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from torch import Tensor

from lit_rlhf.rewards.functions import RewardError, RewardFn, callable_path, check_scores, invoke

BACKSTOP_GRACE_S = 2.0
"""Seconds past a thread call's timeout after which the watchdog ends a process whose waiting thread cannot run."""
START_TIMEOUT_S = 300.0
"""Seconds a new worker process may take to start (not counted in a call's timeout)."""


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
    n_threads = max(1, min(workers, len(calls)))
    with _watchdog(timeout_s, len(calls), n_threads):  # armed first: a started call may never give the GIL back
        for _ in range(n_threads):
            threading.Thread(target=pool.work, name="lit_rlhf-reward", daemon=True).start()
        return _wait(pool, calls, timeout_s)


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


def _timeout_error(call: RewardCall, timeout_s: float, killed: bool = False) -> RewardError:
    name = getattr(call.fn, "__qualname__", None) or type(call.fn).__name__
    fate = (
        "its worker process was killed"
        if killed
        else "its thread is left running as a daemon (Python cannot stop a thread)"
    )
    return RewardError(
        f"reward function {name} did not return within reward_timeout_s={timeout_s:g} s (batch of "
        f"{len(call.prompts)}, first prompt {call.prompts[0]!r}); the run stops here and {fate}. Make the function "
        "faster or raise model.reward_timeout_s"
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


def default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _serve(conn: Connection) -> None:
    """A worker process: run (fn, prompts, responses, meta) requests until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, prompts, responses, meta = pickle.loads(request)
            reply: tuple[Any, ...] = ("ok", fn(prompts, responses, **meta))
            payload = pickle.dumps(reply)
        except BaseException as err:  # user code: reported to the parent, which raises a RewardError
            payload = pickle.dumps(("error", type(err).__name__, str(err), traceback.format_exc()))
        conn.send_bytes(payload)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False


class ProcessWorkers:
    """Up to `size` worker processes for reward calls, started when first needed and reused; a worker whose call
    overruns its timeout (or that dies) is killed and replaced by a fresh one at the next call.

    Safe to deepcopy or pickle (the copy starts its own workers); `close()` ends the workers (they are daemons,
    so they end with this process anyway)."""

    def __init__(self, size: int = 1, start_method: str | None = None):
        self.size = max(1, int(size))
        self.start_method = start_method or default_start_method()
        self._workers: list[_Worker | None] = [None] * self.size
        self.started = 0  # processes started so far (tests and logs)

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "start_method": self.start_method}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["size"], state["start_method"])  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> ProcessWorkers:
        return ProcessWorkers(self.size, self.start_method)

    def _start(self, i: int) -> _Worker:
        worker = self._workers[i]
        if worker is not None and worker.process.is_alive():
            return worker
        ctx: Any = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(["lit_rlhf.rewards.parallel"])
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child,), name=f"lit_rlhf-reward-{i}", daemon=True)
        process.start()
        child.close()
        self.started += 1
        self._workers[i] = _Worker(process, parent)
        return self._workers[i]  # type: ignore[return-value]

    def _await_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        if not worker.conn.poll(START_TIMEOUT_S):
            raise RewardError(f"a reward worker process did not start within {START_TIMEOUT_S:g} s")
        try:
            worker.conn.recv_bytes()
        except EOFError as err:
            raise RewardError(
                f"a reward worker process ended while starting (exit code {worker.process.exitcode}); with the "
                "'spawn' start method the main script must guard its code with `if __name__ == '__main__':`"
            ) from err
        worker.ready = True

    def kill(self, i: int) -> None:
        worker, self._workers[i] = self._workers[i], None
        if worker is not None:
            worker.process.kill()
            worker.process.join(5)
            worker.conn.close()

    def close(self) -> None:
        for i in range(self.size):
            self.kill(i)

    def run(self, calls: list[RewardCall], nan_score: float | None, timeout_s: float | None) -> list[Tensor]:
        """Each call's checked scores in order; up to `size` at once; the first failure or overrun raises (its
        worker, and every worker still busy, is killed first)."""
        results: list[Tensor | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (call index, deadline start)
        try:
            while pending or busy:
                for i in range(self.size):
                    if pending and i not in busy:
                        worker = self._start(i)
                        self._await_ready(worker)
                        j = pending.pop(0)
                        call = calls[j]
                        worker.conn.send_bytes(_request(call))
                        busy[i] = (j, time.monotonic())
                now = time.monotonic()
                wait_s = None
                if timeout_s is not None:
                    wait_s = max(0.0, min(start + timeout_s for _, start in busy.values()) - now)
                ready = wait([self._workers[i].conn for i in busy], wait_s)  # type: ignore[union-attr]
                for i in list(busy):
                    (j, start), conn = busy[i], self._workers[i].conn  # type: ignore[union-attr]
                    if conn in ready:
                        del busy[i]
                        results[j] = self._receive(i, calls[j], nan_score)
                    elif timeout_s is not None and time.monotonic() - start >= timeout_s:
                        self.kill(i)
                        del busy[i]
                        raise _timeout_error(calls[j], timeout_s, killed=True)
        except BaseException:
            for i in busy:
                self.kill(i)  # its answer is no longer wanted
            raise
        return [r for r in results if r is not None]

    def _receive(self, i: int, call: RewardCall, nan_score: float | None) -> Tensor:
        worker = self._workers[i]
        assert worker is not None
        name = callable_path(call.fn)
        try:
            reply = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError) as err:
            worker.process.join(5)
            code = worker.process.exitcode
            self.kill(i)
            raise RewardError(
                f"reward function {name}: its worker process died (exit code {code}) during a batch of "
                f"{len(call.prompts)}, first prompt {call.prompts[0]!r}"
            ) from err
        if reply[0] == "error":
            _, kind, message, trace = reply
            raise RewardError(
                f"reward function {name} raised {kind}: {message} (batch of {len(call.prompts)}, first prompt "
                f"{call.prompts[0]!r}; in a worker process:\n{trace})"
            )
        return check_scores(call.fn, reply[1], call.prompts, call.responses, nan_score, call.offset)


def _request(call: RewardCall) -> bytes:
    try:
        return pickle.dumps((call.fn, call.prompts, call.responses, call.meta))
    except Exception as err:
        raise RewardError(
            f"reward function {callable_path(call.fn)} runs in a worker process, but its call cannot be pickled "
            f"({type(err).__name__}: {err}); define the function at module level (a dotted path) and keep the "
            "prompt rows' columns to plain values"
        ) from err


def check_picklable(fn: RewardFn, field: str = "reward_fns") -> None:
    """A `ConfigError` naming `fn` when it cannot be sent to a worker process."""
    from lit_rlhf.config import ConfigError

    try:
        pickle.dumps(fn)
    except Exception as err:
        raise ConfigError(
            f"{field}: {callable_path(fn)} is to run in a worker process (for a hard time limit), but it cannot be "
            f"pickled ({type(err).__name__}: {err}); define it at module level and name it by dotted path, or run "
            "it on threads (isolation='thread', and no @isolated)"
        ) from err


_SHARED: dict[str, ProcessWorkers] = {}


def run_isolated(call: RewardCall, nan_score: float | None, timeout_s: float | None) -> Tensor:
    """One call in this process's shared single worker process (metric functions marked `isolated`)."""
    workers = _SHARED.setdefault("metrics", ProcessWorkers(1))
    return workers.run([call], nan_score, timeout_s)[0]
