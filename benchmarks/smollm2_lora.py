"""The model and prompts of the side by side with TRL (docs/migrating-from-trl.md), shared by the benchmarks that
time its steps: SmolLM2-135M-Instruct in float32 with LoRA r 8 / alpha 16 on every linear layer (the library's own
`apply_lora`), and the first chat prompts of the arithmetic task. Needs models/smollm2-135m
(`python scripts/prepare_smollm2.py --out models/smollm2-135m`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "models", "smollm2-135m")
PROMPTS = os.path.join(ROOT, "configs", "prompts", "smollm2_arithmetic_train.jsonl")
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}


def lora_policy(folder: str = FOLDER) -> tuple[nn.Module, Any]:
    """(the LoRA policy, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_rlhf.models.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return apply_lora(base, LORA), AutoTokenizer.from_pretrained(folder)


def chat_prompts(tokenizer: Any, count: int = 4) -> list[str]:
    """The first `count` training prompts through the chat template, ready for the assistant's reply."""
    with open(PROMPTS) as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(count), strict=False)]
    return [tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True) for row in rows]
