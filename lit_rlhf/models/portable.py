"""Specs a checkpoint can carry for models and tokenizers given as instances, so that
`RLHFModule.load_from_checkpoint(path)` rebuilds them without arguments: a model's transformers config (the
weights come from the checkpoint's state dict) and a tokenizer's saved files.

A portable spec is a plain dict of strings, numbers and uint8 tensors, so the checkpoint still loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

CONFIG_KEY, FILES_KEY = "transformers_config", "tokenizer_files"


def is_portable(spec: Any) -> bool:
    return isinstance(spec, dict) and (CONFIG_KEY in spec or FILES_KEY in spec)


def portable_spec(obj: Any) -> dict[str, Any] | None:
    """The portable spec of a transformers model (its config) or tokenizer (its files); None for anything
    else (a model without a transformers config cannot be rebuilt from a checkpoint)."""
    if isinstance(obj, nn.Module):
        model = getattr(obj, "model", obj)  # a SequenceRewardModel wraps the transformers model
        to_dict = getattr(getattr(model, "config", None), "to_dict", None)
        return {CONFIG_KEY: to_dict()} if callable(to_dict) else None
    if callable(getattr(obj, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as folder:
            obj.save_pretrained(folder)
            files = {}
            for name in sorted(os.listdir(folder)):
                with open(os.path.join(folder, name), "rb") as handle:
                    files[name] = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)
        return {FILES_KEY: files}
    return None


def model_from_portable(spec: dict[str, Any], auto_class: Any) -> nn.Module:
    """A freshly initialised model of the spec's architecture (`auto_class`: e.g. AutoModelForCausalLM)."""
    from transformers import AutoConfig

    settings = dict(spec[CONFIG_KEY])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return auto_class.from_config(config)


def tokenizer_from_portable(spec: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, data in spec[FILES_KEY].items():
            with open(os.path.join(folder, name), "wb") as handle:
                handle.write(bytes(data.numpy()))
        return AutoTokenizer.from_pretrained(folder)
