"""Reward functions bound by parameter name: ours, TRL's, by position; unknown signatures refused at setup."""

from __future__ import annotations

import functools

import pytest

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.columns import required_columns
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import call_reward_fn, resolve_reward_fns

PROMPTS = ["p1", "p2"]
RESPONSES = ["long response", "r"]


def trl_reward(completions, prompts=None, **kwargs):
    """TRL's form: the completions first, prompts by keyword."""
    assert prompts == PROMPTS
    return [float(len(c)) for c in completions]


def trl_columns(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def trl_kwargs_only(**kwargs):
    return [float(len(c)) for c in kwargs["completions"]]


def ours_by_name(*, responses, prompts, answer):
    return [float(r == a) for r, a in zip(responses, answer, strict=True)]


def ours_by_position(p, r, **meta):
    return [float(len(x)) for x in r]


def conversational(completions, prompts, **kwargs):
    assert prompts[0][0] == {"role": "user", "content": "hi"}
    return [float(len(c[0]["content"])) for c in completions if c[0]["role"] == "assistant"]


def one_parameter(texts):
    return [0.0] * len(texts)


def both_names(completions, responses):
    return [0.0]


def needs_ids(completions, completion_ids):
    return [0.0]


def positional_only(completions, /, prompts):
    return [0.0]


LENGTHS = [float(len(r)) for r in RESPONSES]


@pytest.mark.parametrize(
    "fn, meta, expected",
    [
        (trl_reward, {}, LENGTHS),
        (trl_columns, {"answer": ["r", "r"], "other": [1, 2]}, [0.0, 1.0]),
        (trl_kwargs_only, {}, LENGTHS),
        (ours_by_name, {"answer": ["long response", "x"]}, [1.0, 0.0]),
        (ours_by_position, {"answer": [1, 2]}, LENGTHS),
        (lambda prompts, responses: [1.0, 2.0], {}, [1.0, 2.0]),
        (conversational, {"messages": [[{"role": "user", "content": "hi"}]] * 2}, LENGTHS),
        (conversational, {"messages": ['[{"role": "user", "content": "hi"}]'] * 2}, LENGTHS),
    ],
)
def test_reward_functions_are_bound_by_name_or_position(fn, meta, expected):
    assert call_reward_fn(fn, PROMPTS, RESPONSES, meta).tolist() == expected


def test_trl_completions_are_strings_when_the_rows_are_not_conversations():
    seen = []
    RewardComposer([lambda completions, **kw: seen.append(completions) or [0.0, 0.0]])(PROMPTS, RESPONSES, {})
    assert seen == [RESPONSES]


@pytest.mark.parametrize(
    "fn, says",
    [
        (one_parameter, "takes (texts): not the prompts and the responses"),
        (both_names, "takes both `completions` and `responses`"),
        (needs_ids, "needs `completion_ids` (no default)"),
        (positional_only, "['completions'] are positional-only"),
    ],
)
def test_an_unknown_signature_is_refused_at_setup_with_the_accepted_forms(fn, says):
    for make in (lambda: RewardComposer([fn]), lambda: resolve_reward_fns([fn], "model.metric_fns")):
        with pytest.raises(ConfigError) as info:
            make()
        assert says in str(info.value) and "accepted forms: fn(prompts, responses, **columns)" in str(info.value)
        assert fn.__name__ in str(info.value)


@pytest.mark.parametrize(
    "fn, columns",
    [
        (trl_reward, set()),
        (trl_columns, {"answer"}),
        (ours_by_name, {"answer"}),
        (functools.partial(trl_columns, answer=["x"]), set()),
        (one_parameter, set()),  # refused at setup, not here
    ],
)
def test_the_column_check_reads_named_forms(fn, columns):
    assert required_columns(fn) == columns


def test_worker_processes_bind_by_name_too():
    composer = RewardComposer([trl_columns, trl_reward], isolation="process")
    try:
        scores = composer.function_scores(PROMPTS, RESPONSES, {"answer": ["r", "r"]})
    finally:
        composer.close()
    assert [s.tolist() for s in scores] == [[0.0, 1.0], LENGTHS]
