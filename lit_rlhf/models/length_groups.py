"""Rows of a forward batch in groups of similar response length, each group run only to its longest response.

A rollout's response grid is as wide as its longest response, and a GRPO batch's lengths spread widely (a trained
policy answers in a few tokens while one sample of the batch runs to `max_new_tokens`), so a padded forward spends
much of its work on columns after every response's end. Splitting the rows, sorted by response length, into a few
groups and cutting each group to its own longest response removes most of that padding for a few more model calls.
The split is the one that minimises the tokens run plus a fixed cost per extra call (`GROUP_COST_TOKENS`): a
dynamic programme over the sorted lengths (contiguous groups of a sorted list are optimal for this cost). It is
the length grouping of e.g. Krell et al. 2021 (https://arxiv.org/abs/2107.02027), applied inside one forward.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

GROUP_COST_TOKENS = 32
"""What one more model call costs, in response tokens: measured on SmolLM2-135M on one CPU thread, a call's fixed
cost is about that of 25 tokens (0.07 s + 3.3 ms per token); a group must save more than this to be split off."""


def columns_used(mask: Tensor) -> Tensor:
    """One past each row's last set column, 0 for none: (B, T) -> (B,) long."""
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.long() * columns).amax(1)


def response_widths(attention_mask: Tensor, response_len: int) -> Tensor:
    """One past each row's last attended response column, at least 1: (B, P+T) -> (B,) long. Columns after it are
    padding: no logit there predicts a token any loss or metric reads."""
    return columns_used(attention_mask[:, attention_mask.shape[1] - response_len :]).clamp(min=1)


def length_groups(widths: Tensor, max_groups: int, group_cost: int = GROUP_COST_TOKENS) -> list[tuple[Tensor, int]]:
    """The rows split into at most `max_groups` groups, each with its width (its longest row), minimising
    sum(rows x width) + `group_cost` x groups. widths (B,) long -> [(row indices (b,) long, width)], shortest first.
    """
    order = torch.argsort(widths.cpu(), stable=True)  # (B,)
    values, counts = torch.unique(widths.cpu(), return_counts=True)  # (D,) ascending distinct widths
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).double()  # (D+1,): sorted rows before value d
    D = values.shape[0]
    # a group of the distinct values i..j-1 (i < j) holds bounds[j] - bounds[i] rows at width values[j-1]
    end_width = torch.cat([values.new_zeros(1), values]).double()  # (D+1,) indexed by j
    span = (bounds[None, :] - bounds[:, None]) * end_width[None, :] + group_cost  # (D+1, D+1) [i, j]
    span = span.masked_fill(~torch.ones(D + 1, D + 1, dtype=torch.bool).triu(1), float("inf"))
    best = torch.full((D + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0  # best[j]: least cost of the first j distinct values in the groups so far
    costs, starts = [], []
    for _ in range(min(max_groups, D)):
        best, start = (best[:, None] + span).min(0)  # (D+1,): one more group, ending at each j
        costs.append(float(best[D]))
        starts.append(start)
    groups_used = min(range(len(costs)), key=costs.__getitem__) + 1
    pieces, end = [], D
    for start in reversed(starts[:groups_used]):
        begin = int(start[end])
        pieces.append((int(bounds[begin]), int(bounds[end]), int(values[end - 1])))
        end = begin
    return [(order[a:b].to(widths.device), width) for a, b, width in reversed(pieces)]


def can_copy_rows(cache: Any) -> bool:
    """Whether `cache` is a transformers `Cache` whose layers are all plain or sliding-window dynamic layers
    (transformers >= 4.56): those replace their tensors on every change rather than writing into them, so
    `cache_rows` can copy them shallowly."""
    try:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:
        return False
    layers = getattr(cache, "layers", None)
    copyable = (DynamicLayer, DynamicSlidingWindowLayer)
    return isinstance(layers, list) and all(type(layer) in copyable for layer in layers)


def cache_rows(cache: Any, rows: Tensor) -> Any:
    """A new transformers `Cache` holding rows `rows` of `cache` (an `index_select` per layer, keeping autograd);
    `cache` (`can_copy_rows`) is left as it was."""
    copied = copy.copy(cache)
    copied.layers = [copy.copy(layer) for layer in cache.layers]
    copied.reorder_cache(rows)
    return copied


def scatter_rows(parts: list[Tensor], groups: list[tuple[Tensor, int]], batch: int, width: int) -> Tensor:
    """Each group's (b, w, ...) output put back on the batch's rows and first w columns of a (B, T, ...) tensor of
    zeros (the padding columns after a group's width)."""
    first = parts[0]
    out = first.new_zeros(batch, width, *first.shape[2:])
    for part, (rows, part_width) in zip(parts, groups, strict=True):
        out[rows, :part_width] = part
    return out
