"""What a vLLM weight sync sends: a LoRA policy's adapters alone where vLLM can serve them (a small adapter folder
per policy version), otherwise the full weights, taken straight from the policy's tensors and written, where they
must be written, in bounded shards.

vLLM 0.32 loads a LoRA adapter only from a folder (`LoRARequest.lora_path` must be set; the worker reads
`adapter_config.json` and `adapter_model.safetensors`), so each policy version's adapters are written to a scratch
folder in shared memory (`/dev/shm` where it exists) and named `policy-v<n>`: a request names the version it
samples, so none samples a mix. vLLM serves adapters on linear layers only; `adapter_refusal` says why a policy's
adapters cannot be served (the backends then send merged full weights and log the reason).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor, nn

from lit_rlhf.models.export import plain_policy
from lit_rlhf.models.lora import has_adapters

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`)."""
VLLM_LORA_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""The string `init_lora_weights` vLLM 0.32 serves (the others change the base weights when peft loads them)."""
SHARD_BYTES = 256 * 2**20
"""Largest safetensors shard written for a full-weights push: what serialising costs beyond the policy itself."""


def shared_memory_folder(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in shared memory (`/dev/shm`) where this machine has one, else in the temporary folder."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix=prefix, dir=where)


def _lora_config(plain: nn.Module) -> Any:
    return plain.peft_config[plain.active_adapter]  # type: ignore[index]  # peft attributes


def adapter_refusal(policy: nn.Module) -> str | None:
    """Why vLLM 0.32 cannot serve the LoRA adapters of `policy` as adapters, or None when it can."""
    plain = plain_policy(policy)
    config = _lora_config(plain)
    if getattr(config, "modules_to_save", None):
        return f"modules_to_save {sorted(config.modules_to_save)} (vLLM serves adapters on linear layers only)"
    features = {
        "use_dora": "DoRA (use_dora)",
        "lora_bias": "LoRA bias (lora_bias)",
        "layer_replication": "layer_replication",
        "use_qalora": "QALoRA",
        "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D layers)",
    }
    for field, feature in features.items():
        if getattr(config, field, None):
            return f"{feature} is not served by vLLM"
    if getattr(config, "bias", "none") != "none":
        return f"bias={config.bias!r} (vLLM serves adapters without bias)"
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in VLLM_LORA_INITS:
        return f"init_lora_weights={init!r} changes the base weights"
    if lora_rank(plain) > VLLM_LORA_RANKS[-1]:
        return f"rank {lora_rank(plain)} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
    from peft.tuners.lora import LoraLayer

    head = plain.get_output_embeddings()  # type: ignore[operator]
    for name, module in plain.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if head is module or head is base:
                return f"target module {name!r} is the output layer"
            if type(base) is not nn.Linear:
                return f"target module {name!r} is a {type(base).__name__}, not a linear layer"
    return None


def lora_rank(policy: nn.Module) -> int:
    """The largest rank of the policy's adapters (`r`, or a larger one in `rank_pattern`)."""
    config = _lora_config(plain_policy(policy))
    return max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])


def vllm_max_lora_rank(policy: nn.Module) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds the policy's adapters."""
    rank = lora_rank(policy)
    return next(allowed for allowed in VLLM_LORA_RANKS if allowed >= rank)


def serves_adapters(policy: nn.Module, wanted: bool) -> tuple[bool, str | None]:
    """(send adapters, why not): adapters when the policy has them, `wanted` (`sampling.vllm.lora_adapters`) and
    vLLM can serve them; the reason is None when there is nothing to explain (no adapters, or adapters sent)."""
    if not has_adapters(plain_policy(policy)):
        return False, None
    if not wanted:
        return False, "sampling.vllm.lora_adapters is false"
    reason = adapter_refusal(policy)
    return reason is None, reason


def base_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The frozen base weights under a LoRA policy, under the names of its Hugging Face checkpoint (tied names
    included): views of the policy's own tensors, no copy."""
    base = plain_policy(policy).get_base_model()  # type: ignore[operator]  # peft method
    for name, tensor in base.state_dict().items():
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), tensor.detach()


def adapter_tensors(policy: nn.Module) -> dict[str, Tensor]:
    """The active adapter's LoRA matrices under the names peft saves them with
    (`base_model.model.<module>.lora_A.weight`), on the CPU and contiguous (a copy only of what lives elsewhere)."""
    plain = plain_policy(policy)
    tensors = {}
    for name, parameter in plain.named_parameters():
        *module, matrix, adapter, kind = name.split(".")
        if matrix in ("lora_A", "lora_B") and adapter == plain.active_adapter:
            tensors[".".join([*module, matrix, kind])] = parameter.detach().to("cpu").contiguous()
    return tensors


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    return value if isinstance(value, (str, int, float, bool, list)) or value is None else str(value)


def write_adapter(policy: nn.Module, folder: str) -> int:
    """Write the policy's active adapter as a peft adapter folder (adapter_config.json, adapter_model.safetensors);
    returns the bytes of the tensors written."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = adapter_tensors(policy)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = _lora_config(plain_policy(policy)).to_dict()
    with open(os.path.join(folder, "adapter_config.json"), "w") as file:
        json.dump(_jsonable(config), file)
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


class AdapterVersions:
    """The adapter folders of successive policy versions in one scratch folder: version n is `<root>/v<n>`, served
    under the name `policy-v<n>` and the LoRA id n; a version's folder is removed once a newer one is loaded."""

    def __init__(self, root: str) -> None:
        self.root, self.version = root, 0

    def write(self, policy: nn.Module) -> tuple[str, int, str, int]:
        """Write the next version: (its name, its id, its folder, the bytes written)."""
        self.version += 1
        folder = os.path.join(self.root, f"v{self.version}")
        return f"policy-v{self.version}", self.version, folder, write_adapter(policy, folder)

    def drop_older(self) -> None:
        """Remove every folder but the current version's."""
        for old in range(1, self.version):
            shutil.rmtree(os.path.join(self.root, f"v{old}"), ignore_errors=True)


def tensor_bytes(weights: Iterable[tuple[str, Tensor]]) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in weights)


def write_weight_shards(weights: Iterable[tuple[str, Tensor]], folder: str, shard_bytes: int = SHARD_BYTES) -> int:
    """Write `weights` as safetensors shards of at most `shard_bytes` (one tensor alone may be larger) into
    `folder`, two names of one storage (tied weights) never in the same shard; returns the bytes written.

    Serialising copies a shard's tensors, so shards bound that copy instead of doubling the model."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    shard: dict[str, Tensor] = {}
    storages: set[int] = set()
    size = written = count = 0

    def flush() -> None:
        nonlocal shard, storages, size, count
        if shard:
            count += 1
            save_file(shard, os.path.join(folder, f"model-{count:05d}.safetensors"))
        shard, storages, size = {}, set(), 0

    for name, tensor in weights:
        cpu = tensor.detach().to("cpu").contiguous()
        nbytes = cpu.numel() * cpu.element_size()
        if cpu.untyped_storage().data_ptr() in storages or (shard and size + nbytes > shard_bytes):
            flush()
        shard[name] = cpu
        storages.add(cpu.untyped_storage().data_ptr())
        size, written = size + nbytes, written + nbytes
    flush()
    return written
