"""Memory a CPU process's allocator holds free: glibc keeps the pages of freed blocks below its mmap threshold (tens
of MiB: a sampling step's logits, a block of the chunked log-probs, a gathered FSDP2 unit) resident, so a phase's
peak comes on top of what the phase before it freed. Handing them back (`malloc_trim`) costs the page faults of
using them again, so it is done where the allocator holds enough to matter."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import Any

TRIM_ABOVE_BYTES = 64 * 2**20
"""Free memory the allocator may keep between a step's phases before it is handed back: below it the page faults
of taking it again cost more than it saves (measured: trimming a few MiB after every phase made the tiny GRPO
step W1 15% slower; the 126 MiB held at the large-vocabulary step raised its peak by that much, docs/memory.md)."""


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc >= 2.33): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def held_free_bytes() -> int | None:
    """Bytes glibc's allocator holds free in its arenas (`mallinfo2`: fordblks + fsmblks); None when unknown."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.fordblks + info.fsmblks)


def return_freed_memory() -> None:
    """Hand the pages glibc's allocator holds free back to the system (`malloc_trim(0)`); a no-op off glibc.

    On CPU the gathered FSDP2 policy (hundreds of MiB, freed at each reshard) lands in the allocator's heap, which
    keeps freed pages resident; handing them back after each rollout lowers the peak RSS of an FSDP2 fit on CPU
    (docs/distributed.md)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def return_freed_memory_on_cpu(device: Any) -> None:
    """Between a step's phases on a CPU: `return_freed_memory` when the allocator holds more than
    `TRIM_ABOVE_BYTES` free."""
    if getattr(device, "type", None) != "cpu":
        return
    held = held_free_bytes()
    if held is not None and held > TRIM_ABOVE_BYTES:
        return_freed_memory()
