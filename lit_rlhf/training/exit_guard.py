"""While `fit` runs, a call of `os._exit(0)` in this process ends it with status 1 and a message instead of 0.

`os._exit` ends the process at once, from any thread, without unwinding: no exception reaches Lightning or the
command line, no `atexit` handler runs, and the status is whatever the caller passed. A reward function (or a
library it calls) that calls `os._exit(0)` would end a run after a few steps as a success. `ExitStatusGuard`, a
callback every `RLHFModule` adds, replaces `os._exit` from `setup('fit')` to the end of fit with a function that
turns status 0 into status 1 (other statuses pass as they are), printing where it was called and on which thread.
A forked child process (its own pid) exits as it asked. What cannot be seen from Python is not covered: C code
calling `exit(0)` directly; a C abort or a signal already ends the process with a non-zero status.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any, NoReturn

import lightning as L

INTERRUPTED_STATUS = 1
"""The status a process that `os._exit(0)`-ed in the middle of fit ends with."""

_real_exit = os._exit
_installed: list[int] = []  # the pid that installed the guard, once per active fit (nested fits share it)


def _guarded_exit(status: int) -> NoReturn:
    if status == 0 and _installed and os.getpid() == _installed[0]:
        frame = traceback.extract_stack(limit=2)[0]
        sys.stderr.write(
            f"lit_rlhf: os._exit(0) called at {frame.filename}:{frame.lineno} ({frame.name}) on thread "
            f"{threading.current_thread().name!r} while fit was running, before it finished; exit status "
            f"{INTERRUPTED_STATUS}\n"
        )
        sys.stderr.flush()
        _real_exit(INTERRUPTED_STATUS)
    _real_exit(status)


def install() -> None:
    """Guard `os._exit` (nested calls are counted; `uninstall` once each)."""
    _installed.append(os.getpid())
    os._exit = _guarded_exit


def uninstall() -> None:
    if _installed:
        _installed.pop()
    if not _installed:
        os._exit = _real_exit


class ExitStatusGuard(L.Callback):
    """Guards `os._exit` while `fit` runs (module docstring)."""

    def __init__(self) -> None:
        self.active = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and not self.active:
            install()
            self.active = True

    def _end(self) -> None:
        if self.active:
            uninstall()
            self.active = False

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end()
