"""`os._exit(0)` called while `fit` runs (a reward function on a worker thread, or the main thread) ends the
process with status 1 and a message naming where, not with status 0; outside fit, and in a forked child, it is
untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FIT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from conftest import make_trainer
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    calls = []

    def exiting_reward(prompts, responses, **meta):
        calls.append(1)
        if len(calls) == 2:
            os._exit(0)  # e.g. a library giving up on a thread
        return [0.0] * len(responses)

    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[exiting_reward],
        reward_workers=1,  # the reward runs on a worker thread
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    trainer = make_trainer(40)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    {after}
    """
)


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_reward_calling_os_exit_0_on_a_thread_ends_the_run_with_status_1():
    done = run(FIT.format(tests=str(ROOT / "tests"), after="print('fit returned')"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "fit returned" not in done.stdout
    assert "os._exit(0) called at" in done.stderr and "exiting_reward" in done.stderr
    assert "on thread 'lit_rlhf-reward'" in done.stderr and "before it finished; exit status 1" in done.stderr


def test_the_guard_leaves_other_statuses_forked_children_and_the_time_after_fit_alone():
    code = textwrap.dedent(
        """
        import os, sys
        from lit_rlhf.training import exit_guard
        exit_guard.install()
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # a forked child (its own pid) exits as it asked
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        exit_guard.uninstall()
        os._exit(0)  # fit is over: status 0 as asked
        """
    )
    done = run(code)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    status_3 = run("from lit_rlhf.training import exit_guard; import os; exit_guard.install(); os._exit(3)")
    assert status_3.returncode == 3 and status_3.stderr == ""
