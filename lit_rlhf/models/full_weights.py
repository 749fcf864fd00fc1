"""A plain (unsharded) copy of an FSDP2-sharded Hugging Face model, gathered onto global rank 0 for export.

`fully_shard` turns each parameter into a `DTensor` shard and the module's class into `FSDP<Class>`; neither can
be written by `save_pretrained` as a folder that plain transformers loads. `gathered_copy` all-gathers the full
state dict (`torch.distributed.checkpoint.state_dict.get_model_state_dict` with `full_state_dict` and
`cpu_offload`: the full tensors land in CPU memory of rank 0 only, one at a time) and loads it into a model of the
original class built on the meta device (a peft model: its base model's class with the same adapters), so rank 0
holds the weights once more, on CPU, and the other ranks hold nothing extra. It is a collective: every rank must
call it.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models.lora import has_adapters


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a `DTensor` (FSDP2 / `ModelParallelStrategy`)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def unsharded_class(model: nn.Module) -> type:
    """The class `fully_shard` derived `FSDP<Class>` from (the class itself for an unsharded model)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def meta_skeleton(model: nn.Module) -> nn.Module:
    """An unsharded model like `model` on the meta device: its original class and config; for a peft model, the
    base model's skeleton with the same adapters (names, settings and active one)."""
    if not has_adapters(model):
        with torch.device("meta"):
            return unsharded_class(model)(copy.deepcopy(model.config))
    base = meta_skeleton(model.get_base_model())  # type: ignore[operator]  # peft method
    configs = copy.deepcopy(cast(dict[str, Any], model.peft_config))
    first, *others = configs
    with torch.device("meta"):  # the peft class itself: get_peft_model would rename the adapters' base model
        plain = unsharded_class(model)(base, configs[first], first, low_cpu_mem_usage=True)
        for name in others:
            plain.add_adapter(name, configs[name], low_cpu_mem_usage=True)
    if others:
        plain.set_adapter(model.active_adapter)
    return plain


def gathered_copy(model: nn.Module) -> nn.Module | None:
    """On global rank 0, a plain CPU copy of the sharded Hugging Face `model` (same class, config, weights and
    buffers; tied weights tied again); None on the other ranks. Every rank must call it (it all-gathers)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # full tensors on rank 0, {} elsewhere
    if dist.get_rank() != 0:
        return None
    plain = meta_skeleton(model)
    plain.load_state_dict(state, assign=True)
    for name, buffer in model.named_buffers():  # never sharded; the non-persistent ones are not in `state`
        if plain.get_buffer(name).is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(plain.get_submodule(owner), leaf, buffer.detach().to("cpu", copy=True))
    plain.tie_weights()  # type: ignore[operator]  # transformers (or peft) method
    left = [name for name, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"save_policy: gathering the sharded policy left {left[:5]} unset; export from a checkpoint")
    return plain.eval()
