"""FSDP2 (`ModelParallelStrategy`, `fully_shard` in `configure_model`) on two CPU processes (gloo): GRPO with a
sharded reference, 3 steps, gives the weights of DDP on the same two processes (same prompts per rank, same
sampling streams) within float tolerance.

The fits run in `tests/e2e/fsdp2_run.py`, one process per rank, as `test_ddp.py` runs `ddp_run.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # end-to-end: several processes

SCRIPT = Path(__file__).with_name("fsdp2_run.py")
# Adam at lr 1e-2 amplifies the summation-order differences of reduce-scatter against all-reduce in coordinates
# whose gradient is near 0; each step moves a weight by up to ~1e-2, so 1e-3 still tells a wrong update apart.
TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(strategy: str, out: Path) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0")
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out)]
    procs = [
        subprocess.Popen(
            command,
            env=dict(env, LOCAL_RANK=str(r)),
            cwd=out,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        stderr = [proc.communicate(timeout=300)[1] for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {strategy} run did not finish in time (a hung collective?)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], stderr[0][-3000:] + stderr[1][-3000:]


def test_fsdp2_on_two_cpu_processes_trains_like_ddp(tmp_path):
    run("fsdp2", tmp_path)
    run("ddp", tmp_path)
    fsdp2, ddp = torch.load(tmp_path / "fsdp2.pt"), torch.load(tmp_path / "ddp.pt")
    assert sorted(fsdp2) == sorted(ddp) and fsdp2
    worst = max((fsdp2[k] - ddp[k]).abs().max().item() for k in ddp)
    assert worst < TOLERANCE
    for rank in (0, 1):
        assert json.loads((tmp_path / f"fsdp2_rank{rank}.json").read_text())["global_step"] == 3
    initial = torch.load(tmp_path / "fsdp2_initial.pt")
    assert all(torch.equal(initial[k], torch.load(tmp_path / "ddp_initial.pt")[k]) for k in ddp)
    assert max((ddp[k] - initial[k]).abs().max().item() for k in ddp) > 10 * TOLERANCE  # the weights moved
