"""The one forward that training, evaluation and the reference share: logits (and the last hidden state) on the
(B, T) response grid only, plain or with each distinct prompt run once (`algorithm.share_prompt_forward`).

Shared prompts: a GRPO rollout holds every prompt `group_size` times, so the plain forward runs each prompt's
tokens through the model G times, forward and backward; with a chat template and a system prompt they are most
of the tokens. The shared forward runs the distinct prompts once (one row each, their KV cache kept with its
autograd history), gathers the cache rows back to the batch's rows (`index_select`: its backward sums the G
rows' gradients into the one prompt row) and runs the responses over that cache. Every valid token sees the same
keys, values and positions as in the plain forward, so logits and gradients agree up to float rounding. This is
the shared-prefix forward of Prefix Grouper (Liu et al. 2025, https://arxiv.org/abs/2506.05433).

Length groups (`algorithm.length_groups`): rows of similar response length run apart, each group cut to its
longest response (`lit_rlhf.models.length_groups`), plain or over each group's copy of the prompts' cache rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models import length_groups as grouping


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: cumulative sum of the mask minus one, 0 on padding. (B, S)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits(logits: Tensor, prompt_len: int, response_len: int | None = None) -> Tensor:
    """The logits that predict each response token: (B, P+T, V) -> (B, T, V).

    Position P-1 predicts the first response token, so the slice is `[P-1 : P-1+T]`.
    This is the only place in the library where that off-by-one lives.
    """
    total = logits.shape[1]
    if response_len is None:
        response_len = total - prompt_len
    return logits[:, prompt_len - 1 : prompt_len - 1 + response_len]


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model itself: the one a wrapper that passes its **kwargs on holds (a peft model, the
    adapter-disabled reference: `get_base_model`), else `model`."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def accepts_argument(model: nn.Module, argument: str) -> bool:
    """Whether `model.forward` takes `argument` (asked of the model a peft wrapper holds)."""
    return argument in inspect.signature(base_model(model).forward).parameters


def cache_keyword(model: nn.Module) -> str:
    """The forward keyword for a KV cache: 'cache' (transformers >= 5.2x) or 'past_key_values'."""
    return "cache" if accepts_argument(model, "cache") else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a transformers forward returned (None when it returned none)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def causal_lm_response_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    want_hidden: bool = False,
    share_prompts: bool = False,
    length_groups: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """Logits predicting the last `response_len` tokens, and optionally the last hidden state there.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V) in the model's dtype, hidden (B, T, H) or None.
    Only the T+1 last positions go through the LM head when the model supports `logits_to_keep`.
    `share_prompts`: run each distinct prompt once when some repeat (`shared_prompt_response_forward`).
    `length_groups` > 1: rows of similar response length run in up to that many groups, each cut to its longest
    response (`lit_rlhf.models.length_groups`); a group's columns after its width are then 0, not computed.
    """
    groups = response_groups(attention_mask, response_len, length_groups)
    if share_prompts and can_share_prompts(model, input_ids, response_len):
        prompt_len = input_ids.shape[1] - response_len
        distinct = distinct_prompts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])
        if distinct[0].shape[0] < input_ids.shape[0]:  # some prompt repeats
            return shared_prompt_response_forward(
                model, input_ids, attention_mask, response_len, distinct, want_hidden, groups
            )
    if groups is None:
        return plain_response_forward(model, input_ids, attention_mask, response_len, want_hidden)
    P = input_ids.shape[1] - response_len
    parts = []
    for rows, width in groups:
        mask = attention_mask[rows, : P + width]
        first = int(mask[:, :P].any(0).long().argmax())  # the prompt columns before it are padding in every row
        parts.append(
            plain_response_forward(model, input_ids[rows, first : P + width], mask[:, first:], width, want_hidden)
        )
    return scattered(parts, groups, input_ids.shape[0], response_len)


def response_groups(attention_mask: Tensor, response_len: int, max_groups: int) -> list[tuple[Tensor, int]] | None:
    """`length_groups.length_groups` of the batch's rows, or None where one group as wide as the grid is best."""
    if max_groups <= 1:
        return None
    groups = grouping.length_groups(grouping.response_widths(attention_mask, response_len), max_groups)
    return None if len(groups) == 1 and groups[0][1] == response_len else groups


def scattered(
    parts: list[tuple[Tensor, Tensor | None]], groups: list[tuple[Tensor, int]], batch: int, response_len: int
) -> tuple[Tensor, Tensor | None]:
    """The groups' (logits, hidden) back on the batch's (B, T) grid, zeros after each group's width."""
    logits = grouping.scatter_rows([part[0] for part in parts], groups, batch, response_len)
    hiddens = [hidden for _, hidden in parts if hidden is not None]
    if len(hiddens) < len(parts):
        return logits, None
    return logits, grouping.scatter_rows(hiddens, groups, batch, response_len)


def plain_response_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, want_hidden: bool
) -> tuple[Tensor, Tensor | None]:
    """`causal_lm_response_forward`'s contract in one forward over every row's prompt and response."""
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        output_hidden_states=want_hidden,
    )
    if accepts_argument(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = response_len + 1
    out = model(**kwargs)
    logits = out.logits
    kept_prompt = logits.shape[1] - response_len  # 1 when logits_to_keep worked, P otherwise
    logits = response_logits(logits, kept_prompt, response_len)
    hidden = None
    if want_hidden:
        last = out.hidden_states[-1]
        hidden = response_logits(last, last.shape[1] - response_len, response_len)
    return logits, hidden


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (ids, mask) rows of a prompt batch and where each row comes from.

    prompt_ids, prompt_mask (B, P) -> ids (U, P), mask (U, P), inverse (B,) with row i == distinct row inverse[i].
    """
    width = prompt_ids.shape[1]
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # (B, 2P)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)  # (U, 2P), (B,)
    return distinct[:, :width], distinct[:, width:].to(prompt_mask.dtype), inverse


def can_share_prompts(model: nn.Module, input_ids: Tensor, response_len: int) -> bool:
    """Whether the prompts could run apart from the responses: there is a prompt, and no gradient checkpointing
    under grad (transformers turns the KV cache off there)."""
    if input_ids.shape[1] <= response_len:
        return False
    return not (torch.is_grad_enabled() and checkpointing(base_model(model)))


def checkpointing(model: nn.Module) -> bool:
    """Whether a transformers model recomputes activations in backward (gradient checkpointing)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the newer name first
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def shared_prompt_response_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    distinct: tuple[Tensor, Tensor, Tensor],
    want_hidden: bool = False,
    groups: list[tuple[Tensor, int]] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`causal_lm_response_forward`'s contract with each distinct prompt run once.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V), hidden (B, T, H) or None; `distinct`: the prompts'
    `distinct_prompts`. The last prompt position predicts response token 0 and response tokens 0..T-2 the rest
    (the last response token is not run). `groups`: (rows, width) of `response_groups`, each run over its own
    copy of the prompts' cache rows and cut to its width; None: all rows at once over the cache itself.
    """
    prefix = PromptPrefix.of(model, distinct, want_hidden)
    if groups is not None and not grouping.can_copy_rows(prefix.cache):
        groups = None  # a cache of another kind: one group as wide as the grid (the same logits, padded)
    if groups is None:
        return responses_after_prompts(
            model, prefix, input_ids, attention_mask, response_len, None, response_len, want_hidden
        )
    parts = [
        responses_after_prompts(model, prefix, input_ids, attention_mask, response_len, rows, width, want_hidden)
        for rows, width in groups
    ]
    return scattered(parts, groups, input_ids.shape[0], response_len)


@dataclass
class PromptPrefix:
    """The distinct prompts' forward: their KV cache (U rows), the logits (U, 1, V) and hidden state (U, 1, H) or
    None that predict response token 0, and each batch row's prompt, `inverse` (B,)."""

    cache: Any
    logits: Tensor
    hidden: Tensor | None
    inverse: Tensor

    @classmethod
    def of(cls, model: nn.Module, distinct: tuple[Tensor, Tensor, Tensor], want_hidden: bool) -> PromptPrefix:
        ids, mask, inverse = distinct  # (U, P), (U, P), (B,)
        keep_last = {"logits_to_keep": 1} if accepts_argument(model, "logits_to_keep") else {}
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
            output_hidden_states=want_hidden,
            **keep_last,
        )
        cache = returned_cache(out)
        if cache is None or not callable(getattr(cache, "reorder_cache", None)):
            raise ConfigError(
                f"algorithm.share_prompt_forward: {type(base_model(model)).__name__} returned no transformers KV "
                "cache from the prompt forward, so its prompts cannot be shared; set algorithm.share_prompt_forward: "
                "false"
            )
        hidden = out.hidden_states[-1][:, -1:] if want_hidden else None
        return cls(cache, out.logits[:, -1:], hidden, inverse)


def responses_after_prompts(
    model: nn.Module,
    prefix: PromptPrefix,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    rows: Tensor | None,
    width: int,
    want_hidden: bool,
) -> tuple[Tensor, Tensor | None]:
    """Logits (b, width, V) and hidden (b, width, H) or None of the batch rows `rows`, cut to `width` of the grid's
    `response_len` columns. None: all rows, over the prompts' cache itself (its rows gathered in place); else over
    a copy of their rows of it."""
    P = input_ids.shape[1] - response_len
    if rows is None:
        prompt_rows = prefix.inverse  # (B,)
        prefix.cache.reorder_cache(prompt_rows)  # (U, ...) -> (B, ...): row i holds its prompt's keys and values
        cache = prefix.cache
    else:
        prompt_rows = prefix.inverse[rows]  # (b,)
        cache = grouping.cache_rows(prefix.cache, prompt_rows)
        input_ids, attention_mask = input_ids[rows], attention_mask[rows]
    logits = prefix.logits.index_select(0, prompt_rows)  # (b, 1, V)
    hidden = prefix.hidden.index_select(0, prompt_rows) if prefix.hidden is not None else None  # (b, 1, H)
    if width == 1:
        return logits, hidden
    out = model(
        input_ids=input_ids[:, P : P + width - 1],  # (b, width-1)
        attention_mask=attention_mask[:, : P + width - 1],
        position_ids=position_ids_from_mask(attention_mask[:, : P + width - 1])[:, P:],
        use_cache=True,
        output_hidden_states=want_hidden,
        **{cache_keyword(model): cache},
    )
    logits = torch.cat([logits, out.logits], dim=1)  # (b, width, V)
    if hidden is not None:
        hidden = torch.cat([hidden, out.hidden_states[-1]], dim=1)  # (b, width, H)
    return logits, hidden
