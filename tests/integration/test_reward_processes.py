"""Processes a reward function starts in a reward worker process (`reward_isolation: process`) do not outlive
the fit: each worker leads a process group, and the group is killed when the fit ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HELPER = textwrap.dedent(
    """
    import os, subprocess

    def spawning_reward(prompts, responses, **meta):
        child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # forgotten
        with open(os.environ["CHILD_PIDS"], "a") as f:
            f.write(f"{child.pid}\\n")
        return [0.0] * len(responses)
    """
)

FIT = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from conftest import make_trainer
    from reward_spawning import spawning_reward
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    def running(pid):
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    if __name__ == "__main__":
        module = RLHFModule(
            policy="builtin:digits",
            reward_fns=[spawning_reward],
            reward_isolation="process",
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
            sampling=SamplingConfig(max_new_tokens=4),
        )
        make_trainer(2).fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
        pids = [int(line) for line in open(os.environ["CHILD_PIDS"]).read().split()]
        deadline = time.monotonic() + 10
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        print("started", len(pids), "running after fit", [pid for pid in pids if running(pid)])
    """
)


def test_processes_a_reward_starts_in_a_worker_end_with_the_fit(tmp_path):
    (tmp_path / "reward_spawning.py").write_text(HELPER)
    script = tmp_path / "fit.py"
    script.write_text(FIT.format(tests=str(ROOT / "tests")))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "CHILD_PIDS": str(tmp_path / "pids"),
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started 2 running after fit []" in done.stdout, done.stdout
