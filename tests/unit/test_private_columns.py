"""A reward function that changes a column's values (a dict in a row, an element of the list) changes nothing that
later reward functions, held-out metrics or the next epoch see: every call gets its own copy of the columns."""

from __future__ import annotations

import copy

from lit_rlhf.rewards.functions import call_reward_fn
from lit_rlhf.rewards.parallel import chunked, run_calls


def rows() -> dict[str, list]:
    return {"entry": [{"answer": "12"}, {"answer": "3"}], "answer": ["12", "3"], "tags": [["a"], ["b"]]}


def vandal(prompts, responses, entry, answer, tags):
    entry[0]["answer"] = "vandalised"
    answer[-1] = "vandalised"
    tags[0].append("vandalised")
    entry.append({"answer": "extra"})
    return [0.0] * len(responses)


async def async_vandal(prompts, responses, entry, answer, tags):
    return vandal(prompts, responses, entry, answer, tags)


def test_no_call_changes_the_columns_later_calls_and_epochs_see():
    meta = rows()
    seen = []

    def witness(prompts, responses, entry, answer, tags):
        seen.append(copy.deepcopy((entry, answer, tags)))
        return [1.0] * len(responses)

    prompts, responses = ["p0", "p1"], ["r0", "r1"]
    for _ in range(2):  # two epochs over the same rows
        for workers in (0, 2):  # in this thread, and on worker threads
            calls = [*chunked(vandal, prompts, responses, meta, 2), *chunked(async_vandal, prompts, responses, meta, 1)]
            calls += chunked(witness, prompts, responses, meta, 1)
            run_calls(calls, workers=workers)
        call_reward_fn(vandal, prompts, responses, meta)  # a held-out metric
        call_reward_fn(witness, prompts, responses, meta)
    assert meta == rows()
    assert seen == [(rows()["entry"], rows()["answer"], rows()["tags"])] * 6
