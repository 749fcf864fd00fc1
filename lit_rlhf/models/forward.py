"""The one forward that training, evaluation and the reference share: the LM head's input (the final hidden states)
on the (B, T) response grid only, plain or with each distinct prompt run once (`algorithm.share_prompt_forward`).
No logits are built: the head's input is caught and the head skipped (`lit_rlhf.models.output_head`), and each
phase computes the few numbers it needs per token from it in chunks (`lit_rlhf.algorithms.chunked_logprobs`).

Shared prompts: a GRPO rollout holds every prompt `group_size` times, so the plain forward runs each prompt's
tokens through the model G times, forward and backward; with a chat template and a system prompt they are most
of the tokens. The shared forward runs the distinct prompts once (one row each, their KV cache kept with its
autograd history), gathers the cache rows back to the batch's rows (`index_select`: its backward sums the G
rows' gradients into the one prompt row) and runs the responses over that cache. Every valid token sees the same
keys, values and positions as in the plain forward, so the outputs and gradients agree up to float rounding. This
is the shared-prefix forward of Prefix Grouper (Liu et al. 2025, https://arxiv.org/abs/2506.05433).

Length groups (`algorithm.length_groups`): rows of similar response length run apart, each group cut to its
longest response (`lit_rlhf.models.length_groups`), plain or over each group's copy of the prompts' cache rows.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.chunked_logprobs import Head
from lit_rlhf.config import ConfigError
from lit_rlhf.models import length_groups as grouping
from lit_rlhf.models.output_head import HeadUse, base_model, capture_head_input, reads_head


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: cumulative sum of the mask minus one, 0 on padding. (B, S)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_positions(outputs: Tensor, prompt_len: int, response_len: int | None = None) -> Tensor:
    """The positions that predict each response token: (B, P+T, ...) -> (B, T, ...).

    Position P-1 predicts the first response token, so the slice is `[P-1 : P-1+T]`.
    This is the only place in the library where that off-by-one lives.
    """
    total = outputs.shape[1]
    if response_len is None:
        response_len = total - prompt_len
    return outputs[:, prompt_len - 1 : prompt_len - 1 + response_len]


@dataclass
class ResponseForward:
    """A forward's outputs on the (B, T) response grid: the LM head's input, and how logits come from it.

    Where the head can be read (`output_head.reads_head`), no logits are built: `head` holds its weight and
    `chunked_logprobs.head_stats` computes from `hidden` chunk by chunk. Otherwise `logits` holds the model's
    own and `head` is the identity over them.
    """

    hidden: Tensor  # (B, T, H)
    head: Head
    logits: Tensor | None = None  # (B, T, V), only for a head that cannot be read

    @property
    def head_inputs(self) -> Tensor:
        """What `head` turns into logits: (B, T, H), or (B, T, V) the logits themselves."""
        return self.hidden if self.logits is None else self.logits

    def detach(self) -> ResponseForward:
        logits = self.logits.detach() if self.logits is not None else None
        weight, bias = self.head.weight, self.head.bias
        head = dataclasses.replace(
            self.head,
            weight=weight.detach() if weight is not None else None,
            bias=bias.detach() if bias is not None else None,
        )
        return ResponseForward(self.hidden.detach(), head, logits)


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
    share_prompts: bool = False,
    length_groups: int = 1,
    head: bool = True,
) -> ResponseForward:
    """The LM head's input where it predicts the last `response_len` tokens, and the head.

    input_ids, attention_mask (B, P+T) -> hidden (B, T, H) in the model's dtype. `head` False: the caller needs
    the hidden states only (a critic's backbone), so the head is never checked and never run.
    `share_prompts`: run each distinct prompt once when some repeat (`shared_prompt_response_forward`).
    `length_groups` > 1: rows of similar response length run in up to that many groups, each cut to its longest
    response (`lit_rlhf.models.length_groups`); a group's columns after its width are then 0, not computed.
    """
    use: HeadUse = "hidden" if not head else "read" if reads_head(model, input_ids, attention_mask) else "logits"
    groups = response_groups(attention_mask, response_len, length_groups)
    if share_prompts and can_share_prompts(model, input_ids, response_len):
        prompt_len = input_ids.shape[1] - response_len
        distinct = distinct_prompts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])
        if distinct[0].shape[0] < input_ids.shape[0]:  # some prompt repeats
            return shared_prompt_response_forward(model, input_ids, attention_mask, response_len, distinct, use, groups)
    if groups is None:
        return plain_response_forward(model, input_ids, attention_mask, response_len, use)
    P = input_ids.shape[1] - response_len
    parts = []
    for rows, width in groups:
        mask = attention_mask[rows, : P + width]
        first = int(mask[:, :P].any(0).long().argmax())  # the prompt columns before it are padding in every row
        parts.append(plain_response_forward(model, input_ids[rows, first : P + width], mask[:, first:], width, use))
    return scattered(parts, groups, input_ids.shape[0], response_len)


def response_groups(attention_mask: Tensor, response_len: int, max_groups: int) -> list[tuple[Tensor, int]] | None:
    """`length_groups.length_groups` of the batch's rows, or None where one group as wide as the grid is best."""
    if max_groups <= 1:
        return None
    groups = grouping.length_groups(grouping.response_widths(attention_mask, response_len), max_groups)
    return None if len(groups) == 1 and groups[0][1] == response_len else groups


def scattered(
    parts: list[ResponseForward], groups: list[tuple[Tensor, int]], batch: int, response_len: int
) -> ResponseForward:
    """The groups' outputs back on the batch's (B, T) grid, zeros after each group's width."""
    hidden = grouping.scatter_rows([part.hidden for part in parts], groups, batch, response_len)
    logits = [part.logits for part in parts if part.logits is not None]
    if not logits:
        return ResponseForward(hidden, parts[0].head)
    return ResponseForward(hidden, parts[0].head, grouping.scatter_rows(logits, groups, batch, response_len))


def model_call(model: nn.Module, use: HeadUse, **kwargs: Any) -> tuple[Any, ResponseForward]:
    """`model(**kwargs)` with the head's input caught: its output and (hidden (b, k, H), head, logits (b, k, V) or
    None) over the positions it kept, as `use` asks (`output_head.HeadUse`)."""
    with capture_head_input(model, skip=use != "logits", read=use == "read") as caught:
        out = model(**kwargs)
    if caught.hidden is None:
        raise ConfigError(
            f"model: {type(base_model(model)).__name__}'s forward never called the module its "
            "get_output_embeddings() returns, so its LM head's input cannot be read; lit_rlhf needs a transformers "
            "causal LM (or a model whose get_output_embeddings() is the layer that computes its logits)"
        )
    if use == "logits":
        return out, ResponseForward(caught.hidden, Head(None), out.logits)
    head = caught.head if isinstance(caught.head, Head) else Head(None)  # 'hidden': a critic never uses it
    return out, ResponseForward(caught.hidden, head)


def plain_response_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, use: HeadUse
) -> ResponseForward:
    """`causal_lm_response_forward`'s contract in one forward over every row's prompt and response."""
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    if accepts_argument(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = response_len + 1
    _, caught = model_call(model, use, **kwargs)
    kept = caught.hidden.shape[1] - response_len  # 1 when logits_to_keep worked, P otherwise
    logits = response_positions(caught.logits, kept, response_len) if caught.logits is not None else None
    return ResponseForward(response_positions(caught.hidden, kept, response_len), caught.head, logits)


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
    use: HeadUse = "read",
    groups: list[tuple[Tensor, int]] | None = None,
) -> ResponseForward:
    """`causal_lm_response_forward`'s contract with each distinct prompt run once.

    input_ids, attention_mask (B, P+T) -> hidden (B, T, H); `distinct`: the prompts' `distinct_prompts`. The last
    prompt position predicts response token 0 and response tokens 0..T-2 the rest (the last response token is not
    run). `groups`: (rows, width) of `response_groups`, each run over its own copy of the prompts' cache rows and
    cut to its width; None: all rows at once over the cache itself.
    """
    prefix = PromptPrefix.of(model, distinct, use)
    if groups is not None and not grouping.can_copy_rows(prefix.cache):
        groups = None  # a cache of another kind: one group as wide as the grid (the same outputs, padded)
    if groups is None:
        return responses_after_prompts(model, prefix, input_ids, attention_mask, response_len, None, response_len)
    parts = [
        responses_after_prompts(model, prefix, input_ids, attention_mask, response_len, rows, width)
        for rows, width in groups
    ]
    return scattered(parts, groups, input_ids.shape[0], response_len)


@dataclass
class PromptPrefix:
    """The distinct prompts' forward: their KV cache (U rows), the outputs at their last position (U, 1, ...),
    which predict response token 0, each batch row's prompt, `inverse` (B,), and what the forward needs of the head."""

    cache: Any
    last: ResponseForward
    inverse: Tensor
    use: HeadUse

    @classmethod
    def of(cls, model: nn.Module, distinct: tuple[Tensor, Tensor, Tensor], use: HeadUse) -> PromptPrefix:
        ids, mask, inverse = distinct  # (U, P), (U, P), (B,)
        keep_last = {"logits_to_keep": 1} if accepts_argument(model, "logits_to_keep") else {}
        out, caught = model_call(
            model,
            use,
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
            **keep_last,
        )
        cache = returned_cache(out)
        if cache is None or not callable(getattr(cache, "reorder_cache", None)):
            raise ConfigError(
                f"algorithm.share_prompt_forward: {type(base_model(model)).__name__} returned no transformers KV "
                "cache from the prompt forward, so its prompts cannot be shared; set algorithm.share_prompt_forward: "
                "false"
            )
        logits = caught.logits[:, -1:] if caught.logits is not None else None
        return cls(cache, ResponseForward(caught.hidden[:, -1:], caught.head, logits), inverse, use)


def responses_after_prompts(
    model: nn.Module,
    prefix: PromptPrefix,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    rows: Tensor | None,
    width: int,
) -> ResponseForward:
    """The outputs (b, width, ...) of the batch rows `rows`, cut to `width` of the grid's `response_len` columns.
    None: all rows, over the prompts' cache itself (its rows gathered in place); else over a copy of their rows
    of it."""
    P = input_ids.shape[1] - response_len
    if rows is None:
        prompt_rows = prefix.inverse  # (B,)
        prefix.cache.reorder_cache(prompt_rows)  # (U, ...) -> (B, ...): row i holds its prompt's keys and values
        cache = prefix.cache
    else:
        prompt_rows = prefix.inverse[rows]  # (b,)
        cache = grouping.cache_rows(prefix.cache, prompt_rows)
        input_ids, attention_mask = input_ids[rows], attention_mask[rows]
    first = prefix.last
    hidden = first.hidden.index_select(0, prompt_rows)  # (b, 1, H)
    logits = first.logits.index_select(0, prompt_rows) if first.logits is not None else None  # (b, 1, V)
    if width == 1:
        return ResponseForward(hidden, first.head, logits)
    _, rest = model_call(
        model,
        prefix.use,
        input_ids=input_ids[:, P : P + width - 1],  # (b, width-1)
        attention_mask=attention_mask[:, : P + width - 1],
        position_ids=position_ids_from_mask(attention_mask[:, : P + width - 1])[:, P:],
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    hidden = torch.cat([hidden, rest.hidden], dim=1)  # (b, width, H)
    if logits is not None and rest.logits is not None:
        logits = torch.cat([logits, rest.logits], dim=1)  # (b, width, V)
    return ResponseForward(hidden, first.head, logits)
