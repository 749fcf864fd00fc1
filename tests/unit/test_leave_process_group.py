"""`leave_process_group`, which train.py calls after a multi-process run: every rank waits for the others before
the group is destroyed, and a rank whose peer never arrives exits non-zero instead of 0. Two real gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import free_port, run_ranks

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch.distributed as dist
    from lit_rlhf.cli import leave_process_group

    rank, mode = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        if mode == "exits":  # a peer that dies after training, before leaving the group
            os._exit(3)
        time.sleep(2.0)  # a peer that is still finishing
    arrived = time.time()
    leave_process_group()
    with open(f"rank{rank}.json", "w") as handle:
        json.dump({"arrived": arrived, "left": time.time(), "still_in_group": dist.is_initialized()}, handle)
    """
)


def run_two_ranks(folder, mode: str) -> list[subprocess.CompletedProcess]:
    (folder / "worker.py").write_text(WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return run_ranks(
        [[sys.executable, "worker.py", str(rank), mode] for rank in (0, 1)],
        [env, env],
        folder,
        240,
        "a rank did not leave the group in time (a barrier waiting forever?)",
    )


def test_no_rank_leaves_before_the_last_one_arrives(tmp_path):
    results = run_two_ranks(tmp_path, "late")
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["left"] >= rank1["arrived"]  # rank 0 arrived about 2 s earlier and waited for rank 1
    assert rank0["arrived"] < rank1["arrived"] - 1.0
    assert not rank0["still_in_group"] and not rank1["still_in_group"]


def test_a_rank_whose_peer_died_exits_non_zero_and_says_why(tmp_path):
    rank0, rank1 = run_two_ranks(tmp_path, "exits")
    assert rank1.returncode == 3
    assert rank0.returncode != 0
    assert "another process of the run did not reach the end" in rank0.stderr
    assert not (tmp_path / "rank0.json").exists()
