"""A model's LM head as a `chunked_logprobs.Head`, and its input caught during a forward so the head never runs on it.

`capture_head_input(model)` hooks the module `get_output_embeddings()` returns for the length of one forward: it
keeps the head's input (the final hidden states the head would turn into logits) and, with `skip`, hands the head
an empty slice of it instead, so the forward builds no logits at all; the hidden states then go to
`chunked_logprobs.head_stats` with the head read off the module at that moment (`read_head`), adapters and all.
Hooking the head itself, rather than calling the decoder body, keeps everything the model's forward does around
it (FSDP2's gathering of the root unit, peft's adapter switches, a scaling of the hidden states before the head).

What the head does after its matmul is read from the model's config (Gemma's `final_logit_softcapping`, Cohere's
`logit_scale`, Granite's `logits_scaling`). A head this module cannot read (another module type, another forward
hook, LoRA with dropout or a variant such as DoRA on the head), or whose logits `check_head` finds differ from the
model's own, keeps the model's own logits instead, with a warning naming why: the same results, with memory that
grows with the vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.chunked_logprobs import Head
from lit_rlhf.models.vocabulary import PaddedVocabularyMask

CHECK_TOKENS = 16
"""Tokens of the first row of a model's first forward that `check_head` compares the two logits on."""
CHECK_TOLERANCE = 2e-2
"""How far the head's logits may be from the model's own, relative to their largest magnitude (bf16 rounding is
about 4e-3 of it; a missed scale or soft-cap is a large share)."""


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model itself: the one a wrapper that passes its **kwargs on holds (a peft model, the
    adapter-disabled reference: `get_base_model`), else `model`."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def output_module(model: nn.Module) -> nn.Module | None:
    """The module that computes the logits: `get_output_embeddings()` of the transformers model (peft-wrapped and
    adapter-disabled models included), or None."""
    get_head = getattr(base_model(model), "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return head if isinstance(head, nn.Module) else None


def logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """(scale, soft-cap) the model applies to its head's output, from its (text) config."""
    config = getattr(base_model(model), "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    config = get_text_config() if callable(get_text_config) else config
    scale = 1.0
    if isinstance(getattr(config, "logit_scale", None), (int, float)):  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)  # type: ignore[union-attr]
    if isinstance(getattr(config, "logits_scaling", None), (int, float)):  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)  # type: ignore[union-attr]
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, float(softcap) if isinstance(softcap, (int, float)) else None


def read_head(module: nn.Module, scale: float = 1.0, softcap: float | None = None) -> Head | str:
    """The head `module` computes now, as a `Head` (its weight differentiable: LoRA's product is formed here), or
    the reason it cannot be read."""
    vocab: int | None = None
    while True:
        for hook in module._forward_hooks.values():
            if isinstance(hook, PaddedVocabularyMask):
                vocab = hook.vocab_size if vocab is None else min(vocab, hook.vocab_size)
            else:
                return f"a forward hook on the LM head ({type(hook).__name__}) may change its logits"
        inner = _unwrapped(module)
        if inner is None:
            break
        module = inner
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return Head(module.weight, module.bias, vocab, scale, softcap)
    lora = _lora_head(module)
    if isinstance(lora, str):
        return lora
    weight, bias = lora
    return Head(weight, bias, vocab, scale, softcap)


def _unwrapped(module: nn.Module) -> nn.Module | None:
    """What a peft `ModulesToSaveWrapper` runs now (its trained copy, or the original with adapters off), a LoRA
    layer's base layer when the adapters are off or merged; None for any other module."""
    copies: Any = getattr(module, "modules_to_save", None)
    if hasattr(module, "original_module") and isinstance(copies, nn.ModuleDict):
        active = list(getattr(module, "active_adapters", []))
        if module.disable_adapters or not active or any(a not in copies for a in active):
            return module.original_module  # type: ignore[return-value]
        return copies[active[0]]
    lora_off = hasattr(module, "lora_A") and (module.disable_adapters or module.merged)
    return module.base_layer if lora_off else None  # type: ignore[return-value]


def _lora_head(module: nn.Module) -> tuple[Tensor, Tensor | None] | str:
    """A peft LoRA layer with its adapters on: its base weight plus each active adapter's scaled B A."""
    base = getattr(module, "base_layer", None)
    if not hasattr(module, "lora_A") or not isinstance(base, nn.Linear) or type(base).forward is not nn.Linear.forward:
        return f"the LM head is a {type(module).__name__}, not a linear layer"
    weight = base.weight
    for adapter in module.active_adapters:  # type: ignore[union-attr]
        if adapter not in module.lora_A:  # type: ignore[operator]
            continue
        if adapter in getattr(module, "lora_variant", {}):
            return f"the LM head's LoRA adapter {adapter!r} is a variant (e.g. DoRA), not a plain B A product"
        dropout = module.lora_dropout[adapter]  # type: ignore[index]
        if module.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            return f"the LM head's LoRA adapter {adapter!r} has dropout {dropout.p}"
        if getattr(module.lora_B[adapter], "bias", None) is not None:  # type: ignore[index]
            return f"the LM head's LoRA adapter {adapter!r} has a bias"
        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)  # type: ignore[operator]
    return weight, base.bias


@dataclass
class HeadInput:
    """What `capture_head_input` caught: the head's input (b, k, H), and the head at that moment (or why it
    cannot be read, or None when not read)."""

    hidden: Tensor | None = None
    head: Head | str | None = None


HeadUse = Literal["read", "logits", "hidden"]
"""What a forward needs of the LM head: 'read': its input and the head read off it, the head skipped (the chunked
log-probs); 'logits': the model's own logits (and the input, for a value head); 'hidden': its input only (a
critic's backbone), the head skipped and not read."""


@contextlib.contextmanager
def capture_head_input(model: nn.Module, skip: bool, read: bool = True) -> Iterator[HeadInput]:
    """For the forwards inside the block, keep the LM head's input and, with `read`, the head (the last call's);
    with `skip`, the head runs on an empty slice of its input (no logits are built). A model without a head module
    yields an empty `HeadInput`."""
    caught = HeadInput()
    module = output_module(model)
    if module is None:
        yield caught
        return
    scale, softcap = logit_transform(model)
    sharded = read and is_sharded(model)

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs["input"]
        head = read_head(module, scale, softcap) if read else None
        if sharded and isinstance(head, Head):
            head = kept_after_reshard(head)
        caught.hidden, caught.head = hidden, head
        if not skip:
            return None
        empty = hidden[..., :0, :]  # (b, 0, H): the head builds no logits
        return ((empty, *args[1:]), kwargs) if args else (args, {**kwargs, "input": empty})

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield caught
    finally:
        handle.remove()


def is_sharded(model: nn.Module) -> bool:
    """Whether the model (the one a peft wrapper or the adapter-disabled reference holds) has FSDP2 units."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in base_model(model).modules())


def kept_after_reshard(head: Head) -> Head:
    """An FSDP2-gathered head whose frozen weight is read after the forward: a copy of it, since FSDP2 (or peft
    leaving `disable_adapter`) may free the gathered storage first. A trainable head is used as it is: its root unit
    stays gathered from the forward through the backward (`training.sharding.unsharded_for_rollout`)."""
    if head.weight is None or head.weight.requires_grad:
        return head
    bias = head.bias.detach().clone() if head.bias is not None else None
    return dataclasses.replace(head, weight=head.weight.detach().clone(), bias=bias)


_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def reads_head(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> bool:
    """Whether the forwards of `model` can skip its LM head and compute from its input (`read_head`), checked once
    per model on its first forward (`check_head`) and remembered; a model whose head cannot be read gets a warning
    naming why, once."""
    known = _CHECKED.get(model)
    if known is None:
        reason = check_head(model, input_ids, attention_mask)
        known = _CHECKED[model] = reason is None
        if reason is not None:
            warnings.warn(
                f"{type(model).__name__}: {reason}, so its forwards keep the model's own logits (memory grows with "
                "the vocabulary; lit_rlhf/models/output_head.py)",
                stacklevel=3,
            )
    return known


@torch.no_grad()
def check_head(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> str | None:
    """None when the logits `read_head` gives from the caught input equal the model's own on the last
    `CHECK_TOKENS` attended tokens of the first row of a batch (input_ids, attention_mask (B, S)), else why not."""
    columns = attention_mask[0].nonzero().squeeze(1)[-CHECK_TOKENS:]
    if columns.numel() == 0:
        columns = torch.arange(min(CHECK_TOKENS, input_ids.shape[1]), device=input_ids.device)
    ids = input_ids[:1, columns]  # (1, k): no padding, so the default positions 0..k-1
    with capture_head_input(model, skip=False) as caught:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    if caught.hidden is None or not isinstance(caught.head, (Head, str)):
        return "its LM head (get_output_embeddings) was not called by its forward"
    if isinstance(caught.head, str):
        return caught.head
    theirs = out.logits.float()[0]  # (k, V)
    hidden = caught.hidden.reshape(-1, caught.hidden.shape[-1])[-theirs.shape[0] :]
    width = caught.head.width(hidden)
    ours = caught.head.logits(caught.head.raw_logits(hidden, 0, width, caught.head.compute_dtype(hidden)), 1.0)
    theirs = theirs[:, :width]
    finite = torch.isfinite(theirs)
    error = float((ours.float() - theirs).abs()[finite].max()) if finite.any() else math.inf
    size = float(theirs[finite].abs().max()) if finite.any() else 0.0
    if not error <= CHECK_TOLERANCE * max(size, 1e-6):
        return (
            f"its logits are not the LM head's ({type(output_module(model)).__name__}) output on its input as read "
            f"(largest difference {error:.3g} against logits up to {size:.3g}: a transformation after the head)"
        )
    return None
