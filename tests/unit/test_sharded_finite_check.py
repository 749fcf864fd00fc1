"""Under FSDP2 each rank holds a shard of every parameter: a NaN in one rank's shard must stop every rank (a rank
stopping alone would leave the others waiting in their next collective). Two CPU processes with gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.slow  # two processes


def check_on_rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lit_rlhf.cli import leave_process_group
    from lit_rlhf.training.optim import non_finite_parameters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    if rank == 1:  # rows 2-3 of the first weight: only rank 1 holds them
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = float("nan")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(non_finite_parameters(model.named_parameters()), f)
    leave_process_group()  # as train.py does: neither rank tears gloo down while the other is in a collective


def test_a_nan_in_one_ranks_shard_is_reported_on_every_rank(tmp_path):
    mp.spawn(check_on_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == ["0.weight"]
