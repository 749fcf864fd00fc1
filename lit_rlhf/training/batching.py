"""Micro-batches by a token budget, cut to their own width: less compute on padding in the update.

A minibatch's rows are sorted by length (longest first) and packed greedily, so rows of similar length share a
micro-batch; each micro-batch then drops the columns that are padding in every one of its rows (prompt left
padding, response columns after its longest response). The loss stays exact: every term is normalised by the
minibatch's totals (`MinibatchTotals`), and the cut columns are masked out of the loss and, the model being
causal with explicit position ids, change no logit of a kept token. Sorting by length to cut padding is
the "length grouping" of e.g. Krell et al. 2021, https://arxiv.org/abs/2107.02027 (which packs instead).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lit_rlhf.config import ConfigError
from lit_rlhf.models.length_groups import columns_used
from lit_rlhf.types import Experience, split_rows

PROMPT_FIELDS = ("prompt_ids", "prompt_mask")


def row_lengths(prompt_mask: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Valid prompt tokens (B,) and response length (B,): the columns each row needs, from (B, P) and (B, T)."""
    prompt = prompt_mask.long().sum(1)  # left padded: the prompt occupies the last `prompt` columns
    return prompt, columns_used(response_mask)  # one past the last valid response column


def token_budget_rows(prompt_len: Tensor, response_len: Tensor, budget: int) -> list[Tensor]:
    """Row indices of each micro-batch: rows sorted by prompt + response length (longest first), then greedily
    as many per micro-batch as keep rows x (longest prompt + longest response among them) <= budget.

    prompt_len, response_len: (B,) long. Raises `ConfigError` if one row alone exceeds the budget.
    """
    order = torch.argsort(prompt_len + response_len, descending=True, stable=True).tolist()
    prompts, responses = prompt_len.tolist(), response_len.tolist()
    pieces: list[list[int]] = []
    widest_prompt = widest_response = 0
    for row in order:
        p, r = max(widest_prompt, prompts[row]), max(widest_response, responses[row])
        if pieces and (len(pieces[-1]) + 1) * (p + r) <= budget:
            pieces[-1].append(row)
            widest_prompt, widest_response = p, r
            continue
        if prompts[row] + responses[row] > budget:
            raise ConfigError(
                f"algorithm.micro_batch_tokens: {budget} is less than one sequence of this rollout "
                f"({prompts[row]} prompt + {responses[row]} response tokens); raise it to at least "
                f"{prompts[row] + responses[row]}"
            )
        pieces.append([row])
        widest_prompt, widest_response = prompts[row], responses[row]
    return [torch.tensor(rows, dtype=torch.long, device=prompt_len.device) for rows in pieces]


def trim_padding(mb: Experience) -> Experience:
    """`mb` without the prompt columns that are left padding in every row and the response columns after its
    longest response: (B, P) -> (B, P'), (B, T) -> (B, T') for every per-token field."""
    prompt_len, response_len = row_lengths(mb.prompt_mask, mb.response_mask)
    P, T = mb.prompt_len, mb.response_ids.shape[1]
    keep_prompt, keep_response = int(prompt_len.max()), max(int(response_len.max()), 1)
    if keep_prompt == P and keep_response == T:
        return mb
    changes = {}
    for f in dataclasses.fields(mb):
        value = getattr(mb, f.name)
        if f.name in PROMPT_FIELDS:
            changes[f.name] = value[:, P - keep_prompt :]
        elif isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (mb.batch_size, T):
            changes[f.name] = value[:, :keep_response]
    return dataclasses.replace(mb, **changes)


def micro_batches(minibatch: Experience, micro_size: int, token_budget: int | None) -> list[Experience]:
    """The micro-batches of a minibatch: `token_budget` set: by the budget over length-sorted rows, each cut to
    its own width; otherwise consecutive slices of `micro_size` rows, uncut."""
    if token_budget is None:
        return [minibatch.select(rows) for rows in split_rows(minibatch.batch_size, micro_size)]
    prompt_len, response_len = row_lengths(minibatch.prompt_mask, minibatch.response_mask)
    return [trim_padding(minibatch.select(rows)) for rows in token_budget_rows(prompt_len, response_len, token_budget)]


def padding_fraction(pieces: list[Experience]) -> float:
    """Share of the (rows x columns) the micro-batches' forwards compute that is padding (prompt or response)."""
    total = valid = 0
    for mb in pieces:
        total += mb.batch_size * (mb.prompt_len + mb.response_ids.shape[1])
        valid += int(mb.prompt_mask.sum()) + int(mb.response_mask.sum())
    return 1.0 - valid / max(total, 1)
