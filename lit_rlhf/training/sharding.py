"""FSDP2 through Lightning's `ModelParallelStrategy`: `fully_shard` on the policy's transformer blocks and root,
the value head as its own unit, and the frozen models sharded too (`SHARD_FROZEN`, else replicated);
generation with the policy unsharded once per rollout (`unsharded_for_rollout`), not gathered per decoding step.

Runs on CPU processes with gloo (Lightning 2.6: `ModelParallelStrategy(data_parallel_size=N,
tensor_parallel_size=1, process_group_backend="gloo")` with `accelerator="cpu"`) and on GPUs with NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lit_rlhf.config import ConfigError
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO
from lit_rlhf.training.host_memory import return_freed_memory
from lit_rlhf.training.rank0_weights import full_weights, send_rank0_weights


def is_fsdp2(trainer: Any) -> bool:
    return trainer is not None and type(trainer.strategy).__name__ == "ModelParallelStrategy"


def longest_module_list(model: nn.Module) -> nn.ModuleList | None:
    """The longest `nn.ModuleList` in `model` (the first of equal lengths): its repeated blocks (`model.layers`,
    `transformer.h`, ...); None when it has none."""
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (`longest_module_list`), or a `ConfigError` when it has none."""
    blocks = longest_module_list(model)
    if blocks is None:
        raise ConfigError(
            f"trainer.strategy: ModelParallelStrategy shards a model block by block, but {type(model).__name__} "
            "has no nn.ModuleList of blocks; use strategy: ddp"
        )
    return list(blocks)


def shard_model(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def check_checkpoint_writer(strategy: Any) -> None:
    """`AtomicCheckpointIO` with distributed checkpoints is refused: Lightning writes those folders itself, in
    place, so the plugin would be ignored and a kill while `last.ckpt` is rewritten could leave it partial."""
    if getattr(strategy, "_save_distributed_checkpoint", False) and isinstance(
        strategy.checkpoint_io, AtomicCheckpointIO
    ):
        raise ConfigError(
            "trainer.plugins: AtomicCheckpointIO cannot write ModelParallelStrategy's distributed checkpoints "
            "(Lightning writes each folder in place, so a kill while last.ckpt is rewritten can leave it partial); "
            "set the strategy's save_distributed_checkpoint: false (full checkpoints gathered on rank 0 and written "
            "atomically by AtomicCheckpointIO), or remove the plugin to accept folders written in place"
        )


def check_fsdp2_settings(module: Any, shard_frozen: bool) -> None:
    """Refuse, before any model loads, what FSDP2 cannot run here: tensor parallelism, `AtomicCheckpointIO` with
    distributed checkpoints, and a sharded reward model scored on `overlap_scoring`'s background thread (its
    gathers would interleave with the training thread's collectives in a different order on each rank)."""
    if module.device_mesh.ndim > 1 and module.device_mesh["tensor_parallel"].size() > 1:
        raise ConfigError(
            "trainer.strategy: ModelParallelStrategy with tensor_parallel_size > 1 is not supported; set "
            "tensor_parallel_size: 1 (FSDP2 over all devices)"
        )
    check_checkpoint_writer(module.trainer.strategy)
    if module.hparams.get("overlap_scoring") and module.specs.reward_model is not None and shard_frozen:
        raise ConfigError(
            "model.overlap_scoring: true scores on a background thread, and under ModelParallelStrategy the reward "
            f"model ({module.specs.reward_model!r}) is sharded, so its gathers would run beside the training "
            "thread's collectives; set model.overlap_scoring: false, or keep the reward model whole on every rank "
            "(module.shard_frozen = False before the fit)"
        )


def shard_module_models(module: Any, shard_frozen: bool) -> None:
    """`fully_shard` the policy (blocks, then root), a separate critic the same way, the value head as its own
    unit, and the frozen reference and reward model when `shard_frozen` (else each rank keeps a full copy). The
    actor-critic itself is not a unit: sampling runs the policy alone, and FSDP2 wants a unit's first forward to
    come through its root. A LoRA policy (a peft model) is sharded the same way: each block's unit holds its frozen
    weights and its adapters, and the adapter-disabled reference runs the sharded policy. The forwards then run
    one group of rows (`algorithm.length_groups` becomes 1): every rank must call a sharded model as many times,
    and the groups of each rank's response lengths differ."""
    mesh = module.device_mesh["data_parallel"] if "data_parallel" in module.device_mesh.mesh_dim_names else None
    actor_critic = module.actor_critic
    actor_critic.length_groups = 1
    shard_model(actor_critic.policy, mesh)  # a root of its own: sampling calls the policy, not the actor-critic
    if actor_critic.critic_backbone is not None:
        shard_model(actor_critic.critic_backbone, mesh)
    if actor_critic.value_head is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(actor_critic.value_head, mesh=mesh)
    for frozen in (module.reference, module.reward_model):
        if frozen is not None and shard_frozen and any(True for _ in frozen.parameters()):
            shard_model(frozen, mesh)


def shard_loaded_models(module: Any, strategy: Any) -> None:
    """`shard_module_models` on models rank 0 alone has loaded (`Rank0Loader`): rank 0 takes the full weights of
    the actor-critic and a reference with parameters first, then every rank gets its shard of them."""
    roots = {"actor_critic": module.actor_critic}
    if module.reference is not None and any(True for _ in module.reference.parameters()):
        roots["reference"] = module.reference
    full = full_weights(roots, strategy.global_rank)
    shard_module_models(module, getattr(module, "shard_frozen", True))
    send_rank0_weights(roots, full, strategy, strategy.root_device)


@contextlib.contextmanager
def unsharded_for_rollout(model: nn.Module) -> Iterator[None]:
    """Gather every FSDP2 unit of `model` once and keep it gathered until the block ends (sampling's many small
    forwards would otherwise all-gather and free each block at every decoding step); reshard after, and give each
    unit back FSDP2's own setting: a root unit stays gathered after its forward (the LM head's weight, which the
    chunked log-probs read after the forward and in backward), the others reshard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2: nothing can be sharded
        units = {}
    else:
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    for unit in units.values():
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for name, unit in units.items():
            unit.reshard()
            root = not any(name.startswith(other + ".") for other in units if other != name)
            unit.set_reshard_after_forward(not root, recurse=False)
        if units and all(p.device.type == "cpu" for p in model.parameters()):
            return_freed_memory()


def reshard_frozen(model: nn.Module | None) -> None:
    """Reshard a frozen FSDP2 root after its forward. FSDP2 leaves a root unit gathered after its forward because
    its backward would gather it again at once; a frozen model (reference, reward model) has no backward, so its
    root (embeddings, final norm, head) would stay whole until the end of the fit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    if isinstance(model, FSDPModule):
        model.reshard()
