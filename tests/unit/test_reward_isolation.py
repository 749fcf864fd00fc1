"""Hard limits on reward work: functions that hold the GIL end in a `RewardError` within their limit when they run
in worker processes (`isolation="process"` or `@isolated`), and end the process on threads (the watchdog)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import reward_workloads as w
import torch

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardError, call_reward_fn, is_isolated
from lit_rlhf.rewards.parallel import BACKSTOP_GRACE_S
from lit_rlhf.rewards.verifiable import math_verify_answer

PROMPTS = ["1>", "2>", "3>", "4>"]
RESPONSES = ["a", "bb", "ccc", "dddd"]
LIMIT = 5.0
SLACK = 1.5  # a killed call must end within LIMIT + SLACK seconds


def timed_failure(composer: RewardComposer) -> tuple[float, RewardError]:
    start = time.monotonic()
    with pytest.raises(RewardError) as caught:
        composer(PROMPTS, RESPONSES, {})
    return time.monotonic() - start, caught.value


@pytest.mark.parametrize(
    ("fns", "isolation", "workers"),
    [
        ([w.gil_holding_reward], "process", 0),
        ([w.length_reward, w.gil_holding_rowwise], "process", 2),
        ([w.length_reward, w.isolated_gil_holding_reward], "thread", 0),
        ([w.length_reward, w.isolated_gil_holding_reward], "thread", 3),
    ],
    ids=["process", "process-2-workers", "isolated-fn", "isolated-fn-with-threads"],
)
def test_a_gil_holding_reward_in_a_worker_process_ends_in_a_reward_error_within_its_limit(fns, isolation, workers):
    composer = RewardComposer(fns, timeout_s=LIMIT, workers=workers, isolation=isolation)
    warm = RewardComposer([w.length_reward], workers=workers, isolation="process")
    warm.processes = composer.processes  # start the workers first: their start is not the call's time
    assert warm(PROMPTS, RESPONSES, {}).tolist() == [1.0, 2.0, 3.0, 4.0]
    took, error = timed_failure(composer)
    assert LIMIT <= took < LIMIT + SLACK, took
    assert "did not return within reward_timeout_s=5 s" in str(error) and "worker process was killed" in str(error)
    assert "gil_holding" in str(error)
    # the killed worker is replaced: the composer keeps working
    assert warm(PROMPTS, RESPONSES, {}).tolist() == [1.0, 2.0, 3.0, 4.0]
    composer.close()


def test_a_tight_python_loop_on_threads_ends_in_a_reward_error_within_its_limit():
    composer = RewardComposer([w.tight_loop_reward], timeout_s=LIMIT, workers=2)
    took, error = timed_failure(composer)
    assert LIMIT <= took < LIMIT + SLACK and "did not return within reward_timeout_s=5 s" in str(error)


SCRIPT = """
import sys, time
sys.path.insert(0, {here!r})
import reward_workloads as w
from lit_rlhf.rewards.composer import RewardComposer
composer = RewardComposer([w.gil_holding_reward], timeout_s={limit}, workers={workers})
print("start", time.monotonic(), flush=True)
composer(["1>"], ["a"], {{}})
print("returned", flush=True)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_gil_holding_reward_on_threads_ends_the_process_with_its_traceback(workers):
    script = SCRIPT.format(here=str(Path(__file__).parent), limit=LIMIT, workers=workers)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60)
    ended = time.monotonic()
    started = float(done.stdout.split()[1])
    assert done.returncode == 1, done.stderr
    assert "returned" not in done.stdout
    assert "Timeout" in done.stderr and "gil_holding_reward" in done.stderr  # faulthandler's dump names it
    assert ended - started < LIMIT + BACKSTOP_GRACE_S + SLACK + 1.0  # plus the interpreter's exit


def test_workers_report_a_raising_or_dying_function_by_name():
    with pytest.raises(RewardError, match=r"reward_workloads.raising_reward raised ValueError: no score for you"):
        RewardComposer([w.raising_reward], isolation="process")(PROMPTS, RESPONSES, {})
    composer = RewardComposer([w.dying_reward], timeout_s=30, isolation="process")
    with pytest.raises(RewardError, match=r"dying_reward: its worker process died \(exit code 3\)"):
        composer(PROMPTS, RESPONSES, {})


def test_process_scores_equal_the_plain_loop_and_chunks_keep_their_order():
    meta = {"answer": ["1", "2", "3", "4"]}
    plain = RewardComposer([w.length_reward, w.pid_reward], weights=[1.0, 0.0])
    spread = RewardComposer([w.length_reward, w.pid_reward], weights=[1.0, 0.0], workers=2, isolation="process")
    assert torch.equal(plain(PROMPTS, RESPONSES, meta), spread(PROMPTS, RESPONSES, meta))
    pids = plain.function_scores(PROMPTS, RESPONSES, meta)[1]
    assert int(pids[0]) != os.getpid()  # isolated even on a thread composer


def test_process_settings_are_checked_at_construction():
    with pytest.raises(ConfigError, match="cannot be pickled.*define it at module level"):
        RewardComposer([lambda p, r: [0.0] * len(p)], isolation="process")
    with pytest.raises(ConfigError, match="model.reward_isolation: 'fork'"):
        RewardComposer([w.length_reward], isolation="fork")


def test_an_isolated_metric_function_is_bounded_by_its_own_limit():
    start = time.monotonic()
    with pytest.raises(RewardError, match="did not return within reward_timeout_s=1 s"):
        call_reward_fn(w.isolated_metric_with_own_limit, PROMPTS, RESPONSES, {})
    assert time.monotonic() - start < 1 + SLACK + 30  # includes the shared worker's first start


def test_math_verify_answer_runs_in_a_worker_process_and_refuses_huge_powers():
    pytest.importorskip("math_verify")
    assert is_isolated(math_verify_answer)
    composer = RewardComposer([math_verify_answer], timeout_s=LIMIT)
    replies = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\frac{1}{2}}", "#### 3", "\\boxed{2^{10}}"]
    scores = composer(PROMPTS, replies, {"answer": ["9", "0.5", "4", "1024"]})
    assert scores.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_the_module_setting_reaches_the_composer():
    from conftest import make_policy
    from lit_rlhf import RLHFModule
    from lit_rlhf.tasks.digits import builtin_tokenizer

    module = RLHFModule(policy=make_policy(), tokenizer=builtin_tokenizer(), reward_fns=[w.length_reward])
    assert module.reward.isolation == "thread"
    module = RLHFModule(
        policy=make_policy(), tokenizer=builtin_tokenizer(), reward_fns=[w.length_reward], reward_isolation="process"
    )
    assert module.reward.isolation == "process" and module.hparams["reward_isolation"] == "process"
    with pytest.raises(ConfigError, match="model.reward_isolation: 'fork'"):
        RLHFModule(
            policy=make_policy(), tokenizer=builtin_tokenizer(), reward_fns=[w.length_reward], reward_isolation="fork"
        )
