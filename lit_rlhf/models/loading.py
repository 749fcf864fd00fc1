"""Loading models and tokenizers from a name, a local folder, a `builtin:<task>` or an instance; freezing.

Every loader checks a local path before transformers sees it, so a typo gives an error naming the setting.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, TypeVar

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
        check_local_path(spec, field, TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
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
        check_local_path(spec, field, MODEL_FILES)
        return AutoModelForCausalLM.from_pretrained(spec, trust_remote_code=trust_remote_code, **kwargs)
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
        check_local_path(spec, field, MODEL_FILES)
        return AutoModelForSequenceClassification.from_pretrained(
            spec, num_labels=1, trust_remote_code=trust_remote_code
        )
    if not isinstance(spec, nn.Module):
        raise ConfigError(f"{field}: expected a model name, a folder or a transformers model, got {type(spec)!r}")
    return spec
