"""The one forward that training, evaluation and the reference share: logits (and the last hidden state) on the
(B, T) response grid only, plain or with each distinct prompt run once (`algorithm.share_prompt_forward`).

Shared prompts: a GRPO rollout holds every prompt `group_size` times, so the plain forward runs each prompt's
tokens through the model G times, forward and backward; with a chat template and a system prompt they are most
of the tokens. The shared forward runs the distinct prompts once (one row each, their KV cache kept with its
autograd history), gathers the cache rows back to the batch's rows (`index_select`: its backward sums the G
rows' gradients into the one prompt row) and runs the responses over that cache. Every valid token sees the same
keys, values and positions as in the plain forward, so logits and gradients agree up to float rounding. This is
the shared-prefix forward of Prefix Grouper (Liu et al. 2025, https://arxiv.org/abs/2506.05433).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.config import ConfigError


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
) -> tuple[Tensor, Tensor | None]:
    """Logits predicting the last `response_len` tokens, and optionally the last hidden state there.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V) in the model's dtype, hidden (B, T, H) or None.
    Only the T+1 last positions go through the LM head when the model supports `logits_to_keep`.
    `share_prompts`: run each distinct prompt once when some repeat (`shared_prompt_response_forward`).
    """
    if share_prompts and can_share_prompts(model, input_ids, response_len):
        prompt_len = input_ids.shape[1] - response_len
        distinct = distinct_prompts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])
        if distinct[0].shape[0] < input_ids.shape[0]:  # some prompt repeats
            return shared_prompt_response_forward(model, input_ids, attention_mask, response_len, distinct, want_hidden)
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
) -> tuple[Tensor, Tensor | None]:
    """`causal_lm_response_forward`'s contract with each distinct prompt run once.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V), hidden (B, T, H) or None; `distinct`: the prompts'
    `distinct_prompts`. The last prompt position predicts response token 0 and response tokens 0..T-2 the rest
    (the last response token is not run).
    """
    S, T = input_ids.shape[1], response_len
    P = S - T
    ids, mask, inverse = distinct  # (U, P), (U, P), (B,)
    keep_last = {"logits_to_keep": 1} if accepts_argument(model, "logits_to_keep") else {}
    prefix = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        output_hidden_states=want_hidden,
        **keep_last,
    )
    cache = returned_cache(prefix)
    if cache is None or not callable(getattr(cache, "reorder_cache", None)):
        raise ConfigError(
            f"algorithm.share_prompt_forward: {type(base_model(model)).__name__} returned no transformers KV cache "
            "from the prompt forward, so its prompts cannot be shared; set algorithm.share_prompt_forward: false"
        )
    cache.reorder_cache(inverse)  # (U, ...) -> (B, ...): row i holds its prompt's keys and values
    logits = prefix.logits[:, -1:].index_select(0, inverse)  # (B, 1, V)
    hidden = prefix.hidden_states[-1][:, -1:].index_select(0, inverse) if want_hidden else None  # (B, 1, H)
    if T == 1:
        return logits, hidden
    out = model(
        input_ids=input_ids[:, P : S - 1],  # (B, T-1)
        attention_mask=attention_mask[:, : S - 1],
        position_ids=position_ids_from_mask(attention_mask[:, : S - 1])[:, P:],
        use_cache=True,
        output_hidden_states=want_hidden,
        **{cache_keyword(model): cache},
    )
    logits = torch.cat([logits, out.logits], dim=1)  # (B, T, V)
    if hidden is not None:
        hidden = torch.cat([hidden, out.hidden_states[-1]], dim=1)  # (B, T, H)
    return logits, hidden
