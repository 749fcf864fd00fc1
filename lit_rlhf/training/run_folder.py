"""One run per checkpoint folder, no stale temporary files, and a checkpoint before a SIGTERM stops `fit`.

Two runs writing into the same folder overwrite each other's `last.ckpt`, and a later `--ckpt_path last`
resumes whichever saved last. `RunFolderGuard` (a Callback every `RLHFModule` adds through
`configure_callbacks`, so the command line and a user's own `Trainer` both get it) takes a lock file in each
`ModelCheckpoint` folder when `fit` starts, before any model loads:

- `<folder>/.lit_rlhf.lock` is created with O_CREAT | O_EXCL and holds the host and pid; a second run in the
  folder stops with an error naming the folder, the holder and the fix;
- a lock left by a dead process on the same host (a kill -9) is taken over with a warning; a lock from another
  host cannot be checked and is refused (delete it if that run is gone);
- the lock is released when `fit` ends, normally or by an exception (`teardown`, `on_exception`), and at exit;
- temporary files `<name>.tmp-<pid>` of `AtomicCheckpointIO` whose process is dead and that carry its marker
  (`<name>.tmp-<pid>.lit_rlhf-partial`) are deleted, with a log line.

Only global rank 0 takes the lock; its verdict is broadcast so every rank stops together. On SIGTERM Lightning
stops at the end of the current batch by raising `SIGTERMException`; the guard then saves `last.ckpt` into each
`ModelCheckpoint` folder that keeps one (`save_last`), so the run resumes from where it stopped.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import socket
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rlhf.config import ConfigError
from lit_rlhf.training.checkpoint_io import PARTIAL_SUFFIX, TMP_MARKER, marked_partial

log = logging.getLogger(__name__)

LOCK_NAME = ".lit_rlhf.lock"


class RunFolderLocked(ConfigError):
    """Another live run holds the checkpoint folder."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class FolderLock:
    """An exclusive lock file in `folder` naming this host and process; `release` removes it if still ours."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid()}
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or take over one from a dead process on this host; raise `RunFolderLocked` otherwise."""
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(3):  # a takeover races at most with another run doing the same
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder == self.owner:  # this process took it before (a second fit in the same process)
                    self.held = True
                    return
                self._take_over_if_stale(holder)
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(self.owner, handle)
            self.held = True
            atexit.register(self.release)
            return
        raise RunFolderLocked(f"checkpoint folder {self.folder}: could not take the lock {self.path}; try again")

    def _holder(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as handle:
                holder = json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _take_over_if_stale(self, holder: dict[str, Any] | None) -> None:
        if holder is None:  # released meanwhile
            return
        host, pid = holder.get("host"), holder.get("pid")
        if host == self.owner["host"] and isinstance(pid, int) and not pid_alive(pid):
            warnings.warn(
                f"checkpoint folder {self.folder}: taking over the lock of run pid {pid}, which is no longer "
                "running (it was killed)",
                stacklevel=2,
            )
            stale = f"{self.path}.stale-{os.getpid()}"
            try:
                os.replace(self.path, stale)
            except FileNotFoundError:
                return
            os.remove(stale)
            return
        who = f"pid {pid} on host {host}" if pid is not None else f"an unknown process (unreadable {self.path})"
        raise RunFolderLocked(
            f"checkpoint folder {self.folder}: another run ({who}) is writing checkpoints here, and both would "
            "overwrite the same last.ckpt. Give this run its own folder (trainer.default_root_dir, or the "
            f"ModelCheckpoint's dirpath), or wait until that run ends. If it is gone, delete {self.path}"
        )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        atexit.unregister(self.release)
        if self._holder() == self.owner:
            os.remove(self.path)


def remove_stale_temp_files(folder: str) -> list[str]:
    """Delete `AtomicCheckpointIO`'s temporary files (`<name>.tmp-<pid>`) in `folder` whose process is dead and
    that carry the library's marker (`checkpoint_io.PARTIAL_SUFFIX`), with the marker; a file with such a name
    but no marker is the user's, and kept."""
    pattern = re.compile(re.escape(TMP_MARKER) + r"(\d+)$")
    removed = []
    for name in sorted(os.listdir(folder)):
        match = pattern.search(name)
        path = os.path.join(folder, name)
        if not match or not os.path.isfile(path) or os.path.islink(path) or pid_alive(pid := int(match.group(1))):
            continue
        if marked_partial(path, pid):
            os.remove(path)
            os.remove(path + PARTIAL_SUFFIX)
            removed.append(path)
            log.warning("removed %s, a partial checkpoint left by a killed run (pid %s)", path, pid)
    return removed


def checkpoint_folders(trainer: Any) -> list[str]:
    """The distinct folders the Trainer's ModelCheckpoints write to (resolved by their `setup`)."""
    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    return sorted({os.path.realpath(str(f)) for f in folders if "://" not in str(f)})


class RunFolderGuard(L.Callback):
    """Lock the checkpoint folders for one run, clean stale temporary files, save `last.ckpt` on SIGTERM."""

    def __init__(self) -> None:
        self.locks: list[FolderLock] = []

    def acquire(self, trainer: Any) -> None:
        """Called by the module's `setup('fit')`, after the ModelCheckpoints resolved their folders and before
        any model loads. Rank 0 locks; its error, if any, is raised on every rank."""
        error = None
        if trainer.is_global_zero:
            try:
                for folder in checkpoint_folders(trainer):
                    lock = FolderLock(folder)
                    lock.acquire()
                    self.locks.append(lock)
                    remove_stale_temp_files(folder)
            except RunFolderLocked as err:
                self.release()
                error = str(err)
        error = trainer.strategy.broadcast(error)
        if error is not None:
            raise RunFolderLocked(error)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            if isinstance(exception, SIGTERMException):
                save_last_checkpoints(trainer)
        finally:
            self.release()


def save_last_checkpoints(trainer: Any) -> None:
    """Write `last.ckpt` into every ModelCheckpoint folder that keeps one (a collective under DDP)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath:
            path = os.path.join(str(cb.dirpath), cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
            trainer.save_checkpoint(path)
            log.warning("SIGTERM: saved %s before stopping", path)
