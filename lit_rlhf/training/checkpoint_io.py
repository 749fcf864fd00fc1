"""Checkpoint files that survive a kill, and load weights-only.

Lightning's `TorchCheckpointIO` writes through an fsspec transaction: the file is staged in the system temp
folder and then moved onto the target. When that folder is on another filesystem than the checkpoints (a local
/tmp and a network checkpoint folder, the usual cluster layout) the move is a copy *into the target*, so a
process killed during the copy leaves a truncated `last.ckpt`, and a killed save leaves its staged copy in /tmp.

`AtomicCheckpointIO` writes next to the target (`<name>.tmp-<pid>`, not a `*.ckpt` name, so Lightning's search
for `last.ckpt` never picks it up), fsyncs it, and `os.replace`s it onto the target: a reader sees the old
complete file or the new complete file, never a partial one. Loading is weights-only (no pickled code runs)
and a truncated or foreign file gets an error that names it.

Use it with `Trainer(plugins=[AtomicCheckpointIO()])`, or in YAML:

    trainer:
      plugins:
        - class_path: lit_rlhf.AtomicCheckpointIO
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_rlhf.config import ConfigError

TMP_MARKER = ".tmp-"
PARTIAL_SUFFIX = ".lit_rlhf-partial"
"""Beside a temporary file being written, `<name>.tmp-<pid>.lit_rlhf-partial`: proof that the library made it, so
clean-up after a killed run deletes only such files, never a file by its name alone."""


def write_partial_marker(tmp: str) -> str:
    """The marker file beside the temporary file `tmp` (before `tmp` itself is created); returns its path."""
    marker = tmp + PARTIAL_SUFFIX
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({"lit_rlhf_partial": os.path.basename(tmp), "pid": os.getpid()}, handle)
    return marker


def marked_partial(tmp: str, pid: int) -> bool:
    """Whether `tmp` has the marker this library writes beside its temporary files, naming it and process `pid`."""
    try:
        with open(tmp + PARTIAL_SUFFIX, encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker == {"lit_rlhf_partial": os.path.basename(tmp), "pid": pid}


class CheckpointError(ConfigError):
    """A checkpoint file is missing, truncated, or not a checkpoint this package can load."""


def atomic_torch_save(obj: Any, path: str) -> None:
    """`torch.save` to a temporary file beside `path`, fsync, then atomically replace `path`.

    A failed write (a full disk) leaves `path` as it was and raises an `OSError` naming it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}{TMP_MARKER}{os.getpid()}"
    marker = write_partial_marker(tmp)
    try:
        with open(tmp, "wb") as handle:
            write_checkpoint(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        os.remove(marker)
        if isinstance(err, (OSError, RuntimeError)) and _is_write_failure(err):
            raise OSError(
                f"checkpoint {path}: writing it failed ({_first_line(err)}); the disk may be full (or the folder "
                f"not writable). The previous {os.path.basename(path)}, if any, is intact; free space and resume "
                "from it"
            ) from err
        raise
    os.remove(marker)
    try:  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_write_failure(err: BaseException) -> bool:
    """torch's serialiser reports a failed write as a RuntimeError ('PytorchStreamWriter failed writing file',
    'unexpected pos'); the OS as an OSError (ENOSPC, EDQUOT, EIO, ...)."""
    text = str(err)
    return isinstance(err, OSError) or "PytorchStreamWriter failed" in text or "unexpected pos" in text


def unreadable_reason(path: str) -> str | None:
    """Why the file at `path` cannot be a torch checkpoint, judged from its bytes (None: it may be one).

    `torch.save` writes a zip archive (or, in its legacy format, a pickle starting with byte 0x80); torch's own
    errors for an empty or foreign file are an empty `EOFError` or a `KeyError`."""
    size = os.path.getsize(path)
    if size == 0:
        return (
            "the file is empty (0 bytes): truncated, by a process killed while writing it or by a full disk. Resume "
            "from an earlier checkpoint, or start afresh"
        )
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head.startswith(b"PK"):
        if zipfile.is_zipfile(path):
            return None
        return (
            f"truncated or not a torch checkpoint (a zip archive of {size} bytes without its end); was the process "
            "killed while writing it? Resume from an earlier checkpoint"
        )
    if head.startswith(b"\x80"):
        return None
    return f"not a torch checkpoint (torch.save writes a zip archive; this file starts with {head!r})"


def check_checkpoint_file(path: str) -> None:
    """Raise a `CheckpointError` naming `path` if it is missing, empty, truncated or not a torch checkpoint."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    reason = unreadable_reason(path)
    if reason is not None:
        raise CheckpointError(f"checkpoint {path}: {reason}")


def write_checkpoint(obj: Any, handle) -> None:
    """Serialise `obj` into an open binary file (a seam for tests that slow the write down)."""
    torch.save(obj, handle)


def load_checkpoint_file(path: str, map_location: Any = None, weights_only: bool = True) -> dict[str, Any]:
    """`torch.load` with weights_only on by default, and errors that name the file and the likely cause."""
    check_checkpoint_file(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only and "Weights only load failed" in str(err):
            raise CheckpointError(
                f"checkpoint {path}: holds Python objects that a weights-only load refuses to run "
                f"({_line_with(err, 'Unsupported global')}). "
                "Only load it with weights_only=False if you made it yourself or trust its source."
            ) from err
        raise CheckpointError(f"checkpoint {path}: not a readable torch checkpoint ({_first_line(err)})") from err
    except MemoryError:
        raise
    except Exception as err:  # a cut zip archive, a text file, an old pickle: torch's errors vary
        raise CheckpointError(
            f"checkpoint {path}: truncated or not a torch checkpoint ({_first_line(err)}); was the process killed "
            "while writing it? Resume from an earlier checkpoint."
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _line_with(err: BaseException, words: str) -> str:
    """The line of a long torch message that holds `words` (e.g. which global was refused), else its first."""
    for line in str(err).splitlines():
        if words in line:
            return line.strip().removeprefix("WeightsUnpickler error:").strip()
    return _first_line(err)


DISTRIBUTED_METADATA = "meta.pt"
"""Beside the shard files (`*.distcp`) of a distributed checkpoint folder: everything but weights and optimizer."""


def is_distributed_checkpoint(path: str) -> bool:
    """Whether `path` is a distributed checkpoint folder (`ModelParallelStrategy`, FSDP2)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DISTRIBUTED_METADATA))


def consolidate_distributed_checkpoint(folder: str, out: str) -> None:
    """Write the distributed checkpoint `folder` as one file `out` with the full weights and the rest of the
    checkpoint but no optimizer state: a file to export the policy from, not to resume from. Runs in one process
    (no process group) and holds the whole checkpoint, optimizer state included, in its memory meanwhile."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = load_checkpoint_file(os.path.join(folder, DISTRIBUTED_METADATA), "cpu")
    staged = f"{out}{TMP_MARKER}{os.getpid()}"
    try:
        dcp_to_torch_save(folder, staged)
        checkpoint["state_dict"] = load_checkpoint_file(staged, "cpu")["state_dict"]
    finally:
        if os.path.exists(staged):
            os.remove(staged)
    atomic_torch_save(checkpoint, out)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning `CheckpointIO`: atomic local writes (temp file + fsync + os.replace), weights-only loads.

    Paths with a URL scheme (s3://, gs://, ...) fall back to Lightning's own writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = str(path)
        if "://" in path and not path.startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        atomic_torch_save(checkpoint, path.removeprefix("file://"))

    def load_checkpoint(
        self, path, map_location: Callable | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = str(path)
        if "://" in path and not path.startswith("file://"):
            return super().load_checkpoint(path, map_location, True if weights_only is None else weights_only)
        return load_checkpoint_file(
            path.removeprefix("file://"), map_location, True if weights_only is None else weights_only
        )
