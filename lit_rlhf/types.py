"""The batches that flow through a training step, and the one home of their shape comments.

PromptBatch (data) -> Rollout (generate, score) -> Experience (log-probs, KL, advantages) -> update.

B0 = prompts in the batch, G = samples per prompt, B = B0 * G sequences, P = prompt length (left padded),
T = response length (right padded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Self


@dataclass
class PromptBatch:
    """Tokenised prompts, left padded so every prompt ends at column P-1."""

    input_ids: Tensor  # (B0, P) long
    attention_mask: Tensor  # (B0, P) long, 0 on left padding
    texts: list[str]  # B0 prompt strings
    meta: dict[str, list[Any]] = field(default_factory=dict)  # extra dataset columns, each a list of B0
    position: int = 0  # rows of this rank's prompt stream consumed up to and including this batch

    def to(self, device: torch.device | str) -> PromptBatch:
        return dataclasses.replace(
            self, input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device)
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(kw_only=True)
class Rollout:
    """What sampling and scoring produce: responses on the (B, T) response grid and one score each."""

    prompt_ids: Tensor  # (B, P) long, left padded, each prompt repeated G times
    prompt_mask: Tensor  # (B, P) long
    response_ids: Tensor  # (B, T) long, right padded with pad after the first EOS
    response_mask: Tensor  # (B, T) bool: first response token up to and including the first EOS
    truncated: Tensor  # (B,) bool, no EOS within max_new_tokens
    scores: Tensor  # (B,) float32, sequence scores after truncation handling
    prompts: list[str] = field(default_factory=list)  # B prompt strings (each repeated G times)
    responses: list[str] = field(default_factory=list)  # B decoded responses
    meta: dict[str, list[Any]] = field(default_factory=dict)  # extra prompt columns, each a list of B
    policy_version: int = 0  # number of optimizer updates the sampling policy had seen
    # (B, T) bool: response tokens that are attended but not the policy's (a multi-turn environment's); None: none
    context_mask: Tensor | None = None
    # (B, T) float32: the rollout backend's own log-probs of the sampled tokens (0 elsewhere), kept when it runs a
    # model of its own (vLLM) for the mismatch metrics and `algorithm.tis_cap`; None: the in-process samplers,
    # whose log-probs are the trainer's by construction
    sampler_logprobs: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def input_ids(self) -> Tensor:
        """Prompt and response concatenated: (B, P+T)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """Attention over prompt (minus left padding) and response (up to its EOS, environment tokens too): (B, P+T)."""
        attended = self.response_mask if self.context_mask is None else self.response_mask | self.context_mask
        return torch.cat([self.prompt_mask, attended.long()], dim=1)

    def select(self, index: Tensor | slice) -> Self:
        """The rows `index` of every tensor (and per-row list) field."""
        rows = list(range(self.batch_size))[index] if isinstance(index, slice) else index.tolist()
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = value[index]
            elif isinstance(value, list) and len(value) == self.batch_size:
                changes[f.name] = [value[i] for i in rows]
            elif isinstance(value, dict):  # per-row columns
                changes[f.name] = {key: [column[i] for i in rows] for key, column in value.items()}
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> Self:
        changes = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **changes)


@dataclass(kw_only=True)
class Experience(Rollout):
    """A rollout with everything the update needs, complete: no field means "not computed yet"."""

    loss_mask: Tensor  # (B, T) bool: response_mask, less truncated responses when they are masked
    old_logprobs: Tensor  # (B, T) float32, the sampling policy's log-probs
    advantages: Tensor  # (B, T) float32
    ref_logprobs: Tensor | None = None  # (B, T) float32; None: no reference model (kl_coef 0)
    kl: Tensor | None = None  # (B, T) float32, per-token KL to the reference at sampling time; None: no reference
    values: Tensor | None = None  # (B, T) float32, critic at sampling time; None: no critic
    returns: Tensor | None = None  # (B, T) float32, GAE returns; None: no critic


def split_rows(batch_size: int, chunk_size: int) -> list[slice]:
    """Consecutive row slices of `chunk_size` covering range(batch_size)."""
    return [slice(start, min(start + chunk_size, batch_size)) for start in range(0, batch_size, chunk_size)]


def iterate_minibatches(
    experience: Experience, minibatch_size: int, generator: torch.Generator | None = None, shuffle: bool = True
) -> Iterator[Experience]:
    """Minibatches of `minibatch_size` rows; a random permutation first when `shuffle`."""
    n = experience.batch_size
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for rows in split_rows(n, minibatch_size):
        yield experience.select(order[rows].to(experience.response_ids.device))
