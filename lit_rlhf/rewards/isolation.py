"""Worker processes for reward calls that need a hard time limit: a call is sent to a worker process, and one that
overruns its deadline is killed (SIGKILL) and replaced. Each worker leads a process group of its own, and is killed
with it: the processes a reward function started in it end with it, at a timeout and when the fit ends. Only the
standard library here (and `lit_rlhf.rewards.binding`, which binds the parameters as the training process does,
also standard library only): `lit_rlhf.rewards.functions` turns the `IsolationError`s into `RewardError`s naming
the function, and checks the scores.

Workers start with the 'forkserver' method where there is one (else 'spawn'), never a plain fork of the training
process (its threads and CUDA state); the functions and their arguments must be picklable.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from lit_rlhf.rewards.binding import call

START_TIMEOUT_S = 300.0
"""Seconds a new worker process may take to start (not counted in a call's timeout)."""
PRELOAD = ["lit_rlhf.rewards.functions"]
"""Modules the forkserver imports once, so that each new worker starts in milliseconds."""

Request = tuple[Any, list[str], list[str], dict[str, list[Any]], Any]
"""(fn, prompts, responses, meta, trainer_state): one call."""


class IsolationError(RuntimeError):
    """Request `index` failed in its worker: `kind` is 'timeout', 'error' (the function raised; `detail` holds the
    exception and the worker's traceback), 'died' (`detail` the exit code), 'pickle' or 'start'."""

    def __init__(self, index: int, kind: str, detail: str):
        super().__init__(f"request {index}: {kind}: {detail}")
        self.index, self.kind, self.detail = index, kind, detail


def default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _serve(conn: Connection) -> None:
    """A worker process: run (fn, prompts, responses, meta, trainer_state) requests until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    os.setpgid(0, 0)  # a process group of its own: killing it ends the processes a reward started too
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, prompts, responses, meta, state = pickle.loads(request)
            reply: tuple[Any, ...] = ("ok", call(fn, prompts, responses, meta, state))
            payload = pickle.dumps(reply)
        except BaseException as err:  # user code: reported to the parent, which raises a RewardError
            payload = pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
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
            ctx.set_forkserver_preload(PRELOAD)
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child,), name=f"lit_rlhf-reward-{i}", daemon=True)
        process.start()
        child.close()
        self.started += 1
        self._workers[i] = _Worker(process, parent)
        return self._workers[i]  # type: ignore[return-value]

    def _await_ready(self, worker: _Worker, index: int) -> None:
        if worker.ready:
            return
        if not worker.conn.poll(START_TIMEOUT_S):
            raise IsolationError(index, "start", f"a reward worker process did not start within {START_TIMEOUT_S:g} s")
        try:
            worker.conn.recv_bytes()
        except EOFError as err:
            raise IsolationError(
                index,
                "start",
                f"a reward worker process ended while starting (exit code {worker.process.exitcode}); with the "
                "'spawn' start method the main script must guard its code with `if __name__ == '__main__':`",
            ) from err
        worker.ready = True

    def kill(self, i: int) -> None:
        worker, self._workers[i] = self._workers[i], None
        if worker is not None:
            if worker.ready:  # its group (set before it said ready): the worker and what its rewards started
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.kill()
            worker.process.join(5)
            worker.conn.close()

    def close(self) -> None:
        for i in range(self.size):
            self.kill(i)

    def run(self, requests: Sequence[Request], timeout_s: float | None) -> list[Any]:
        """Each request's raw answer, in order; up to `size` at once. The first failure or overrun raises an
        `IsolationError` (its worker, and every worker still busy, is killed first)."""
        results: list[Any] = [None] * len(requests)
        pending = list(range(len(requests)))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (request index, when it was sent)
        try:
            while pending or busy:
                for i in range(self.size):
                    if pending and i not in busy:
                        j = pending[0]
                        payload = _pickled(requests[j], j)
                        worker = self._start(i)
                        self._await_ready(worker, j)
                        pending.pop(0)
                        worker.conn.send_bytes(payload)
                        busy[i] = (j, time.monotonic())
                wait_s = None
                if timeout_s is not None:
                    wait_s = max(0.0, min(start + timeout_s for _, start in busy.values()) - time.monotonic())
                ready = wait([self._workers[i].conn for i in busy], wait_s)  # type: ignore[union-attr]
                for i in list(busy):
                    (j, start), conn = busy[i], self._workers[i].conn  # type: ignore[union-attr]
                    if conn in ready:
                        del busy[i]
                        results[j] = self._receive(i, j)
                    elif timeout_s is not None and time.monotonic() - start >= timeout_s:
                        self.kill(i)
                        del busy[i]
                        raise IsolationError(j, "timeout", f"did not return within {timeout_s:g} s")
        except BaseException:
            for i in busy:
                self.kill(i)  # its answer is no longer wanted
            raise
        return results

    def _receive(self, i: int, j: int) -> Any:
        worker = self._workers[i]
        assert worker is not None
        try:
            reply = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError) as err:
            worker.process.join(5)
            code = worker.process.exitcode
            self.kill(i)
            raise IsolationError(j, "died", f"exit code {code}") from err
        if reply[0] == "error":
            raise IsolationError(j, "error", f"{reply[1]} (in a worker process:\n{reply[2]})")
        return reply[1]


def _pickled(request: Request, index: int) -> bytes:
    try:
        return pickle.dumps(request)
    except Exception as err:
        raise IsolationError(index, "pickle", f"{type(err).__name__}: {err}") from err


_SHARED: dict[str, ProcessWorkers] = {}


def shared_workers() -> ProcessWorkers:
    """This process's single shared worker process (for metric functions marked `isolated`)."""
    return _SHARED.setdefault("metrics", ProcessWorkers(1))
