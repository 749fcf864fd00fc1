"""TRL's reward-function habits: `trainer_state` passed, `async def` awaited (a batch's calls at once), one function
given alone, each function's own scores kept, a model's name in `reward_fns` and TRL's `peft_config` pointed to
the right setting, a peft `LoraConfig` taken as `lora`."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
import torch

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.binding import TrainerState
from lit_rlhf.rewards.columns import required_columns
from lit_rlhf.rewards.composer import RewardComposer, one_part, reward_parts
from lit_rlhf.rewards.functions import RewardError, call_reward_fn, resolve_reward_fns

PROMPTS = ["p1", "p2", "p3"]
RESPONSES = ["a", "bbb", "cc"]
STATE = TrainerState(global_step=6, epoch=1.5, max_steps=12)


def trl_curriculum(completions, trainer_state=None, **kwargs):
    """TRL's step-based curriculum: the score grows with the progress."""
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def trl_kwargs(completions, **kwargs):
    return [float(kwargs["trainer_state"].epoch)] * len(completions)


def ours_with_state(prompts, responses, trainer_state=None, **meta):
    assert "trainer_state" not in meta
    return [float(trainer_state.global_step)] * len(responses)


def ours_without_state(prompts, responses, **meta):
    assert "trainer_state" not in meta  # a function by position gets only the columns it did not name
    return [0.0] * len(responses)


async def async_length(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [float(len(c)) for c in completions]


async def async_state(completions, trainer_state=None, **kwargs):
    await asyncio.sleep(0.3)
    return [float(trainer_state.global_step)] * len(completions)


class AsyncJudge:
    """A callable object whose `__call__` is async (an LLM-judge client)."""

    __name__ = "judge"

    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [(trl_curriculum, 0.5), (trl_kwargs, 1.5), (ours_with_state, 6.0), (ours_without_state, 0.0)],
)
def test_trainer_state_reaches_the_functions_that_take_it(fn, expected):
    assert call_reward_fn(fn, PROMPTS, RESPONSES, {}, state=STATE).tolist() == [expected] * 3
    composer = RewardComposer([fn])
    assert composer(PROMPTS, RESPONSES, {}, trainer_state=STATE).tolist() == [expected] * 3


def test_trainer_state_is_never_a_column_and_needs_no_default():
    def needs_state(completions, trainer_state):
        return [float(trainer_state.max_steps)] * len(completions)

    assert required_columns(needs_state) == set()
    assert required_columns(ours_with_state) == set()
    assert RewardComposer([needs_state])(PROMPTS, RESPONSES, {}, trainer_state=STATE).tolist() == [12.0] * 3


def test_worker_processes_get_the_trainer_state_and_await_async_functions():
    composer = RewardComposer([trl_curriculum, async_state], isolation="process")
    try:
        scores = composer.function_scores(PROMPTS, RESPONSES, {}, STATE)
    finally:
        composer.close()
    assert [s.tolist() for s in scores] == [[0.5] * 3, [6.0] * 3]


def test_async_functions_are_awaited_together_within_a_batch():
    composer = RewardComposer([async_length, async_state, AsyncJudge(), ours_without_state], [1.0, 1.0, 2.0, 1.0])
    start = time.perf_counter()
    total = composer(PROMPTS, RESPONSES, {}, trainer_state=STATE)
    seconds = time.perf_counter() - start
    assert total.tolist() == [1.0 + 6.0 + 2.0, 3.0 + 6.0 + 2.0, 2.0 + 6.0 + 2.0]
    assert seconds < 0.75, f"three 0.3 s calls took {seconds:.2f} s: not concurrent"


def test_an_async_function_inside_a_running_event_loop_still_works():
    async def notebook_cell():  # a notebook runs its cells inside an event loop
        return RewardComposer([async_length])(PROMPTS, RESPONSES, {}).tolist()

    assert asyncio.run(notebook_cell()) == [1.0, 3.0, 2.0]
    assert call_reward_fn(async_length, PROMPTS, RESPONSES, {}).tolist() == [1.0, 3.0, 2.0]


def test_an_async_function_past_the_time_limit_is_cancelled_and_named():
    async def stuck(completions, **kwargs):
        await asyncio.sleep(30)

    start = time.perf_counter()
    with pytest.raises(RewardError, match="stuck did not return within reward_timeout_s=0.2 s.*cancelled"):
        RewardComposer([stuck], timeout_s=0.2)(PROMPTS, RESPONSES, {})
    assert time.perf_counter() - start < 5


def test_an_async_function_that_raises_is_named():
    async def broken(completions, **kwargs):
        raise KeyError("judge down")

    with pytest.raises(RewardError, match="broken raised KeyError: 'judge down'"):
        RewardComposer([broken])(PROMPTS, RESPONSES, {})


@pytest.mark.parametrize("one", [ours_without_state, "lit_rlhf.tasks.digits.sort_digits_reward"])
def test_one_function_alone_is_a_list_of_one(one):
    resolved = resolve_reward_fns(one)
    assert len(resolved) == 1 and callable(resolved[0])
    assert resolved[0].__name__ == (one if isinstance(one, str) else one.__name__).rsplit(".", 1)[-1]


@pytest.mark.parametrize(
    "name", ["OpenAssistant/reward-model-deberta-v3-large-v2", "./models/my_rm", "runs/rm/export", "{folder}"]
)
def test_a_model_in_reward_fns_points_to_reward_model(name, tmp_path):
    name = name.format(folder=tmp_path)
    with pytest.raises(ConfigError, match="looks like a model folder or hub id.*model.reward_model"):
        resolve_reward_fns([name])


def test_each_functions_own_scores_are_kept_unweighted():
    def double(prompts, responses, **meta):
        return [2.0 * len(r) for r in responses]

    composer = RewardComposer([double, ours_without_state, double], weights=[0.5, 3.0, -1.0])
    with reward_parts() as parts:
        total = composer(PROMPTS, RESPONSES, {})
    lengths = [float(len(r)) for r in RESPONSES]
    assert one_part(parts).tolist() == [[2 * n, 0.0, 2 * n] for n in lengths]
    assert total.tolist() == [0.5 * 2 * n - 2 * n for n in lengths]
    assert composer.names() == ["double_1", "ours_without_state", "double_2"]
    assert one_part([torch.zeros(1, 1), torch.zeros(1, 1)]) is None  # two composer calls: ambiguous


def test_a_partial_is_named_after_the_function_it_wraps():
    def near(prompts, responses, target, **meta):
        return [-abs(target - len(r)) for r in responses]

    composer = RewardComposer([functools.partial(near, target=2), functools.partial(functools.partial(near), target=4)])
    assert composer.names() == ["near_1", "near_2"]  # not `partial_1`, `partial_2`


def test_a_lora_config_for_another_task_is_refused():
    peft = pytest.importorskip("peft")
    from lit_rlhf.models.lora import lora_settings

    with pytest.raises(ConfigError, match="model.lora: a LoraConfig with task_type=.*SEQ_CLS.*causal LM"):
        lora_settings(peft.LoraConfig(task_type="SEQ_CLS"))
