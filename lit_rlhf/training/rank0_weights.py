"""Under FSDP2 only rank 0 reads the policy's (and a named reference's) weights. The other ranks build the same
model on the meta device from rank 0's class, config and dtype (no memory, no file reads), and after `fully_shard`
each rank receives its own shard from rank 0 (`set_model_state_dict(..., broadcast_from_rank0=True)`). This is
what accelerate calls CPU-RAM-efficient loading: a node with N ranks holds one full copy while loading, not N.

Everything the ranks must agree on comes from rank 0: the weights, the adapters' and value head's random
initialisation, and the non-persistent buffers (rotary tables) that no state dict carries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models.loading import load_causal_lm
from lit_rlhf.models.lora import has_adapters


class Rank0Loader:
    """`load_causal_lm` for every rank of `strategy`: rank 0 loads; the others get a meta-device skeleton of rank
    0's model, unless rank 0's model cannot be rebuilt from its config (a peft model), when they load it too. When
    rank 0 cannot load it, every rank raises (rank 0 its own error, the others a `ConfigError` quoting it)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def __call__(self, spec: Any, field: str, trust_remote_code: bool = False) -> nn.Module:
        if self.strategy.global_rank == 0:
            try:
                model = load_causal_lm(spec, field, trust_remote_code)
            except Exception as err:  # the other ranks wait for the recipe: tell them, so every rank stops
                self.strategy.broadcast((None, f"{type(err).__name__}: {err}"), src=0)
                raise
            self.strategy.broadcast((skeleton_recipe(model), None), src=0)
            return model
        recipe, error = self.strategy.broadcast(None, src=0)
        if error is not None:
            raise ConfigError(f"{field}: rank 0 could not load {spec!r} ({error})")
        if recipe is None:
            return load_causal_lm(spec, field, trust_remote_code)
        model_class, config, dtype, generation_config = recipe
        with torch.device("meta"):
            skeleton = model_class._from_config(config, dtype=dtype)
        skeleton.generation_config = generation_config
        return skeleton


def skeleton_recipe(model: Any) -> tuple[type, Any, torch.dtype, Any] | None:
    """What another rank needs to build `model` without its weights: (class, config, dtype, generation config);
    None for a model not built from its config alone (a peft model)."""
    if has_adapters(model) or not hasattr(type(model), "_from_config"):
        return None
    return type(model), model.config, model.dtype, getattr(model, "generation_config", None)


def full_weights(roots: dict[str, nn.Module], rank: int) -> dict[str, dict[str, Any]]:
    """Rank 0: each root's full state dict, taken before `fully_shard` (it keeps the full tensors alive until
    they are sent); other ranks: nothing."""
    return {name: dict(root.state_dict()) for name, root in roots.items()} if rank == 0 else {}


def non_persistent_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers left out of the state dict (e.g. rotary `inv_freq`): `set_model_state_dict` does not send them."""
    saved = set(root.state_dict())
    return {name: buffer.cpu() for name, buffer in root.named_buffers() if name not in saved}


def send_rank0_weights(
    roots: dict[str, nn.Module], full: dict[str, dict[str, Any]], strategy: Any, device: torch.device
) -> None:
    """After `fully_shard`: every other rank allocates its (meta or not) tensors on `device` and receives rank 0's
    values, each rank keeping its shard of a sharded parameter; the non-persistent buffers come from rank 0 too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    rank = strategy.global_rank
    for name, root in roots.items():
        if rank != 0:
            root.to_empty(device=device)
        buffers = strategy.broadcast(non_persistent_buffers(root) if rank == 0 else None, src=0)
        set_model_state_dict(root, full.get(name, {}), options=options)
        if rank != 0:
            with torch.no_grad():
                for key, value in buffers.items():
                    root.get_buffer(key).copy_(value)
