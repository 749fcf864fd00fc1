"""Loading models and tokenizers from a name, a local folder, a `builtin:<task>` or an instance; freezing.

Every loader checks a local path before transformers sees it, so a typo gives an error naming the setting; a
folder's config.json must parse, a hub id must be cached or the hub reachable (no minute of retries offline),
and damaged weights files give an error naming the setting too.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import warnings
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from torch import nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models.portable import is_portable, model_from_portable, tokenizer_from_portable
from lit_rlhf.registry import get_task, is_builtin


def check_local_path(spec: str, field: str, needs: tuple[str, ...] = ()) -> None:
    """A spec that looks like a filesystem path must exist (hub ids like 'org/name' pass through); an existing
    folder must hold one of the files in `needs`."""
    looks_local = spec.startswith((".", "/", "~")) or os.sep + os.sep in spec or spec.endswith(os.sep)
    if looks_local and not os.path.exists(os.path.expanduser(spec)):
        raise ConfigError(
            f"{field}: the folder {spec!r} does not exist; give a local checkpoint folder or a model name"
        )
    folder = os.path.expanduser(spec)
    if needs and os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, n)) for n in needs):
        raise ConfigError(
            f"{field}: the folder {spec!r} holds none of {', '.join(needs)}; is it a folder written by save_pretrained?"
        )


def check_config_json(folder: str, field: str) -> None:
    """A checkpoint folder's config.json must be a JSON object with a `model_type` (when the folder has one)."""
    path = os.path.join(os.path.expanduser(folder), "config.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, OSError) as err:  # invalid JSON or undecodable bytes
        raise ConfigError(
            f"{field}: {path} is not valid JSON ({err}); the checkpoint is damaged: save or download it again"
        ) from err
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ConfigError(
            f"{field}: {path} has no 'model_type', so transformers cannot tell which model it is; save the model "
            'again with save_pretrained (or add the model_type, e.g. "llama")'
        )


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the hub cannot be reached (a 3 s TCP probe), or None. Behind a proxy the probe is skipped."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), 3).close()
    except OSError as err:
        return f"the hub at {endpoint} cannot be reached ({err})"
    return None


def check_hub_id(spec: str, field: str, needs: tuple[str, ...]) -> None:
    """A spec that is not a local path is a hub id: it must be in the local Hugging Face cache, or the hub must
    be reachable and not switched off (HF_HUB_OFFLINE); else fail now instead of after a minute of retries."""
    if os.path.exists(os.path.expanduser(spec)):
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError as err:
        raise ConfigError(f"{field}: {spec!r} is neither an existing folder nor a model name ({err})") from err
    if any(isinstance(try_to_load_from_cache(spec, name), str) for name in needs):
        return
    offline = constants.HF_HUB_OFFLINE or _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE")
    reason = "HF_HUB_OFFLINE is set" if offline else _hub_unreachable(constants.ENDPOINT)
    if reason:
        raise ConfigError(
            f"{field}: {spec!r} is not a local folder and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
            f"and {reason}; download it first (`hf download {spec}`) or give a local folder"
        )


def from_pretrained(load: Callable[..., Any], spec: str, field: str, needs: tuple[str, ...], **kwargs: Any) -> Any:
    """`load(spec, **kwargs)` after the folder/hub checks; unreadable files give a `ConfigError` naming `field`."""
    check_local_path(spec, field, needs)
    check_hub_id(spec, field, needs)
    check_config_json(spec, field)
    from safetensors import SafetensorError

    try:
        return load(spec, **kwargs)
    except SafetensorError as err:
        raise ConfigError(
            f"{field}: a weights file of {spec!r} cannot be read ({err}); it is truncated or damaged (an interrupted "
            "download or save?): download or save it again"
        ) from err
    except OSError as err:
        raise ConfigError(
            f"{field}: cannot load {spec!r}: {err} Give a folder written by save_pretrained, or a model name that "
            "is downloaded or can be"
        ) from err


MODEL_FILES = ("config.json", "adapter_config.json")  # a full model, or a PEFT adapter on a named base
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def load_tokenizer(spec: Any, field: str = "tokenizer", trust_remote_code: bool = False):
    """A tokenizer from an instance, a 'builtin:<task>' name, or a folder/model name; left padding, pad set.

    An instance is copied first: the caller's tokenizer is never changed."""
    from transformers import AutoTokenizer

    if is_builtin(spec):
        tokenizer = get_task(spec, field).tokenizer()
    elif is_portable(spec):
        tokenizer = tokenizer_from_portable(spec)
    elif isinstance(spec, str):
        tokenizer = from_pretrained(
            AutoTokenizer.from_pretrained, spec, field, TOKENIZER_FILES, trust_remote_code=trust_remote_code
        )
    else:
        tokenizer = copy.deepcopy(spec)
    return prepare_tokenizer(tokenizer, field)


def prepare_tokenizer(tokenizer, field: str = "tokenizer"):
    """Left padding for prompts, and a pad token (EOS with a warning when the tokenizer has none)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{field}: the tokenizer has no EOS token, so responses cannot end; set tokenizer.eos_token first"
        )
    if tokenizer.pad_token_id is None:
        warnings.warn(
            f"{field}: the tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r} as pad. "
            "Set tokenizer.pad_token yourself to silence this.",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def data_tokenizer(spec: Any, trainer: Any, field: str = "data.tokenizer"):
    """A DataModule's tokenizer: its own setting (name, folder or instance), else the module's `tokenizer`."""
    if spec is not None:
        return load_tokenizer(spec, field)
    module = trainer.lightning_module if trainer is not None else None
    tokenizer = getattr(module, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError(f"{field}: no tokenizer given and the module has none; pass one")
    return tokenizer


def load_causal_lm(spec: Any, field: str = "policy", trust_remote_code: bool = False, **kwargs) -> nn.Module:
    """A causal LM from an instance, a 'builtin:<task>' name, a folder/model name, or a portable spec."""
    from transformers import AutoModelForCausalLM

    if is_builtin(spec):
        return get_task(spec, field).policy()
    if is_portable(spec):
        return model_from_portable(spec, AutoModelForCausalLM)
    if isinstance(spec, str):
        load = AutoModelForCausalLM.from_pretrained
        return from_pretrained(load, spec, field, MODEL_FILES, trust_remote_code=trust_remote_code, **kwargs)
    if not isinstance(spec, nn.Module):
        raise ConfigError(f"{field}: expected a model name, a folder or a transformers model, got {type(spec)!r}")
    head = getattr(spec, "get_output_embeddings", None)
    if head is None or head() is None:
        raise ConfigError(
            f"{field}: {type(spec).__name__} has no language-model head (get_output_embeddings() gives None); "
            "give a causal LM, e.g. AutoModelForCausalLM.from_pretrained(...)"
        )
    return spec


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: sampling and the update must see the same policy."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def freeze(model: ModuleT) -> ModuleT:
    """Eval mode and no gradients, for the reference and reward models."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def frozen_copy(model: ModuleT) -> ModuleT:
    return freeze(copy.deepcopy(model))


def load_sequence_classifier(spec: Any, field: str, trust_remote_code: bool = False) -> nn.Module:
    """A one-output sequence classifier (a reward model) from 'builtin:<task>', a folder/model name, or an
    instance. A causal LM folder gets a new, randomly initialised one-output score head."""
    from transformers import AutoModelForSequenceClassification

    if is_builtin(spec):
        build = get_task(spec, field).reward_model
        if build is None:
            raise ConfigError(f"{field}: the built-in task {spec!r} has no reward model")
        return build()
    if is_portable(spec):
        return model_from_portable(spec, AutoModelForSequenceClassification)
    if isinstance(spec, str):
        load = AutoModelForSequenceClassification.from_pretrained
        return from_pretrained(load, spec, field, MODEL_FILES, num_labels=1, trust_remote_code=trust_remote_code)
    if not isinstance(spec, nn.Module):
        raise ConfigError(f"{field}: expected a model name, a folder or a transformers model, got {type(spec)!r}")
    return spec
