"""Checkpoint integrity: a checksum of the payload written with it and checked before any weight is used, and
the differences between a checkpoint's weights and a module's named one per line instead of load_state_dict's
error.

The checksum is SHA-256 over the module's weights and the optimizer states (names, dtypes, shapes and bytes, in
a fixed order), stored as `checkpoint["lit_rlhf"]["payload_sha256"]`. It finds a damaged file (flipped bytes in a
tensor keep the zip readable and torch does not check its CRCs); it is no signature: whoever can write the file
can write the checksum too. Checkpoints without one (older ones, other writers) load unchecked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.training.checkpoint_io import CheckpointError

DIGEST_KEY = "payload_sha256"
PAYLOAD_KEYS = ("state_dict", "optimizer_states")
CRITIC = ("actor_critic.value_head.", "actor_critic.critic_backbone.")


def _feed(digest: Any, value: Any, name: str) -> None:
    """Hash `value` (nested dicts, lists, tensors, numbers, strings) with its place `name`, in a fixed order."""
    if isinstance(value, Tensor):
        data = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")  # no copy: the buffer itself
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            _feed(digest, value[key], f"{name}/{key!r}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _feed(digest, item, f"{name}[{i}]")
    else:
        digest.update(f"{name}={value!r};".encode())


def payload_digest(checkpoint: Mapping[str, Any]) -> str:
    """SHA-256 of the checkpoint's weights and optimizer states."""
    digest = hashlib.sha256()
    for key in PAYLOAD_KEYS:
        _feed(digest, checkpoint.get(key), key)
    return digest.hexdigest()


def verify_payload(checkpoint: Mapping[str, Any], saved: Mapping[str, Any], path: Any) -> None:
    """A `CheckpointError` naming `path` when the payload does not hash to the checksum written with it."""
    expected = saved.get(DIGEST_KEY)
    if expected is None:
        return
    actual = payload_digest(checkpoint)
    if actual != expected:
        raise CheckpointError(
            f"checkpoint {path}: its weights or optimizer state do not match the checksum written with them (sha256 "
            f"{actual[:12]}..., written {str(expected)[:12]}...): the file was damaged after it was written (a disk "
            "or copy error) or edited. Nothing was loaded; resume from an earlier checkpoint"
        )


def _example(keys: list[str]) -> str:
    return ", ".join(keys[:2]) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")


def weight_differences(
    saved: Mapping[str, Tensor], own: Mapping[str, Tensor], saved_hparams: Mapping[str, Any], hparams: Mapping[str, Any]
) -> list[str]:
    """One line per way the checkpoint's weights do not fit the module's (empty when they fit): the algorithm
    (a critic on one side only), LoRA on one side only, the vocabulary, other shapes, other names."""
    only_saved = sorted(set(saved) - set(own))
    only_own = sorted(set(own) - set(saved))
    shapes = [k for k in sorted(set(saved) & set(own)) if tuple(saved[k].shape) != tuple(own[k].shape)]
    if not (only_saved or only_own or shapes):
        return []
    lines = []
    algorithm = _setting(saved_hparams.get("algorithm"), "name"), _setting(hparams.get("algorithm"), "name")
    critic = [any(k.startswith(CRITIC) for k in keys) for keys in (saved, own)]
    if critic[0] != critic[1] or (algorithm[0] and algorithm[1] and algorithm[0] != algorithm[1]):
        where = ["with a critic" if c else "without a critic" for c in critic]
        lines.append(f"algorithm: {algorithm[0]} ({where[0]}) in the checkpoint, {algorithm[1]} ({where[1]}) here")
    lora = [any("lora_" in k for k in keys) for keys in (saved, own)]
    if lora[0] != lora[1]:
        lines.append(f"LoRA: {'on' if lora[0] else 'off'} in the checkpoint, {'on' if lora[1] else 'off'} here")
    vocabulary = [k for k in shapes if saved[k].shape[1:] == own[k].shape[1:] and _is_vocabulary(k)]
    if vocabulary:
        key, named = vocabulary[0], _example(vocabulary)
        lines.append(f"vocabulary: {saved[key].shape[0]} ids in the checkpoint, {own[key].shape[0]} here ({named})")
    other = [k for k in shapes if k not in vocabulary]
    if other:
        key = other[0]
        lines.append(
            f"model shape: {len(other)} weights differ ({key}: {list(saved[key].shape)} in the checkpoint, "
            f"{list(own[key].shape)} here)"
        )
    explained = CRITIC if critic[0] != critic[1] else ()  # LoRA on one side renames every policy weight
    unexplained_saved = [k for k in only_saved if not k.startswith(explained)]
    unexplained_own = [k for k in only_own if not k.startswith(explained)]
    if (unexplained_saved or unexplained_own) and lora[0] == lora[1]:
        lines.append(
            f"model: {len(unexplained_saved)} weights only in the checkpoint ({_example(unexplained_saved) or '-'}), "
            f"{len(unexplained_own)} only here ({_example(unexplained_own) or '-'})"
        )
    return lines


def _setting(section: Any, key: str) -> Any:
    return section.get(key) if isinstance(section, Mapping) else getattr(section, key, None)


def _is_vocabulary(key: str) -> bool:
    """An embedding or output-head weight (its first dimension is the vocabulary)."""
    return any(part in key for part in ("wte", "embed_tokens", "lm_head", "embed_out", "word_embeddings", "output."))


def check_weights_fit(
    path: Any,
    saved: Mapping[str, Tensor],
    own: Mapping[str, Tensor],
    saved_hparams: Mapping[str, Any],
    hparams: Mapping[str, Any],
) -> None:
    """A `CheckpointError` naming `path` and each difference (one line each) when the weights do not fit."""
    lines = weight_differences(saved, own, saved_hparams, hparams)
    if lines:
        raise CheckpointError(
            f"checkpoint {path}: its weights do not fit this module; resume with the settings it was trained with, "
            "or start a new run:\n  " + "\n  ".join(lines)
        )
