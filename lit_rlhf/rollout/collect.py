"""Rollout collection: the contract every collector keeps (`Collector`: prompts and the policy version in, a
scored `Rollout` out), the settings bound to a collector once (`RolloutSettings`), and the single-turn collector:
sample `group_size` responses per prompt with a rollout backend, decode and score them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lit_rlhf.algorithms.losses import overlong_penalty
from lit_rlhf.config import AlgorithmConfig, SamplingConfig
from lit_rlhf.rewards.composer import one_part, reward_parts
from lit_rlhf.rollout.backends.base import RolloutBackend
from lit_rlhf.rollout.generation import EosIds, Generation, decode_responses
from lit_rlhf.types import PromptBatch, Rollout

ScoreFn = Callable[[list[str], list[str], dict[str, list[Any]], Generation], Tensor]
"""(prompts, responses, meta, generation) -> (B,) scores: `RLHFModule.compute_scores`."""


@dataclass(frozen=True)
class RolloutSettings:
    """What a collector does with every batch: `group_size` responses per prompt sampled with `sampling`, then
    `truncated_score` for responses that hit the length limit (None: keep the score) and DAPO's over-long shaping
    `overlong` = (buffer, penalty) (None: off)."""

    group_size: int
    sampling: SamplingConfig
    truncated_score: float | None = None
    overlong: tuple[int, float] | None = None

    @classmethod
    def training(cls, algo: AlgorithmConfig, sampling: SamplingConfig) -> RolloutSettings:
        """The training rollouts' settings: the algorithm's group size, truncation score and over-long shaping."""
        return cls(algo.filled.group_size, sampling, algo.truncated_score, algo.overlong)


@dataclass
class RolloutTimings:
    generate_s: float = 0.0
    score_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # the step's metrics from how the rollout was made


class Collector(Protocol):
    """Samples and scores a batch of prompts with the current policy (single-turn or multi-turn)."""

    def collect(self, prompts: PromptBatch, policy_version: int = 0) -> tuple[Rollout, RolloutTimings]: ...


@dataclass
class Sampled:
    """Generated and decoded responses, not yet scored: B = B0 x G rows."""

    gen: Generation
    prompts: list[str]  # B prompt strings, each repeated G times
    responses: list[str]  # B decoded responses
    meta: dict[str, list[Any]]  # extra prompt columns, each a list of B
    reward_parts: Tensor | None = None  # (B, F) each reward function's scores, once scored (`Rollout.reward_parts`)

    def rollout(self, scores: Tensor, policy_version: int) -> Rollout:
        gen = self.gen
        return Rollout(
            prompt_ids=gen.prompt_ids,
            prompt_mask=gen.prompt_mask,
            response_ids=gen.response_ids,
            response_mask=gen.response_mask,
            truncated=gen.truncated,
            scores=scores,
            prompts=self.prompts,
            responses=self.responses,
            meta=self.meta,
            policy_version=policy_version,
            sampler_logprobs=gen.logprobs,
            reward_parts=self.reward_parts,
        )


def repeat_rows(prompts: PromptBatch, group_size: int) -> tuple[list[str], dict[str, list[Any]]]:
    """The prompt texts and extra columns of `prompts`, each row repeated `group_size` times (B = B0 x G)."""
    texts = [text for text in prompts.texts for _ in range(group_size)]
    meta = {key: [v for v in values for _ in range(group_size)] for key, values in prompts.meta.items()}
    return texts, meta


@dataclass
class SingleTurnCollector:
    """One response per sample: `backend` generates, the tokenizer decodes (in the calling thread: it is not
    thread-safe) up to the first of the stop ids `eos_token_id` (the backend's; None: the tokenizer's own,
    `stop_token_ids(tokenizer)`), `score` scores, then the settings' truncation score and over-long shaping apply."""

    backend: RolloutBackend
    tokenizer: Any
    score: ScoreFn
    settings: RolloutSettings
    eos_token_id: EosIds | None = None

    @torch.no_grad()
    def sample(self, prompts: PromptBatch) -> tuple[Sampled, RolloutTimings]:
        """Generate and decode; the timings hold the generation's seconds, and the decoding's as `score_s`."""
        timings = RolloutTimings()
        start = time.perf_counter()
        gen = self.backend.generate(prompts, self.settings.group_size, self.settings.sampling)
        timings.generate_s = time.perf_counter() - start
        start = time.perf_counter()
        texts, meta = repeat_rows(prompts, self.settings.group_size)
        responses = decode_responses(self.tokenizer, gen.response_ids, gen.response_mask, self.eos_token_id)
        timings.score_s = time.perf_counter() - start
        return Sampled(gen, texts, responses, meta), timings

    @torch.no_grad()
    def final_scores(self, sampled: Sampled) -> Tensor:
        """(B,) float32 scores on the responses' device: `score`'s, then `truncated_score` for responses that hit
        the length limit (when set), then the over-long shaping (when on) added to every score. Each reward
        function's own scores are kept as `sampled.reward_parts`."""
        gen, settings = sampled.gen, self.settings
        with reward_parts() as parts:
            scores = self.score(sampled.prompts, sampled.responses, sampled.meta, gen)
        scores, sampled.reward_parts = scores.to(gen.response_ids.device).float(), one_part(parts)
        if settings.truncated_score is not None:
            scores = torch.where(gen.truncated, torch.full_like(scores, settings.truncated_score), scores)
        if settings.overlong is not None:
            lengths, max_new_tokens = gen.response_mask.sum(1), settings.sampling.max_new_tokens
            scores = scores + overlong_penalty(lengths, max_new_tokens, *settings.overlong)
        return scores

    def collect(self, prompts: PromptBatch, policy_version: int = 0) -> tuple[Rollout, RolloutTimings]:
        sampled, timings = self.sample(prompts)
        start = time.perf_counter()
        scores = self.final_scores(sampled)
        timings.score_s += time.perf_counter() - start  # decoding and scoring
        return sampled.rollout(scores, policy_version), timings
