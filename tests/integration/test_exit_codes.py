"""`python train.py fit` ends with a non-zero status whenever it did not finish: SIGTERM gives 143 (128 + 15)
after `last.ckpt` is written, a `SystemExit(0)` raised inside fit gives 1 with a message, and an exception
gives Python's 1. A finished run gives 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lit_rlhf.training.checkpoint_io import load_checkpoint_file
from lit_rlhf.training.run_folder import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]

HELPERS = textwrap.dedent(
    """
    import os, pathlib, sys
    import lightning as L
    from lit_rlhf.tasks.digits import sort_digits_reward

    def marking_reward(prompts, responses, **meta):
        pathlib.Path(os.environ["ROLLOUT_MARKER"]).write_text("scored")
        return sort_digits_reward(prompts, responses)

    class ExitZero(L.Callback):
        def on_train_batch_end(self, *args):
            sys.exit(0)
    """
)


def train_py(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """`python train.py fit --config configs/debug.yaml` in `tmp_path` (its checkpoints: runs/debug/checkpoints)."""
    (tmp_path / "exit_helpers.py").write_text(HELPERS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "ROLLOUT_MARKER": str(tmp_path / "ROLLOUT"),
    }
    command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs" / "debug.yaml")]
    command += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *extra]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err.decode()


def test_sigterm_during_fit_saves_last_ckpt_then_exits_143(tmp_path):
    # no periodic save: the only last.ckpt is the one written on SIGTERM
    proc = train_py(
        tmp_path,
        "--trainer.max_steps",
        "100000",
        "--trainer.callbacks.every_n_train_steps",
        "100000",
        "--model.reward_fns",
        "[exit_helpers.marking_reward]",
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "ROLLOUT").exists():
        if proc.poll() is not None:
            pytest.fail(f"training ended before its first rollout: {finish(proc)[1][-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("training never scored a rollout")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    status, err = finish(proc)
    assert status == 128 + signal.SIGTERM == 143, err[-3000:]
    assert "fit stopped by SIGTERM; exit status 143" in err
    ckpt_dir = tmp_path / "runs" / "debug" / "checkpoints"
    assert sorted(os.listdir(ckpt_dir)) == ["last.ckpt"]  # the lock was released, no temporary file left
    saved = load_checkpoint_file(str(ckpt_dir / "last.ckpt"))
    assert saved["global_step"] > 0 and saved["global_step"] % 4 == 0  # whole rollouts (4 optimizer steps each)
    assert saved["lit_rlhf"]["policy_version"] == saved["global_step"]


def test_system_exit_zero_inside_fit_exits_1_naming_where(tmp_path):
    proc = train_py(tmp_path, "--trainer.callbacks+=exit_helpers.ExitZero")
    status, err = finish(proc)
    assert status == 1, err[-3000:]
    assert "fit stopped by SystemExit(0) raised at" in err and "exit_helpers.py" in err
    assert not (tmp_path / "runs" / "debug" / "checkpoints" / LOCK_NAME).exists()


def test_a_finished_run_exits_0(tmp_path):
    status, err = finish(train_py(tmp_path, "--trainer.max_steps", "4"))
    assert status == 0, err[-3000:]
    assert load_checkpoint_file(str(tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"))["global_step"] == 4


def test_sigterm_with_asynchronous_rollouts_keeps_those_in_flight_stops_the_producer_and_exits_143(tmp_path):
    k = 2
    proc = train_py(
        tmp_path,
        "--trainer.max_steps",
        "100000",
        "--trainer.callbacks.every_n_train_steps",
        "100000",
        "--model.reward_fns",
        "[exit_helpers.marking_reward]",
        "--model.algorithm.max_staleness",
        str(k),
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "ROLLOUT").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"training never scored a rollout: {finish(proc)[1][-3000:]}")
        time.sleep(0.05)
    time.sleep(1.0)  # a few steps in, with rollouts queued
    proc.send_signal(signal.SIGTERM)
    status, err = finish(proc, timeout=120)
    assert status == 143, err[-3000:]
    saved = load_checkpoint_file(str(tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"))
    done = saved["lit_rlhf"]["rollouts_done"]
    assert saved["global_step"] == 4 * done  # a whole rollout: 2 epochs x 2 minibatches each
    in_flight = saved["lit_rlhf_rollouts_in_flight"]
    assert [r["index"] for r in in_flight] == list(range(done, done + k))  # finished before the save, kept
    assert all(r["index"] - r["weights_step"] <= k for r in in_flight)


def test_train_py_leaves_the_process_group_of_a_finished_run(one_process_group, monkeypatch):
    """A gloo group left to the interpreter's teardown once aborted a finished run with status -6: `train.py`
    destroys it after fit returns (here a one-process group and a stand-in fit)."""
    import runpy

    import torch.distributed as dist

    from lit_rlhf import cli

    fits = []
    monkeypatch.setattr(cli, "main", lambda args=None: fits.append(dist.is_initialized()))
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert fits == [True]  # the fit ran inside the group
    assert not dist.is_initialized()
