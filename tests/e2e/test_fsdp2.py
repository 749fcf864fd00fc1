"""FSDP2 (`ModelParallelStrategy`, `fully_shard` in `configure_model`) on two CPU processes (gloo): GRPO with a
sharded reference and PPO with a sharded value head, 3 steps each, give the weights of DDP on the same two
processes (same prompts per rank, same sampling streams) within float tolerance; the `SavePolicy` export and
`lit-rlhf-export` of a distributed checkpoint folder load in plain transformers with the trained weights; a run
resumed from the distributed checkpoint of step 2 ends with the weights of the uninterrupted run, bit for bit, and
then answers held-out prompts (uneven batch counts over the ranks are refused); so does one resumed from a full
checkpoint file written by `AtomicCheckpointIO` (`save_distributed_checkpoint=False`).

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

import lit_rlhf

pytestmark = pytest.mark.slow  # end-to-end: several processes

SCRIPT = Path(__file__).with_name("fsdp2_run.py")
# Adam at lr 1e-2 amplifies the summation-order differences of reduce-scatter against all-reduce in coordinates
# whose gradient is near 0; each step moves a weight by up to ~1e-2, so 1e-3 still tells a wrong update apart.
TOLERANCE = 1e-3
SOURCE = Path(lit_rlhf.__file__).resolve().parents[1]  # the ranks import the lit_rlhf this test imported


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(strategy: str, out: Path, *options: str) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out), *options]
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


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    """3 GRPO steps under FSDP2 with a distributed checkpoint after each and a `SavePolicy` export."""
    out = tmp_path_factory.mktemp("fsdp2")
    run("fsdp2", out, "--checkpoints", str(out / "checkpoints"), "--export", str(out / "policy"))
    return out


def assert_like_ddp(out: Path, fsdp2_tag: str, ddp_tag: str) -> None:
    fsdp2, ddp = torch.load(out / f"{fsdp2_tag}.pt"), torch.load(out / f"{ddp_tag}.pt")
    assert sorted(fsdp2) == sorted(ddp) and fsdp2
    worst = max((fsdp2[k] - ddp[k]).abs().max().item() for k in ddp)
    assert worst < TOLERANCE
    for rank in (0, 1):
        assert json.loads((out / f"{fsdp2_tag}_rank{rank}.json").read_text())["global_step"] == 3
    initial = torch.load(out / f"{fsdp2_tag}_initial.pt")
    assert all(torch.equal(initial[k], torch.load(out / f"{ddp_tag}_initial.pt")[k]) for k in ddp)
    assert max((ddp[k] - initial[k]).abs().max().item() for k in ddp) > 10 * TOLERANCE  # the weights moved


def test_grpo_under_fsdp2_on_two_cpu_processes_trains_like_ddp(grpo_run):
    run("ddp", grpo_run)
    assert_like_ddp(grpo_run, "fsdp2", "ddp")


def test_ppo_under_fsdp2_with_a_sharded_value_head_trains_like_ddp(tmp_path):
    run("fsdp2", tmp_path, "--algorithm", "ppo", "--tag", "ppo_fsdp2")
    run("ddp", tmp_path, "--algorithm", "ppo", "--tag", "ppo_ddp")
    assert_like_ddp(tmp_path, "ppo_fsdp2", "ppo_ddp")
    assert {"value_head.weight", "value_head.bias"} <= set(torch.load(tmp_path / "ppo_fsdp2.pt"))


def exported_weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_the_export_and_lit_rlhf_export_of_a_distributed_checkpoint_hold_the_trained_policy(grpo_run):
    from lit_rlhf.cli import export_checkpoint

    trained = {k.removeprefix("policy."): v for k, v in torch.load(grpo_run / "fsdp2.pt").items()}
    saved = exported_weights(grpo_run / "policy")  # SavePolicy at the end of fit: gathered on rank 0
    assert all(torch.equal(saved[k], trained[k]) for k in trained)
    step3 = grpo_run / "checkpoints" / "epoch=0-step=3.ckpt"
    assert step3.is_dir()  # a distributed checkpoint: one file of shards per rank
    from_ckpt = exported_weights(Path(export_checkpoint(str(step3), str(grpo_run / "exported"))))
    assert all(torch.equal(from_ckpt[k], trained[k]) for k in trained)


def test_a_resume_from_a_distributed_checkpoint_is_exact(grpo_run):
    step2 = grpo_run / "checkpoints" / "epoch=0-step=2.ckpt"
    run("fsdp2", grpo_run, "--resume", str(step2), "--tag", "resumed", "--validate")
    full, resumed = torch.load(grpo_run / "fsdp2.pt"), torch.load(grpo_run / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)  # same data position, RNG streams and optimizer
    for rank in (0, 1):
        record = json.loads((grpo_run / f"resumed_rank{rank}.json").read_text())
        assert record["global_step"] == 3
        # then held-out answers, each batch gathering the policy once: 2 batches per rank work, 2 and 1 are refused
        assert 0.0 <= record["validate"]["4"]["val/reward_mean"] <= 1.0
        assert "the ranks have [2, 1]" in record["validate"]["3"]["error"]


def test_full_checkpoints_written_by_atomic_checkpoint_io_resume_exactly(grpo_run, tmp_path):
    """`save_distributed_checkpoint: false`: each save gathers a full checkpoint that `AtomicCheckpointIO` writes as
    one file; a run of 2 steps resumed from its step-2 file ends with the 3-step run's weights, bit for bit."""
    checkpoints = tmp_path / "checkpoints"
    options = ["--full-checkpoints", "--checkpoints", str(checkpoints)]
    run("fsdp2", tmp_path, *options, "--rollouts", "2", "--tag", "first")
    step2 = checkpoints / "epoch=0-step=2.ckpt"
    assert step2.is_file() and sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=1.ckpt", step2.name]
    run("fsdp2", tmp_path, "--full-checkpoints", "--resume", str(step2), "--tag", "resumed")
    full, resumed = torch.load(grpo_run / "fsdp2.pt"), torch.load(tmp_path / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
