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
    """Tokenised prompts, left padded so every prompt ends at column P-1.

    Attributes:
        input_ids: (B0, P) long.
        attention_mask: (B0, P) long, 0 on left padding.
        texts: B0 prompt strings.
        meta: extra dataset columns, each a list of B0.
        position: rows of this rank's prompt stream consumed up to and including this batch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    texts: list[str]
    meta: dict[str, list[Any]] = field(default_factory=dict)
    position: int = 0

    def to(self, device: torch.device | str) -> PromptBatch:
        return dataclasses.replace(
            self, input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device)
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(kw_only=True)
class Rollout:
    """What sampling and scoring produce: responses on the (B, T) response grid and one score each.

    Attributes:
        prompt_ids: (B, P) long, left padded, each prompt repeated G times.
        prompt_mask: (B, P) long.
        response_ids: (B, T) long, right padded with pad after the first EOS.
        response_mask: (B, T) bool: first response token up to and including the first EOS.
        truncated: (B,) bool, no EOS within max_new_tokens.
        scores: (B,) float32, sequence scores after truncation handling.
        prompts: B prompt strings (each repeated G times).
        responses: B decoded responses.
        meta: extra prompt columns, each a list of B.
        policy_version: number of optimizer updates the sampling policy had seen.
        context_mask: (B, T) bool: response tokens that are attended but not the policy's (a multi-turn
            environment's); None: none.
        sampler_logprobs: (B, T) float32: the rollout backend's own log-probs of the sampled tokens (0
            elsewhere), kept when it runs a model of its own (vLLM) for the mismatch metrics and
            `algorithm.tis_cap`; None: the in-process samplers, whose log-probs are the trainer's by
            construction.
        reward_parts: (B, F) float32: each reward function's own score (columns in `reward_fns` order, before
            weighting and truncation handling), for the per-function metrics; None: no reward functions, or a
            `compute_scores` override that does not call the composer.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    truncated: Tensor
    scores: Tensor
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    policy_version: int = 0
    context_mask: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    reward_parts: Tensor | None = None

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
    """A rollout with everything the update needs, complete: no field means "not computed yet".

    Attributes:
        loss_mask: (B, T) bool: response_mask, less truncated responses when they are masked.
        old_logprobs: (B, T) float32, the sampling policy's log-probs.
        advantages: (B, T) float32.
        ref_logprobs: (B, T) float32; None: no reference model (kl_coef 0).
        kl: (B, T) float32, per-token KL to the reference at sampling time; None: no reference.
        values: (B, T) float32, critic at sampling time; None: no critic.
        returns: (B, T) float32, GAE returns; None: no critic.
    """

    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    ref_logprobs: Tensor | None = None
    kl: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None


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
