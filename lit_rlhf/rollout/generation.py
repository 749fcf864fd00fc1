"""What every rollout backend returns (`Generation`: `group_size` responses per prompt on the response grid),
the one post-processing of sampled ids (response mask up to the first EOS, pad after it, truncation flags), and
decoding to text.

"EOS" here is any of the stop ids (`lit_rlhf.models.stop_ids.stop_token_ids`: the tokenizer's EOS, the generation
config's and the chat template's end of turn); `eos_token_id` takes one id or several, as in Hugging Face
`generate`, and a response ends at the first of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.algorithms.losses import last_token_index
from lit_rlhf.config import ConfigError
from lit_rlhf.models.stop_ids import stop_token_ids
from lit_rlhf.types import PromptBatch

EosIds = int | Sequence[int]
"""One id that ends a response, or several (a response ends at the first of them)."""


@dataclass
class Generation:
    """Sampled responses on the response grid."""

    prompt_ids: Tensor  # (B, P) left padded, each prompt repeated G times
    prompt_mask: Tensor  # (B, P)
    response_ids: Tensor  # (B, T) right padded with pad after the first EOS
    response_mask: Tensor  # (B, T) bool, up to and including the first EOS
    truncated: Tensor  # (B,) bool, no EOS within the limit
    logprobs: Tensor | None = None  # (B, T) float32: an engine's own log-probs of the sampled tokens, 0 after EOS

    def input_ids(self) -> Tensor:
        """Prompt and response: (B, P+T)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """(B, P+T): the prompt's mask, then the response up to its EOS."""
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    def last_index(self) -> Tensor:
        """(B,) column of each response's last token (its EOS, when it ended) in `input_ids()`."""
        return self.prompt_ids.shape[1] + last_token_index(self.response_mask)


def eos_id_list(eos_token_id: EosIds) -> list[int]:
    """`eos_token_id` (one id or several) as a list of ids."""
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]


def is_eos(ids: Tensor, eos_token_id: EosIds) -> Tensor:
    """Elementwise: is the id one of the stop ids? Same shape as `ids`, bool."""
    return torch.isin(ids, torch.tensor(eos_id_list(eos_token_id), dtype=ids.dtype, device=ids.device))


def response_mask_from_ids(response_ids: Tensor, eos_token_id: EosIds) -> tuple[Tensor, Tensor]:
    """(B, T) ids -> mask (B, T) bool up to and including the first EOS (of any of the stop ids), truncated (B,)
    bool."""
    ended = is_eos(response_ids, eos_token_id)
    eos_seen_before = (ended.long().cumsum(dim=1) - ended.long()) > 0  # an EOS strictly earlier
    mask = ~eos_seen_before
    truncated = ~ended.any(dim=1)
    return mask, truncated


def finish_generation(
    prompts: PromptBatch,
    group_size: int,
    raw: Tensor,
    eos_token_id: EosIds,
    pad_token_id: int,
    logprobs: Tensor | None = None,
) -> Generation:
    """A backend's raw sampled ids (B, T) for `prompts` (B0 rows, B = B0 x G) -> the `Generation`: each prompt
    repeated `group_size` times, the response mask up to the first EOS, pad after it, the truncation flags; an
    engine's log-probs (B, T) kept with 0 after the first EOS."""
    prompt_ids = prompts.input_ids.repeat_interleave(group_size, dim=0)  # (B, P)
    prompt_mask = prompts.attention_mask.repeat_interleave(group_size, dim=0)  # (B, P)
    response_mask, truncated = response_mask_from_ids(raw, eos_token_id)
    response_ids = torch.where(response_mask, raw, torch.full_like(raw, pad_token_id))
    if logprobs is not None:
        logprobs = torch.where(response_mask, logprobs.float(), torch.zeros_like(logprobs, dtype=torch.float32))
    return Generation(prompt_ids, prompt_mask, response_ids, response_mask, truncated, logprobs)


def decode_responses(
    tokenizer: Any, response_ids: Tensor, response_mask: Tensor, eos_token_id: EosIds | None = None
) -> list[str]:
    """Response texts up to (not including) the first EOS; `eos_token_id` None: the tokenizer's stop ids
    (`stop_token_ids(tokenizer)`: its EOS and its chat template's end of turn).

    Other special tokens the policy produced stay in the text, so a reward function sees exactly what was
    generated (skipping them would let a policy pad its answer with invisible tokens). A policy whose vocabulary
    is padded beyond its tokenizer can sample an id the tokenizer cannot decode: that is an error, never a
    token silently dropped from the text.
    """
    stops = stop_token_ids(tokenizer) if eos_token_id is None else eos_token_id
    keep = response_mask & ~is_eos(response_ids, stops)
    known = len(tokenizer)
    if (unknown := keep & ((response_ids >= known) | (response_ids < 0))).any():
        row, col = (int(i) for i in unknown.nonzero()[0])
        raise ConfigError(
            f"model.tokenizer: the policy sampled token id {int(response_ids[row, col])} (response {row}, position "
            f"{col}), but the tokenizer has only {known} tokens, so the text would silently lose it; use the "
            "tokenizer that belongs to model.policy, or add the missing tokens to it"
        )
    rows = [ids[k].tolist() for ids, k in zip(response_ids.cpu(), keep.cpu(), strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=False)
