"""A reward that never returns, in asynchronous rollouts (`max_staleness: 1`, no `reward_timeout_s`), holds no
shutdown: SIGTERM ends `lit-rlhf fit` within a bounded time with status 143 and a `last.ckpt` that loads and
resumes; Ctrl-C ends it within the same bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lit_rlhf.training.async_rollouts import SHUTDOWN_WAIT_S

ROOT = Path(__file__).resolve().parents[2]
HELPERS = textwrap.dedent(
    """
    import os, pathlib, threading
    from lit_rlhf.tasks.digits import sort_digits_reward

    calls = []

    def hanging_reward(prompts, responses, **meta):
        calls.append(1)
        if len(calls) == int(os.environ["HANG_AT_CALL"]):
            pathlib.Path(os.environ["HANG_MARKER"]).write_text("hanging")
            threading.Event().wait()  # never returns
        return sort_digits_reward(prompts, responses)
    """
)


def start(tmp_path: Path, hang_at_call: int, *extra: str) -> subprocess.Popen:
    (tmp_path / "hang_helpers.py").write_text(HELPERS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "HANG_MARKER": str(tmp_path / "HANGING"),
        "HANG_AT_CALL": str(hang_at_call),
    }
    command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs" / "debug.yaml")]
    command += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "400"]
    command += ["--model.algorithm.name", "grpo", "--model.algorithm.max_staleness", "1"]
    command += ["--model.reward_fns", "[hang_helpers.hanging_reward]", "--model.log_samples_every_n_steps", "0"]
    command += list(extra)
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_when_hanging(proc: subprocess.Popen, marker: Path, signum: int) -> tuple[int, float, str]:
    """Wait until the reward hangs, send `signum`, and return the status, the seconds to exit and stderr."""
    deadline = time.monotonic() + 240
    try:
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the run ended before the reward hung: {proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the reward never hung")
            time.sleep(0.2)
        time.sleep(1.0)  # the training thread now waits for the hung rollout
        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=3 * SHUTDOWN_WAIT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within {3 * SHUTDOWN_WAIT_S + 60} s of the signal")
        return proc.returncode, time.monotonic() - sent, err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_ends_an_asynchronous_run_whose_reward_hangs_with_a_consistent_last_ckpt(tmp_path):
    status, seconds, err = stop_when_hanging(start(tmp_path, 3), tmp_path / "HANGING", signal.SIGTERM)
    assert status == 143, err[-3000:]
    assert seconds < 2 * SHUTDOWN_WAIT_S + 30, seconds  # two bounded waits, the checkpoint and teardown
    last = tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    done = checkpoint["lit_rlhf"]["rollouts_done"]
    kept = [record["index"] for record in checkpoint["lit_rlhf_rollouts_in_flight"]]
    assert all(index >= done for index in kept)  # only finished rollouts ahead of the counters
    # the checkpoint resumes (and is whole: its checksum is checked)
    resumed = start(tmp_path, 10**6, "--ckpt_path", "last")  # stopped once it has taken a step of its own
    deadline = time.monotonic() + 240
    while resumed.poll() is None and time.monotonic() < deadline:
        if torch.load(last, weights_only=True)["lit_rlhf"]["rollouts_done"] > done:
            break
        time.sleep(0.5)
    resumed.send_signal(signal.SIGTERM)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 143, err.decode()[-3000:]
    assert torch.load(last, weights_only=True)["lit_rlhf"]["rollouts_done"] > done


def test_ctrl_c_ends_an_asynchronous_run_whose_reward_hangs(tmp_path):
    status, seconds, err = stop_when_hanging(start(tmp_path, 3), tmp_path / "HANGING", signal.SIGINT)
    assert status != 0, err[-3000:]
    assert seconds < SHUTDOWN_WAIT_S + 30, seconds
