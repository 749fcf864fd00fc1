"""Specs a checkpoint can carry for models and tokenizers given as instances, so that
`RLHFModule.load_from_checkpoint(path)` rebuilds them without arguments: a model's transformers config (the
weights come from the checkpoint's state dict) and a tokenizer's saved files.

A portable spec is a plain dict of strings, numbers and uint8 tensors, so the checkpoint still loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from torch import nn

CONFIG_KEY, FILES_KEY = "transformers_config", "tokenizer_files"
PEFT_KEY = "peft_config"  # a peft model given as the policy: its adapters' config (the base is CONFIG_KEY)


def is_portable(spec: Any) -> bool:
    return isinstance(spec, dict) and (CONFIG_KEY in spec or FILES_KEY in spec)


def portable_spec(obj: Any) -> dict[str, Any] | None:
    """The portable spec of a transformers model (its config) or tokenizer (its files); None for anything
    else (a model without a transformers config cannot be rebuilt from a checkpoint)."""
    if isinstance(obj, nn.Module):
        model = getattr(obj, "model", obj)  # a SequenceRewardModel (and a peft model) wraps the transformers model
        to_dict = getattr(getattr(model, "config", None), "to_dict", None)
        if not callable(to_dict):
            return None
        adapters = peft_adapter_config(obj)
        return {CONFIG_KEY: to_dict(), **({PEFT_KEY: adapters} if adapters is not None else {})}
    if callable(getattr(obj, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as folder:
            obj.save_pretrained(folder)
            files = {}
            for name in sorted(os.listdir(folder)):
                with open(os.path.join(folder, name), "rb") as handle:
                    files[name] = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)
        return {FILES_KEY: files}
    return None


def peft_adapter_config(model: Any) -> dict[str, Any] | None:
    """A peft model's active adapter config as plain JSON values (sets as lists, enums as strings); None for a
    model without peft adapters."""
    configs = getattr(model, "peft_config", None)
    if not callable(getattr(model, "disable_adapter", None)) or not isinstance(configs, dict):
        return None
    config = configs.get(getattr(model, "active_adapter", "default"))
    return json.loads(json.dumps(config.to_dict(), default=list)) if config is not None else None


def model_from_portable(spec: dict[str, Any], auto_class: Any) -> nn.Module:
    """A freshly initialised model of the spec's architecture (`auto_class`: e.g. AutoModelForCausalLM), with
    fresh peft adapters of the same config when the spec has one (the checkpoint's weights replace both)."""
    from transformers import AutoConfig

    settings = dict(spec[CONFIG_KEY])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = auto_class.from_config(config)
    if spec.get(PEFT_KEY) is None:
        return model
    from peft import get_peft_config, get_peft_model

    return get_peft_model(model, get_peft_config(dict(spec[PEFT_KEY])))


def tokenizer_from_portable(spec: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, data in spec[FILES_KEY].items():
            if not is_plain_file_name(name):  # a checkpoint never chooses where a file is written
                raise ValueError(
                    f"tokenizer: the checkpoint's tokenizer files include {name!r}, not a plain file name (a path); "
                    "the checkpoint is damaged or hostile; pass tokenizer=... to load_from_checkpoint"
                )
            with open(os.path.join(folder, name), "wb") as handle:
                handle.write(bytes(data.numpy()))
        return AutoTokenizer.from_pretrained(folder)


def is_plain_file_name(name: Any) -> bool:
    """One file name, no folder: no separator, not '.' or '..', not empty."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.sep not in name
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )
