"""Getting the trained policy out: a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.

`save_policy(policy, tokenizer, folder)` writes the model (`save_pretrained`, safetensors), the tokenizer and a
`generation_config.json` (the sampling settings, with the tokenizer's EOS and pad ids). A LoRA policy is either
merged into a plain model (`merge_lora=True`, the default; a merged *copy*, the live policy keeps its adapters)
or saved as its adapter folder (`merge_lora=False`: adapter_config.json + adapter weights + tokenizer), which
`peft.AutoPeftModelForCausalLM.from_pretrained(folder)` loads when the adapter's base model
(`base_model_name_or_path` in adapter_config.json) can be found, or `peft.PeftModel.from_pretrained(base, folder)`
on a base model you load yourself.

The folder is written as `<folder>.tmp-<pid>` and renamed onto `<folder>` when complete, so a reader never sees a
half-written export; an existing `<folder>` is refused unless `overwrite=True`. Every export holds a marker file,
`lit_rlhf_export.json`, listing the files it wrote. `overwrite=True` replaces only a folder that holds a previous
export (the marker, and no file it does not list but Hugging Face model/tokenizer files) or nothing but Hugging Face
model and tokenizer files (`HF_FILES`); anything else (a run folder, checkpoints, `.`, the home folder, a folder
holding the current directory) is refused with an `ExportError` naming what is inside. `<folder>.tmp-<pid>` and
`<folder>.old-<pid>` folders left by a killed export (its process is dead) are deleted, with a log line, by the
next export to the same folder. A SIGTERM that arrives while an export is written is held until the export is
published (or, if it fails, rolled back), then delivered to the handler it would have reached (the default one
ends the process with the usual status, 143 in a shell).

A policy sharded by FSDP2 (`ModelParallelStrategy`) is gathered into a plain copy on global rank 0 first
(`save_module_policy`; every rank takes part). Under the classic `FSDPStrategy` or DeepSpeed ZeRO-3 the policy is
saved as this process holds it, so save a full checkpoint and export it with `lit-rlhf-export` instead.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import logging
import os
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.full_weights import gathered_copy, is_sharded
from lit_rlhf.models.lora import has_adapters
from lit_rlhf.models.stop_ids import stop_token_ids

TMP_MARKER = ".tmp-"
OLD_MARKER = ".old-"
EXPORT_MARKER = "lit_rlhf_export.json"
STAGING_MARKER = ".lit_rlhf_staging.json"
"""In a `<folder>.tmp-<pid>` / `<folder>.old-<pid>` folder while an export moves it: {"lit_rlhf_staging": folder's
name, "pid": pid}. Clean-up after a killed export deletes only folders holding it, never a folder by its name."""
"""The file every export writes: {"lit_rlhf_export": 1, "files": [the names it wrote]}."""
HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "README.md",
    EXPORT_MARKER,
)
"""Names (glob patterns) of the files a Hugging Face model or tokenizer folder holds: a folder of nothing else may
be replaced by `overwrite=True`."""

log = logging.getLogger(__name__)


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
    """The policy's own generation config (or a new one) updated with `generation`, the tokenizer's pad id and the
    ids training stopped at (`stop_token_ids`: one id, or the list of them); unknown or inconsistent settings raise
    a `ConfigError` naming them."""
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
        stops = stop_token_ids(tokenizer, own)
        if stops:
            settings["eos_token_id"] = stops[0] if len(stops) == 1 else list(stops)
        if tokenizer.pad_token_id is not None:
            settings["pad_token_id"] = tokenizer.pad_token_id
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


def _describe(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def replace_problem(target: str) -> str | None:
    """Why the existing folder `target` may not be replaced by an export, or None when it may: it holds a previous
    export (its marker, and nothing it did not write but Hugging Face files) or only Hugging Face files."""
    if os.path.islink(target) or not os.path.isdir(target):
        return "it is not a folder (a file or a link)"
    here, home = os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))
    real = os.path.realpath(target)
    if real == here or here.startswith(real.rstrip(os.sep) + os.sep):
        return "it is (or holds) the current directory"
    if real in (home, os.path.realpath(os.sep)):
        return "it is the home or root folder"
    names = [name for name in os.listdir(target) if name != STAGING_MARKER]  # left by a kill while publishing
    written: set[str] = set()
    if EXPORT_MARKER in names:
        try:
            with open(os.path.join(target, EXPORT_MARKER), encoding="utf-8") as f:
                written = set(json.load(f).get("files", []))
        except (OSError, ValueError, AttributeError):
            written = set()
    foreign = [
        name + ("/" if os.path.isdir(os.path.join(target, name)) else "")
        for name in names
        if name not in written
        and (os.path.isdir(os.path.join(target, name)) or not any(fnmatch.fnmatch(name, p) for p in HF_FILES))
    ]
    if foreign:
        kind = "a previous export plus" if EXPORT_MARKER in names else "not a previous export: it holds"
        return f"{kind} {_describe(foreign)}"
    return None


def check_target(folder: str, overwrite: bool) -> str:
    target = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    if os.path.lexists(target) and not overwrite:
        raise ExportError(
            f"save_policy: {folder!r} already exists; choose another folder or pass overwrite=True "
            "(--overwrite on the command line) to replace it"
        )
    if os.path.lexists(target):
        problem = replace_problem(target)
        if problem is not None:
            raise ExportError(
                f"save_policy: refusing to replace {folder!r} ({target}): {problem}. overwrite=True replaces only "
                f"a folder holding a previous export ({EXPORT_MARKER}) or only Hugging Face model/tokenizer files; "
                "choose another folder"
            )
    return target


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def write_staging_marker(folder: str, target: str) -> None:
    """Mark `folder` (a temporary or a replaced export) as the library's, for the clean-up after a killed export."""
    with open(os.path.join(folder, STAGING_MARKER), "w", encoding="utf-8") as f:
        json.dump({"lit_rlhf_staging": os.path.basename(target), "pid": os.getpid()}, f)


def is_staging(folder: str, target: str, pid: int) -> bool:
    """Whether `folder` holds the staging marker an export to `target` by process `pid` wrote."""
    try:
        with open(os.path.join(folder, STAGING_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return marker == {"lit_rlhf_staging": os.path.basename(target), "pid": pid}


def remove_stale_exports(target: str) -> list[str]:
    """Delete `<target>.tmp-<pid>` / `<target>.old-<pid>` folders whose process is dead (killed exports) and that
    hold the staging marker of that export; a folder with such a name but no marker (a user's backup) is kept."""
    parent, base = os.path.split(target)
    pattern = re.compile(re.escape(base) + f"(?:{re.escape(TMP_MARKER)}|{re.escape(OLD_MARKER)})" + r"(\d+)$")
    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        match = pattern.fullmatch(name)
        path = os.path.join(parent, name)
        if not match or not os.path.isdir(path) or os.path.islink(path) or _pid_alive(int(match.group(1))):
            continue
        if is_staging(path, target, int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s, a partial export left by a killed process (pid %s)", path, match.group(1))
    return removed


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM until the block ends (finished or rolled back), then deliver it to the handler it would have
    reached; in the main thread only (elsewhere signals cannot be handled, and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[Any] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            log.warning("SIGTERM arrived during the export; delivering it now that the export is done")
            if callable(previous):
                previous(signal.SIGTERM, received[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGTERM)


def publish(tmp: str, target: str, folder: str, overwrite: bool) -> None:
    """Rename the finished `tmp` folder onto `target`; an existing target is replaced only with `overwrite`."""
    if not os.path.lexists(target):
        os.replace(tmp, target)  # fails (no harm done) if a non-empty folder appeared there meanwhile
        return
    if not overwrite:
        raise ExportError(f"save_policy: {folder!r} appeared while the export was being written")
    check_target(folder, overwrite)  # what is there now, not what was there when the export began
    old = f"{target}{OLD_MARKER}{os.getpid()}"
    write_staging_marker(target, target)  # the replaced export is the library's to delete, even after a kill
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
        overwrite: replace an existing `folder` that holds a previous export or only Hugging Face files (anything
            else, and without it any existing folder, is an `ExportError` naming it; module docstring).

    Returns the absolute path of the folder.
    """
    target = check_target(folder, overwrite)
    model = plain_policy(policy)
    config = generation_config(model, tokenizer, generation)  # bad settings fail before anything is written
    adapters_only = has_adapters(model) and not merge_lora
    if has_adapters(model) and merge_lora:
        model = merged_copy(model)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    remove_stale_exports(target)
    tmp = f"{target}{TMP_MARKER}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left over from a killed export of this same process id
    with sigterm_held():
        try:
            os.makedirs(tmp)
            write_staging_marker(tmp, target)
            model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]  # transformers/peft
            if tokenizer is not None:
                tokenizer_to_save(tokenizer).save_pretrained(tmp)
            config.save_pretrained(tmp)
            with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
                files = sorted({*os.listdir(tmp), EXPORT_MARKER} - {STAGING_MARKER})
                json.dump({"lit_rlhf_export": 1, "adapters_only": adapters_only, "files": files}, f, indent=1)
            publish(tmp, target, folder, overwrite)
            os.remove(os.path.join(target, STAGING_MARKER))  # published: no longer a temporary
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if adapters_only:
        warn_unreachable_base(model, folder)
    return target


def save_module_policy(module: Any, folder: str, merge_lora: bool = True, overwrite: bool = False) -> str | None:
    """`save_policy` for an `RLHFModule` (or anything with `actor_critic.policy`, `tokenizer`, `sampling`): its
    policy, its tokenizer, and its sampling settings as the generation config.

    A policy sharded by FSDP2 (`ModelParallelStrategy`) is first gathered into a plain copy on global rank 0
    (`lit_rlhf.models.full_weights`): every rank must then call this, rank 0 writes the folder and returns its
    path, the others return None."""
    if getattr(module, "actor_critic", None) is None:
        raise ExportError(
            f"save_policy: the module has no policy yet (call configure_model() first); folder {folder!r}"
        )
    policy = module.actor_critic.policy
    if is_sharded(policy):
        check_target(folder, overwrite)  # on every rank, before the gather: not on rank 0 alone after it
        policy = gathered_copy(policy)
        if policy is None:  # not global rank 0: it took part in the gather, rank 0 writes
            return None
        if has_adapters(policy) and merge_lora:  # the gathered copy is ours: merged in place, not copied again
            policy = policy.merge_and_unload()  # type: ignore[operator]  # peft method
    sampling = getattr(module, "sampling", None)
    settings = generation_settings(sampling) if isinstance(sampling, SamplingConfig) else None
    return save_policy(policy, module.tokenizer, folder, merge_lora, settings, overwrite)


class PolicyExport:
    """Mixin for `RLHFModule`: `module.save_policy(folder)`."""

    def save_policy(self, folder: str, merge_lora: bool = True, overwrite: bool = False) -> str | None:
        """Write the policy, the tokenizer and the sampling settings (as the generation config) as a Hugging Face
        folder that `AutoModelForCausalLM.from_pretrained` loads (`lit_rlhf.models.export`); returns its path.
        Under FSDP2 call it on every rank (they gather the policy); rank 0 writes, the others get None."""
        return save_module_policy(self, folder, merge_lora, overwrite)


__all__ = [
    "EXPORT_MARKER",
    "ExportError",
    "PolicyExport",
    "generation_config",
    "generation_settings",
    "merged_copy",
    "replace_problem",
    "save_module_policy",
    "save_policy",
]
