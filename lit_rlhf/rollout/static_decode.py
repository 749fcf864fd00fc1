"""The decode steps of `lit_rlhf.rollout.sampler.sample` over a static KV cache, optionally `torch.compile`d
(`sampling.backend: compiled`).

The default loop's cache grows by one column per step, so every step has new shapes. Here the cache is a
transformers `StaticCache` of a fixed length L (prompt width + max_new_tokens rounded up to a multiple of
`BUCKET`), the attention mask is the whole (B, L) mask at every step and the position ids are (B, 1): every
decode step has the same shapes, so `torch.compile(dynamic=False)` captures it once per (batch size, L) and, on
CUDA with `mode="reduce-overhead"`, as a CUDA graph (the cache's tensors keep their addresses). The columns after
the current one are hidden by the causal mask, so a step computes what the default loop's step computes.

The prefill stays eager and is the default loop's own (its shape changes with every batch): its dynamic cache is
copied into the static one, each row repeated `group_size` times (shared prefill). The static cache of the last
(batch size, L) is kept with the model between calls, so that CUDA graphs see the same addresses (a new cache
would make them re-record every call); it is dropped when the shape changes or the model is freed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models.forward import base_model

BUCKET = 64
"""The static cache's length is a multiple of this, so prompt widths within one bucket share a compiled step."""
MAX_COMPILED_SHAPES = 64
"""Compiled decode steps (one per model, batch size and cache length) before a clear error (dynamo's own limit,
`torch._dynamo.config.recompile_limit`, would silently run the step eagerly from its 9th shape on)."""

_CACHES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def static_cache_length(prompt_width: int, max_new_tokens: int, bucket: int = BUCKET) -> int:
    """P + max_new_tokens rounded up to a multiple of `bucket`."""
    return -(-(prompt_width + max_new_tokens) // bucket) * bucket


def check_static_cache_support(model: nn.Module) -> None:
    """Raise a `ConfigError` naming `sampling.backend` unless `model` (or the model a peft wrapper holds) is a
    transformers model that declares it runs with a static cache under `torch.compile`."""
    base = base_model(model)
    if not getattr(base, "_can_compile_fullgraph", False) or getattr(base, "config", None) is None:
        raise ConfigError(
            f"sampling.backend 'compiled': {type(base).__name__} does not declare support for a static KV "
            "cache under torch.compile (transformers' `_can_compile_fullgraph`); set sampling.backend: lean"
        )


def _decode_step(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    cache: Any,
    cache_key: str,
    keep_last: dict[str, int],
) -> Tensor:
    """One decode forward: input_ids, position_ids (B, 1), attention_mask (B, L) -> last logits (B, V)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **keep_last,
        **{cache_key: cache},
    )
    return out.logits[:, -1]


@functools.cache
def _compiled_step(mode: str | None) -> Callable[..., Tensor]:
    """`_decode_step` compiled for fixed shapes: one callable per mode, one graph per shape (dynamo's cache)."""
    return torch.compile(_decode_step, dynamic=False, mode=mode)


def _static_cache(model: nn.Module, batch: int, length: int, like: Tensor) -> Any:
    """A zeroed `StaticCache` of (batch, length), the one kept with `model` when its shape, dtype and device match."""
    from transformers import StaticCache

    key = (batch, length, like.dtype, like.device)
    held = _CACHES.get(model)
    if held is not None and held[0] == key:
        held[1].reset()
        return held[1]
    _CACHES.pop(model, None)  # free the old buffers before allocating new ones
    cache = StaticCache(config=base_model(model).config, max_cache_len=length)
    _CACHES[model] = (key, cache)
    return cache


class StaticDecoder:
    """Decode steps over a static cache filled from the default loop's prefill cache.

    model: the policy; prefill_cache: the prefill's transformers `Cache`, B0 rows of P columns; attention_mask
    (B, P): the prompts' mask, B = B0 * G, each prefill row repeated G times; next_position (B, 1): the first
    generated token's position id; compile: run the step through `torch.compile`.
    """

    def __init__(
        self,
        model: nn.Module,
        prefill_cache: Any,
        attention_mask: Tensor,
        next_position: Tensor,
        max_new_tokens: int,
        cache_key: str,
        keep_last: dict[str, int],
        compile: bool,
    ) -> None:
        check_static_cache_support(model)
        B, P = attention_mask.shape
        layers = getattr(prefill_cache, "layers", None)
        if not layers or any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ConfigError(
                f"sampling.backend 'compiled': the prefill returned a {type(prefill_cache).__name__} cache "
                "that is not a transformers Cache of full-attention layers (sliding-window attention cannot be "
                "copied into a static cache); set sampling.backend: lean"
            )
        length = static_cache_length(P, max_new_tokens)
        repeats = B // layers[0].keys.shape[0]
        self.cache = _static_cache(model, B, length, layers[0].keys)
        for index, layer in enumerate(layers):
            keys, values = layer.keys, layer.values  # (B0, heads, P, head_dim)
            if keys.shape[-2] != P:
                raise ConfigError(
                    f"sampling.backend 'compiled': layer {index} of the prefill cache holds "
                    f"{keys.shape[-2]} positions for a {P}-token prompt, so it cannot be copied into a static "
                    "cache; set sampling.backend: lean"
                )
            self.cache.update(keys.repeat_interleave(repeats, 0), values.repeat_interleave(repeats, 0), index)
        self.model = model
        self.mask = torch.ones(B, length, dtype=attention_mask.dtype, device=attention_mask.device)  # (B, L)
        self.mask[:, :P] = attention_mask
        self.next_position = next_position
        self.cache_key = cache_key
        self.keep_last = keep_last
        self.cuda = attention_mask.device.type == "cuda"
        self.step_fn = _compiled_step("reduce-overhead" if self.cuda else None) if compile else _decode_step
        self.compile = compile

    def step(self, next_tokens: Tensor, t: int) -> Tensor:
        """The tokens drawn at step t, (B,) -> the logits for step t + 1, (B, V)."""
        positions = self.next_position + t  # (B, 1), a new tensor of the same shape every step
        args = (self.model, next_tokens[:, None], self.mask, positions, self.cache, self.cache_key, self.keep_last)
        if not self.compile:
            return self.step_fn(*args)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits have been consumed
        try:
            with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES, fail_on_recompile_limit_hit=True):
                return self.step_fn(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            raise RuntimeError(
                f"sampling.backend 'compiled': the decode step has been compiled for {MAX_COMPILED_SHAPES} "
                "(model, batch size, cache length) shapes in this process; keep the batch size fixed, or set "
                "sampling.backend: lean"
            ) from error
