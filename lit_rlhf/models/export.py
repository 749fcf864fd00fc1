"""Getting the trained policy out: a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.

`save_policy(policy, tokenizer, folder)` writes the model (`save_pretrained`, safetensors), the tokenizer and a
`generation_config.json` (the sampling settings, with the tokenizer's EOS and pad ids). A LoRA policy is either
merged into a plain model (`merge_lora=True`, the default; a merged *copy*, the live policy keeps its adapters)
or saved as its adapter folder (`merge_lora=False`: adapter_config.json + adapter weights + tokenizer), which
`peft.AutoPeftModelForCausalLM.from_pretrained(folder)` loads when the adapter's base model
(`base_model_name_or_path` in adapter_config.json) can be found, or `peft.PeftModel.from_pretrained(base, folder)`
on a base model you load yourself.

The folder is written as `<folder>.tmp-<pid>` and renamed onto `<folder>` when complete, so a reader never sees a
half-written export; an existing `<folder>` is refused unless `overwrite=True`.

The policy is saved as this process holds it: under a strategy that shards parameters (FSDP, DeepSpeed ZeRO-3)
save a full checkpoint and export it with `lit-rlhf-export` instead.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from typing import Any

from torch import nn

from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.lora import has_adapters

TMP_MARKER = ".tmp-"


class ExportError(ConfigError):
    """The policy cannot be exported where or how it was asked; the message names the folder."""


def generation_settings(sampling: SamplingConfig) -> dict[str, Any]:
    """A `SamplingConfig` as `GenerationConfig` settings: the same sampling the rollouts used."""
    return {
        "do_sample": True,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,  # 0 is off for both (transformers' unset default would be 50)
        "top_p": sampling.top_p,
    }


def generation_config(policy: nn.Module, tokenizer: Any, generation: dict[str, Any] | SamplingConfig | None):
    """The policy's own generation config (or a new one) updated with `generation` and the tokenizer's EOS and
    pad ids; unknown or inconsistent settings raise a `ConfigError` naming them."""
    from transformers import GenerationConfig

    if isinstance(generation, SamplingConfig):
        generation = generation_settings(generation)
    own = getattr(policy, "generation_config", None)
    config = copy.deepcopy(own) if isinstance(own, GenerationConfig) else GenerationConfig()
    settings = dict(generation or {})
    known = set(GenerationConfig().to_dict())
    unknown = sorted(k for k in settings if k not in known)
    if unknown:
        raise ConfigError(f"generation: unknown GenerationConfig setting(s) {', '.join(map(repr, unknown))}")
    if tokenizer is not None:
        for key in ("eos_token_id", "pad_token_id"):
            if getattr(tokenizer, key, None) is not None:
                settings[key] = getattr(tokenizer, key)
    config.update(**settings)
    config._from_model_config = False  # otherwise generate() may re-derive it from the model's config
    try:
        config.validate(strict=True)
    except ValueError as err:
        raise ConfigError(f"generation: {' '.join(str(err).split())}") from err  # one line
    return config


def plain_policy(policy: nn.Module) -> nn.Module:
    """The Hugging Face model inside an `ActorCritic` or a `torch.compile` wrapper."""
    if isinstance(policy, ActorCritic):
        policy = policy.policy
    policy = getattr(policy, "_orig_mod", policy)
    if not callable(getattr(policy, "save_pretrained", None)):
        raise ExportError(
            f"save_policy: {type(policy).__name__} has no save_pretrained; give a transformers (or peft) model"
        )
    return policy


def merged_copy(policy: nn.Module) -> nn.Module:
    """A plain model with the LoRA adapters merged into its weights; `policy` itself is left untouched.

    Costs one extra copy of the model on the policy's device while it is written.
    """
    return copy.deepcopy(policy).merge_and_unload()  # type: ignore[operator]  # peft method


def tokenizer_to_save(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that records its current padding side in tokenizer_config.json (transformers saves
    only the constructor's settings, so a left padding set afterwards would be lost); the caller's is untouched."""
    side = getattr(tokenizer, "padding_side", None)
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if side is None or not isinstance(init_kwargs, dict) or init_kwargs.get("padding_side") == side:
        return tokenizer
    saved = copy.deepcopy(tokenizer)
    saved.init_kwargs["padding_side"] = side
    return saved


def check_target(folder: str, overwrite: bool) -> str:
    target = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    if os.path.lexists(target) and not overwrite:
        raise ExportError(
            f"save_policy: {folder!r} already exists; choose another folder or pass overwrite=True "
            "(--overwrite on the command line) to replace it"
        )
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ExportError(f"save_policy: {folder!r} is a file, not a folder; refusing to replace it")
    return target


def publish(tmp: str, target: str, folder: str, overwrite: bool) -> None:
    """Rename the finished `tmp` folder onto `target`; an existing target is replaced only with `overwrite`."""
    if not os.path.lexists(target):
        os.replace(tmp, target)  # fails (no harm done) if a non-empty folder appeared there meanwhile
        return
    if not overwrite:
        raise ExportError(f"save_policy: {folder!r} appeared while the export was being written")
    old = f"{target}.old-{os.getpid()}"
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def warn_unreachable_base(policy: nn.Module, folder: str) -> None:
    config = getattr(policy, "peft_config", {}).get(getattr(policy, "active_adapter", "default"))
    base = getattr(config, "base_model_name_or_path", None)
    if not base:
        warnings.warn(
            f"save_policy: the adapters in {folder!r} do not name their base model (it was not loaded from a "
            "folder or hub id), so AutoPeftModelForCausalLM cannot load them; load the base model yourself and "
            "use peft.PeftModel.from_pretrained(base, folder), or export with merge_lora=True",
            stacklevel=3,
        )


def save_policy(
    policy: nn.Module,
    tokenizer: Any,
    folder: str,
    merge_lora: bool = True,
    generation: dict[str, Any] | SamplingConfig | None = None,
    overwrite: bool = False,
) -> str:
    """Write `policy` (a causal LM, a peft LoRA model, or an `ActorCritic`) as a Hugging Face folder.

    Args:
        policy: the model to save; it is not modified (a LoRA policy is merged in a copy).
        tokenizer: saved beside the model with its current padding side (the object is not modified); its EOS
            and pad ids go into the generation config. None: no tokenizer files.
        folder: the folder to create; its parent folders are created too.
        merge_lora: for a LoRA policy, save a plain model with the adapters merged in (True), or only the
            adapters (False; load them with peft on the same base model). No effect without adapters.
        generation: `GenerationConfig` settings (max_new_tokens, temperature, top_k, top_p, do_sample, ...) or a
            `SamplingConfig`, on top of the policy's own generation config.
        overwrite: replace an existing `folder` (otherwise an `ExportError` names it).

    Returns the absolute path of the folder.
    """
    target = check_target(folder, overwrite)
    model = plain_policy(policy)
    config = generation_config(model, tokenizer, generation)  # bad settings fail before anything is written
    adapters_only = has_adapters(model) and not merge_lora
    if has_adapters(model) and merge_lora:
        model = merged_copy(model)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}{TMP_MARKER}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left over from a killed export of this same process id
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]  # transformers/peft method
        if tokenizer is not None:
            tokenizer_to_save(tokenizer).save_pretrained(tmp)
        config.save_pretrained(tmp)
        publish(tmp, target, folder, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if adapters_only:
        warn_unreachable_base(model, folder)
    return target


def save_module_policy(module: Any, folder: str, merge_lora: bool = True, overwrite: bool = False) -> str:
    """`save_policy` for an `RLHFModule` (or anything with `actor_critic.policy`, `tokenizer`, `sampling`): its
    policy, its tokenizer, and its sampling settings as the generation config."""
    if getattr(module, "actor_critic", None) is None:
        raise ExportError(
            f"save_policy: the module has no policy yet (call configure_model() first); folder {folder!r}"
        )
    if any(hasattr(p, "full_tensor") for p in module.actor_critic.policy.parameters()):  # DTensor shards
        raise ExportError(
            "save_policy: the policy is sharded (ModelParallelStrategy, FSDP2); gathering it into a Hugging Face "
            f"folder is not supported yet, so {folder!r} was not written: train with strategy: ddp to export"
        )
    sampling = getattr(module, "sampling", None)
    settings = generation_settings(sampling) if isinstance(sampling, SamplingConfig) else None
    return save_policy(module.actor_critic.policy, module.tokenizer, folder, merge_lora, settings, overwrite)


class PolicyExport:
    """Mixin for `RLHFModule`: `module.save_policy(folder)`."""

    def save_policy(self, folder: str, merge_lora: bool = True, overwrite: bool = False) -> str:
        """Write the policy, the tokenizer and the sampling settings (as the generation config) as a Hugging Face
        folder that `AutoModelForCausalLM.from_pretrained` loads (`lit_rlhf.models.export`); returns its path."""
        return save_module_policy(self, folder, merge_lora, overwrite)


__all__ = [
    "ExportError",
    "PolicyExport",
    "generation_config",
    "generation_settings",
    "merged_copy",
    "save_module_policy",
    "save_policy",
]
