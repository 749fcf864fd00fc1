"""Padded vocabularies: a model whose embedding (and LM head) has more rows than its tokenizer has tokens (Qwen2.5
and others pad to a multiple of 64 or 128) never gets an id the tokenizer cannot decode.

`mask_padded_vocabulary` hooks the LM head, so every forward of the model (each sampling backend, the update,
evaluation, the adapter-disabled or copied reference) sees -inf logits for ids >= len(tokenizer): those ids are
never sampled and hold no probability in any log-prob, entropy or KL. A model whose vocabulary equals the
tokenizer's gets no hook: its logits are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class PaddedVocabularyMask:
    """A forward hook for an LM head: logits of ids >= `vocab_size` become -inf (a class, so it pickles)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, module: nn.Module, inputs: Any, logits: Tensor) -> Tensor:
        padded = torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_size
        return logits.masked_fill(padded, float("-inf"))


def logit_rows(model: nn.Module) -> int | None:
    """How many ids the model's LM head scores (None when it does not say)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) else None


def mask_padded_vocabulary(model: nn.Module, vocab_size: int) -> bool:
    """Hook `model`'s LM head to mask ids >= `vocab_size` when it scores more; whether it was hooked."""
    rows = logit_rows(model)
    if rows is None or rows <= vocab_size:
        return False
    head = model.get_output_embeddings()  # type: ignore[operator]  # a transformers method
    if not any(isinstance(hook, PaddedVocabularyMask) for hook in head._forward_hooks.values()):
        head.register_forward_hook(PaddedVocabularyMask(vocab_size))
    return True
