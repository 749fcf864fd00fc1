"""Rows of similar response length run apart, each group cut to its longest response (`algorithm.length_groups`):
the split is the cheapest one (against trying every split), and the grouped forward gives every response token the
logits and gradients of running each row alone, plain or with shared prompts."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_shared_prefill import llama_policy
from test_shared_prompt_forward import assert_same_outputs, critic_outputs, gpt2, gradients, row_by_row_loss

from conftest import forward_logits
from lit_rlhf import AlgorithmConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.forward import causal_lm_response_forward, returned_cache
from lit_rlhf.models.length_groups import cache_rows, length_groups, response_widths
from lit_rlhf.models.output_head import reads_head

B0, G, P, T, V = 3, 4, 7, 12, 16  # V: the vocabulary of test_shared_prefill's Llama
WIDTHS = [2, 12, 1, 3, 9, 2, 3, 1, 2, 2, 1, 2]  # per row of `varied_batch` (G rows per prompt): two long


def cheapest_split_by_trying_all(widths: list[int], max_groups: int, cost: int) -> int:
    """The slow obvious reference: every way to cut the sorted widths into at most `max_groups` runs."""
    ordered, best = sorted(widths), float("inf")
    for groups in range(1, min(max_groups, len(ordered)) + 1):
        for cuts in itertools.combinations(range(1, len(ordered)), groups - 1):
            bounds = [0, *cuts, len(ordered)]
            total = sum((b - a) * ordered[b - 1] for a, b in itertools.pairwise(bounds)) + cost * groups
            best = min(best, total)
    return int(best)


def varied_batch(seed: int = 1):
    """B0 prompts (two left-padded), each G times, responses of `WIDTHS` tokens (padding after), rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (B0, P), generator=g)
    prompt_mask = torch.ones(B0, P, dtype=torch.long)
    prompt_mask[0, :3] = prompt_mask[1, :1] = 0
    prompts[prompt_mask == 0] = 0
    response_mask = (torch.arange(T)[None] < torch.tensor(WIDTHS)[:, None]).long()
    ids = torch.cat([prompts.repeat_interleave(G, 0), torch.randint(3, V, (B0 * G, T), generator=g)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), response_mask], 1)
    order = torch.randperm(B0 * G, generator=g)
    return ids[order], mask[order]


def test_the_split_is_the_cheapest_of_all_splits():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows = int(torch.randint(1, 9, (1,), generator=g))
        widths = torch.randint(1, 30, (rows,), generator=g)
        max_groups, cost = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
        groups = length_groups(widths, max_groups, cost)
        assert 1 <= len(groups) <= max_groups
        assert sorted(torch.cat([rows for rows, _ in groups]).tolist()) == list(range(len(widths)))
        assert all(width == int(widths[rows].max()) for rows, width in groups)
        total = sum(len(rows) * width for rows, width in groups) + cost * len(groups)
        assert total == cheapest_split_by_trying_all(widths.tolist(), max_groups, cost)


def test_a_split_pays_only_when_it_saves_more_than_a_call():
    widths = torch.tensor([2] * 6 + [12] * 2)  # 96 tokens padded; 6 x 2 + 2 x 12 = 36 in two groups
    assert len(length_groups(widths, 4, group_cost=59)) == 2  # saves 60 > 59
    assert len(length_groups(widths, 4, group_cost=60)) == 1  # saves 60, not more
    assert len(length_groups(torch.tensor([5] * 8), 4, group_cost=0)) == 1  # equal widths are never split


def test_a_response_is_as_wide_as_its_last_attended_column():
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0, 0, 0],  # prompt of 3 columns, then a response of 1 token
            [1, 1, 1, 1, 0, 1, 0],  # a gap (an environment's tokens not attended): width 3
            [1, 1, 1, 0, 0, 0, 0],  # no response token: width 1 (the grid has at least one column)
        ]
    )
    assert response_widths(mask, 4).tolist() == [1, 3, 1]


def test_cache_rows_copies_without_touching_the_cache():
    model = gpt2()
    ids, _ = varied_batch()
    cache = returned_cache(model(input_ids=ids[:3, :P], use_cache=True))
    keys = [layer.keys for layer in cache.layers]
    copied = cache_rows(cache, torch.tensor([2, 0]))
    for layer, original, copy in zip(cache.layers, keys, copied.layers, strict=True):
        assert layer.keys is original and layer.keys.shape[0] == 3
        torch.testing.assert_close(copy.keys, original[[2, 0]], rtol=0, atol=0)


@pytest.mark.parametrize("share", [False, True])
def test_grouped_forward_gives_the_row_by_row_logits_and_gradients_in_float64(share):
    model = gpt2()
    ids, mask = varied_batch()
    weights = torch.randn(ids.shape[0], T, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    response_mask = mask[:, -T:, None]

    def loss():
        logits = forward_logits(model, ids, mask, T, share_prompts=share, length_groups=4)
        return (logits * weights * response_mask).sum()

    grouped = gradients(model, loss)
    alone = gradients(model, lambda: row_by_row_loss(model, ids, mask, weights))
    for name, grad in alone.items():
        torch.testing.assert_close(grouped[name], grad, rtol=1e-10, atol=1e-11)
    with torch.no_grad():
        padded = forward_logits(model, ids, mask, T, share_prompts=share)
        logits = forward_logits(model, ids, mask, T, share_prompts=share, length_groups=4)
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(logits[valid], padded[valid], rtol=1e-12, atol=1e-12)
    short = mask[:, -T:].sum(1) <= 3  # the group cut to 3 columns (`test_each_group_runs_only_to_its_longest_response`)
    assert logits.shape == padded.shape and bool((logits[short, 3:] == 0).all())


@pytest.mark.parametrize("share", [False, True])
def test_each_group_runs_only_to_its_longest_response(share):
    model = gpt2()
    ids, mask = varied_batch()
    reads_head(model, ids, mask)  # the head's one-row check on a model's first forward, done before counting
    shapes = []
    hook = model.transformer.wte.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        causal_lm_response_forward(model, ids, mask, T, share_prompts=share, length_groups=4)
    hook.remove()
    # WIDTHS sorted: 1 1 1 2 2 2 2 2 3 3 9 12; at 32 tokens per call {1..3} and {9, 12}: 10 x 3 + 2 x 12 + 64 = 118
    # (one group: 12 x 12 + 32 = 176; three: 3 x 1 + 7 x 3 + 2 x 12 + 96 = 144)
    if share:  # the prompts once, then each group's responses but their last token over the prompts' cache
        assert shapes == [(B0, P), (10, 3 - 1), (2, 12 - 1)]
    else:  # each group's prompts and responses; the long rows' prompts (0 and 1) share 1 column of left padding
        assert shapes == [(10, P + 3), (2, P - 1 + 12)]


def test_llama_values_come_along_grouped_in_float32():
    """Grouped-query attention and rotary positions; the value head reads each group's hidden states."""
    torch.manual_seed(3)
    padded = ActorCritic(llama_policy().train(), value_head=True, share_prompts=True)
    grouped = ActorCritic(padded.policy, value_head=True, share_prompts=True, length_groups=4)
    grouped.value_head = padded.value_head
    ids, mask = varied_batch()
    assert_same_outputs(critic_outputs(grouped, ids, mask, T), critic_outputs(padded, ids, mask, T), mask[:, -T:])


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_length_groups_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="algorithm.length_groups"):
        AlgorithmConfig(length_groups=value)


def test_a_cache_that_cannot_be_copied_runs_its_responses_padded(monkeypatch):
    import lit_rlhf.models.length_groups as grouping

    model = gpt2()
    ids, mask = varied_batch()
    with torch.no_grad():
        grouped = forward_logits(model, ids, mask, T, share_prompts=True, length_groups=4)
    monkeypatch.setattr(grouping, "can_copy_rows", lambda cache: False)
    reads_head(model, ids, mask)  # the head's one-row check on a model's first forward, done before counting
    shapes = []
    hook = model.transformer.wte.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        padded = forward_logits(model, ids, mask, T, share_prompts=True, length_groups=4)
    hook.remove()
    assert shapes == [(B0, P), (B0 * G, T - 1)]
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(padded[valid], grouped[valid], rtol=1e-12, atol=1e-12)
