"""`sampling.backend` -> the backend class: the one table of samplers."""

from __future__ import annotations

import torch
from torch import nn

from lit_rlhf.rollout.backends.base import InProcessBackend, RolloutBackend
from lit_rlhf.rollout.backends.hf_generate import GenerateBackend
from lit_rlhf.rollout.backends.lean import CompiledBackend, LeanBackend

BACKENDS: dict[str, type[InProcessBackend]] = {
    "lean": LeanBackend,
    "compiled": CompiledBackend,
    "generate": GenerateBackend,
}
"""Every value of `SamplingConfig.backend` (`config.SamplingBackend` lists the same names; a test checks)."""


def make_backend(
    name: str, policy: nn.Module, eos_token_id: int, pad_token_id: int, generator: torch.Generator | None = None
) -> RolloutBackend:
    """The backend `name` over `policy` (`generator`: the in-process samplers' RNG; None: the global one)."""
    return BACKENDS[name](policy, eos_token_id, pad_token_id, generator)
