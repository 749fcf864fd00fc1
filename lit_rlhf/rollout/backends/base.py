"""The rollout-backend contract: what every sampler gives the rollout collectors, and the base of the samplers
that run the live policy module in this process.

A backend turns left-padded prompts into a `Generation` (`group_size` responses per prompt on the response
grid); `sync_weights` brings its copy of the policy up to date before it samples (the in-process samplers read
the live module, so they have nothing to copy); `close` frees what it holds. The collectors (single-turn,
multi-turn, dynamic sampling, overlapped scoring, held-out evaluation) only ever call these three, so a new
backend is one class and one entry in `registry.BACKENDS` (docs/design.md, "Adding a rollout backend").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from lit_rlhf.config import SamplingConfig
from lit_rlhf.rollout.generation import EosIds, Generation, finish_generation
from lit_rlhf.types import PromptBatch


class RolloutBackend(Protocol):
    """Samples responses for the collectors; chosen by `sampling.backend`."""

    @property
    def device(self) -> torch.device:
        """Where the tensors of the `Generation`s it returns live."""
        ...

    def generate(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Generation:
        """`group_size` responses to each prompt, rows b*G .. b*G+G-1 for prompt b, post-processed (mask up to
        the first EOS, pad after it, truncation flags)."""
        ...

    def sync_weights(self, policy: nn.Module) -> None:
        """Make the next `generate` sample from `policy`'s current weights."""
        ...

    def close(self) -> None:
        """Free the backend's resources; it is not used afterwards."""
        ...


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built from: the policy it samples, the token ids that end a response (one or several:
    `lit_rlhf.models.stop_ids.stop_token_ids`; a response ends at the first) and the one that pads it, the sampling
    settings (a backend's own options live there, e.g. `sampling.vllm`), the in-process samplers' generator (None:
    the global RNG) and this process's global rank (for backends shared between processes)."""

    policy: nn.Module
    eos_token_id: EosIds
    pad_token_id: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    global_rank: int = 0


class InProcessBackend:
    """A sampler that runs the policy module itself, in this process: sampling always sees its current weights,
    so `sync_weights` only records which module to run and `close` has nothing to free.

    Subclasses implement `raw_responses`: the sampled ids, (B, T), before post-processing.
    """

    def __init__(
        self, policy: nn.Module, eos_token_id: EosIds, pad_token_id: int, generator: torch.Generator | None = None
    ) -> None:
        self.policy, self.eos_token_id, self.pad_token_id = policy, eos_token_id, pad_token_id
        self.generator = generator  # None: the global RNG (seeded per rank by the module: exact resume)

    @property
    def device(self) -> torch.device:
        """The policy's device (the CPU for a model without parameters)."""
        first = next(self.policy.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Generation:
        prompts = prompts.to(self.device)
        raw = self.raw_responses(prompts, group_size, sampling)
        return finish_generation(prompts, group_size, raw, self.eos_token_id, self.pad_token_id)

    @classmethod
    def from_context(cls, context: BackendContext) -> InProcessBackend:
        return cls(context.policy, context.eos_token_id, context.pad_token_id, context.generator)

    def raw_responses(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Tensor:
        raise NotImplementedError

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy

    def close(self) -> None:
        pass
