"""The reward-function contract (`call_reward_fn`), the timeout and thread pool of `RewardComposer`, and the
reward model read through its own tokenizer at the same place as through shared token ids."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from lit_rlhf.config import ConfigError
from lit_rlhf.models.reward_model import SequenceRewardModel
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardError, call_reward_fn, rowwise
from lit_rlhf.rollout.generation import Generation, response_mask_from_ids

PROMPTS = ["1>", "2>", "3>"]
RESPONSES = ["a", "b", "c"]


def returning(value):
    def fixed_reward(prompts, responses, **meta):
        return value

    return fixed_reward


GOOD = [
    ([1, 2.5, -3], [1.0, 2.5, -3.0]),
    ((0.5, 1, 2), [0.5, 1.0, 2.0]),
    (torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), [1.0, 2.0, 3.0]),
    (torch.tensor([1, 2, 3]), [1.0, 2.0, 3.0]),
    (np.array([0.25, 0.5, 0.75]), [0.25, 0.5, 0.75]),
    ([np.float32(1.5), np.int64(2), torch.tensor(3.0)], [1.5, 2.0, 3.0]),
]


@pytest.mark.parametrize(("raw", "expected"), GOOD)
def test_the_contract_accepts_sequences_of_real_numbers(raw, expected):
    scores = call_reward_fn(returning(raw), PROMPTS, RESPONSES, {})
    assert scores.dtype == torch.float32 and scores.tolist() == expected


BAD = {
    "dict": ({"1>": 1.0, "2>": 2.0, "3>": 3.0}, "must return numbers, got dict of length 3"),
    "string": ("123", "got str of length 3"),
    "scalar": (1.0, "got float;"),
    "tensor-scalar": (torch.tensor(1.0), "shape \\(\\)"),
    "short": ([1.0, 2.0], "a list of 2; expected one score per response \\(3,\\)"),
    "long-array": (np.zeros(4), "shape \\(4,\\)"),
    "matrix": (torch.zeros(3, 1), "shape \\(3, 1\\)"),
    "bools": ([True, False, True], "element 0 is True \\(bool\\)"),
    "bool-tensor": (torch.tensor([True, False, True]), "dtype torch.bool"),
    "none-entry": ([1.0, None, 2.0], "element 1 is None"),
    "string-entry": ([1.0, 2.0, "3"], "element 2 is '3'"),
    "complex": ([1.0, 2.0, 1j], "element 2 is 1j"),
    "complex-array": (np.array([1, 2, 3], dtype=complex), "dtype complex128"),
    "generator": ((x for x in [1.0, 2.0, 3.0]), "got generator"),
    "inf": ([1.0, float("inf"), 2.0], "returned inf for prompt '2>' \\(element 1\\)"),
    "too-large-for-float32": ([1e300, 1.0, 2.0], "beyond float32"),
    "none": (None, "got NoneType"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_contract_refuses_everything_else_naming_the_function(case):
    raw, detail = BAD[case]
    with pytest.raises(RewardError, match="fixed_reward") as info:
        call_reward_fn(returning(raw), PROMPTS, RESPONSES, {})
    message = str(info.value)
    assert re.search(detail, message), message
    assert "finite" in message


def test_nan_is_an_error_unless_nan_score_replaces_it():
    with pytest.raises(RewardError, match="returned nan for prompt '2>' \\(element 1\\)"):
        call_reward_fn(returning([1.0, float("nan"), 3.0]), PROMPTS, RESPONSES, {})
    replaced = call_reward_fn(returning(np.array([1.0, np.nan, 3.0])), PROMPTS, RESPONSES, {}, nan_score=-1.0)
    assert replaced.tolist() == [1.0, -1.0, 3.0]


def exiting_reward(prompts, responses, **meta):
    sys.exit(0)


def interrupted_reward(prompts, responses, **meta):
    raise KeyboardInterrupt


def test_sys_exit_in_a_reward_function_is_a_reward_error_but_ctrl_c_is_not():
    with pytest.raises(RewardError, match="exiting_reward raised SystemExit") as info:
        call_reward_fn(exiting_reward, PROMPTS, RESPONSES, {})
    assert isinstance(info.value.__cause__, SystemExit)
    with pytest.raises(KeyboardInterrupt):
        call_reward_fn(interrupted_reward, PROMPTS, RESPONSES, {})
    with pytest.raises(RewardError, match="exiting_reward raised SystemExit"):  # on a worker thread as well
        RewardComposer([exiting_reward], workers=2)(PROMPTS, RESPONSES, {})


# ----------------------------------------------------------------------------- timeout and workers


def test_composer_settings_are_checked():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="model.reward_timeout_s"):
            RewardComposer([returning([1.0])], timeout_s=bad)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="model.reward_workers"):
            RewardComposer([returning([1.0])], workers=bad)


def test_a_reward_function_that_never_returns_fails_after_the_timeout():
    release = threading.Event()

    def stuck_reward(prompts, responses, **meta):
        release.wait(30)
        return [0.0] * len(prompts)

    for workers in (0, 2):
        start = time.monotonic()
        with pytest.raises(RewardError, match="stuck_reward did not return within reward_timeout_s=0.2 s"):
            RewardComposer([returning([1.0, 2.0, 3.0]), stuck_reward], timeout_s=0.2, workers=workers)(
                PROMPTS, RESPONSES, {}
            )
        assert 0.2 <= time.monotonic() - start < 10
    release.set()


def test_a_stuck_reward_function_still_ends_the_process_with_a_failure():
    script = textwrap.dedent(
        """
        import time
        from lit_rlhf.rewards.composer import RewardComposer

        def stuck_reward(prompts, responses, **meta):
            while True:
                time.sleep(0.01)

        RewardComposer([stuck_reward], timeout_s=0.3)(["1>"], ["1"], {})
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "RewardError: reward function stuck_reward did not return within" in done.stderr
    assert time.monotonic() - start < 60


def batch_reward(prompts, responses, **meta):
    """Depends on the whole batch: never split."""
    return [float(len(prompts)) + i for i in range(len(prompts))]


@rowwise
def length_reward(prompts, responses, **meta):
    return [float(len(r)) * w for r, w in zip(responses, meta["weight"], strict=True)]


def test_workers_give_the_scores_of_the_plain_loop_in_order():
    prompts = [f"{i}>" for i in range(7)]
    responses = ["x" * (i % 4) for i in range(7)]
    meta = {"weight": [0.5 * (i + 1) for i in range(7)]}
    expected = [float(len(r)) * w + 7.0 + i for i, (r, w) in enumerate(zip(responses, meta["weight"], strict=True))]
    for workers in (0, 1, 2, 3, 7, 16):
        composer = RewardComposer([length_reward, batch_reward], workers=workers, timeout_s=30 if workers else None)
        assert composer(prompts, responses, meta).tolist() == expected, workers


def test_workers_run_reward_functions_and_chunks_at_the_same_time():
    meeting = threading.Barrier(2, timeout=5)  # passes only when two calls are running at once

    def first_reward(prompts, responses, **meta):
        meeting.wait()
        return [1.0] * len(prompts)

    def second_reward(prompts, responses, **meta):
        meeting.wait()
        return [2.0] * len(prompts)

    assert RewardComposer([first_reward, second_reward], workers=2)(PROMPTS, RESPONSES, {}).tolist() == [3.0] * 3
    sizes = []

    @rowwise
    def slow_checker(prompts, responses, **meta):
        sizes.append(len(prompts))
        meeting.wait()
        return [float(p[0]) for p in prompts]

    meeting.reset()
    prompts = ["1>", "2>", "3>", "4>"]
    assert RewardComposer([slow_checker], workers=2)(prompts, [*RESPONSES, "d"], {}).tolist() == [1, 2, 3, 4]
    assert sorted(sizes) == [2, 2]
    with pytest.raises(RewardError, match="slow_checker raised BrokenBarrierError"):  # in turn: never meet
        meeting.reset()
        RewardComposer([slow_checker], timeout_s=30)(prompts, [*RESPONSES, "d"], {})


def test_a_chunk_is_checked_against_its_own_rows():
    @rowwise
    def bad_row_reward(prompts, responses, **meta):
        return [None if p == "3>" else 1.0 for p in prompts]

    with pytest.raises(RewardError, match="element 2 is None \\(NoneType\\) for prompt '3>'"):
        RewardComposer([bad_row_reward], workers=3)(["1>", "2>", "3>", "4>"], ["a"] * 4, {})


# ----------------------------------------------------------------------------- reward model with its own tokenizer


def test_reward_tokenizer_path_reads_the_score_at_the_eos_like_shared_ids(tokenizer):
    from lit_rlhf.tasks.digits import builtin_reward_model

    torch.manual_seed(0)
    model = builtin_reward_model(n_layer=1, n_embd=32, n_head=2).eval().requires_grad_(False)
    enc = tokenizer(["31>", "5>"], padding=True, return_tensors="pt")  # left padded, two prompt lengths
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digit = tokenizer.convert_tokens_to_ids
    raw = torch.tensor([[digit("1"), digit("3"), eos, digit("7")], [digit("5"), digit("5"), digit("5"), digit("5")]])
    mask, truncated = response_mask_from_ids(raw, eos)
    response_ids = torch.where(mask, raw, torch.full_like(raw, pad))
    gen = Generation(enc["input_ids"], enc["attention_mask"], response_ids, mask, truncated)
    assert truncated.tolist() == [False, True]
    prompts, responses = ["31>", "5>"], ["13", "5555"]
    args = (gen.input_ids(), gen.attention_mask(), gen.last_index(), ~gen.truncated)
    composer = RewardComposer([])
    shared = composer(prompts, responses, {}, SequenceRewardModel(model), *args)
    own = composer(prompts, responses, {}, SequenceRewardModel(model, tokenizer), *args)
    torch.testing.assert_close(own, shared)
    # the score read one token early (at '3' instead of the EOS) is another number: the check can fail
    early = SequenceRewardModel(model).score_ids(gen.input_ids(), gen.attention_mask(), gen.last_index() - 1)
    assert (early[0] - shared[0]).abs() > 1e-3
