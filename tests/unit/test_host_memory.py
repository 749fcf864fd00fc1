"""Free memory handed back to the system between a step's phases on a CPU (`lit_rlhf.training.host_memory`): glibc's
counters move as expected, and the trim happens only on a CPU and above the threshold."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from lit_rlhf.training import host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


FREED_BLOCKS_CHILD = """
import torch
from lit_rlhf.training import host_memory

def resident_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))

host_memory.return_freed_memory()
before = host_memory.held_free_bytes()
blocks = [torch.ones(16, 1024) for _ in range(3200)]  # 64 KiB each, 200 MiB: in the heap, not mmapped
fence = torch.ones(16, 1024)  # above them in the heap: their free space is not at its top, which free() trims
del blocks
held = host_memory.held_free_bytes()
resident = resident_mib()
host_memory.return_freed_memory()
print((held - before) / 2**20, resident - resident_mib())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator")
def test_freed_small_blocks_stay_resident_until_trimmed():
    # a fresh interpreter: in a long test session the heap's earlier free space takes the blocks in
    child = subprocess.run([sys.executable, "-c", FREED_BLOCKS_CHILD], capture_output=True, text=True, check=True)
    kept_free_mib, handed_back_mib = map(float, child.stdout.split())
    assert kept_free_mib > 100  # freed, but kept by the allocator
    assert handed_back_mib > 100  # malloc_trim handed the pages back


def test_off_glibc_there_is_nothing_to_call(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory.held_free_bytes() is None
    host_memory.return_freed_memory()  # no error
    host_memory.return_freed_memory_on_cpu(torch.device("cpu"))


@pytest.mark.parametrize(
    "device, held, trimmed",
    [
        ("cpu", 65 * 2**20, True),
        ("cpu", 63 * 2**20, False),  # under the threshold: the page faults would cost more than it saves
        ("cpu", None, False),  # unknown
        ("cuda", 10 * 2**30, False),  # a GPU's memory is not glibc's
    ],
)
def test_the_step_trims_only_on_a_cpu_holding_more_than_the_threshold(monkeypatch, device, held, trimmed):
    calls = []
    monkeypatch.setattr(host_memory, "held_free_bytes", lambda: held)
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda: calls.append(1))
    host_memory.return_freed_memory_on_cpu(torch.device(device))
    assert bool(calls) == trimmed
