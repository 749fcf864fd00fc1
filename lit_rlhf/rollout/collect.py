"""One rollout: sample `group_size` responses per prompt with the current policy, decode and score them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.losses import overlong_penalty
from lit_rlhf.config import SamplingConfig
from lit_rlhf.rollout.generation import Generation, decode_responses, generate
from lit_rlhf.types import PromptBatch, Rollout

ScoreFn = Callable[[list[str], list[str], dict[str, list[Any]], Generation], Tensor]
"""(prompts, responses, meta, generation) -> (B,) scores: `RLHFModule.compute_scores`."""


@dataclass
class RolloutTimings:
    generate_s: float = 0.0
    score_s: float = 0.0


@dataclass
class Sampled:
    """Generated and decoded responses, not yet scored: B = B0 x G rows."""

    gen: Generation
    prompts: list[str]  # B prompt strings, each repeated G times
    responses: list[str]  # B decoded responses
    meta: dict[str, list[Any]]  # extra prompt columns, each a list of B

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
        )


@torch.no_grad()
def sample_responses(
    prompts: PromptBatch, policy: nn.Module, tokenizer: Any, group_size: int, sampling: SamplingConfig
) -> tuple[Sampled, RolloutTimings]:
    """Generate `group_size` responses per prompt (on the policy's device) and decode them (with the tokenizer,
    so in the calling thread). The timings hold the generation's seconds, and the decoding's as `score_s`."""
    timings = RolloutTimings()
    prompts = prompts.to(next(policy.parameters()).device)
    G = group_size
    start = time.perf_counter()
    gen = generate(policy, prompts, G, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    timings.generate_s = time.perf_counter() - start
    start = time.perf_counter()
    prompt_texts = [text for text in prompts.texts for _ in range(G)]
    meta = {key: [v for v in values for _ in range(G)] for key, values in prompts.meta.items()}
    responses = decode_responses(tokenizer, gen.response_ids, gen.response_mask)
    timings.score_s = time.perf_counter() - start
    return Sampled(gen, prompt_texts, responses, meta), timings


@torch.no_grad()
def final_scores(
    sampled: Sampled,
    score: ScoreFn,
    max_new_tokens: int,
    truncated_score: float | None = None,
    overlong: tuple[int, float] | None = None,
) -> Tensor:
    """(B,) float32 scores on the responses' device: `score`'s, then `truncated_score` for responses that hit the
    length limit (when given), then DAPO's over-long shaping `overlong` = (buffer, penalty) added to every score."""
    gen = sampled.gen
    scores = score(sampled.prompts, sampled.responses, sampled.meta, gen).to(gen.response_ids.device).float()
    if truncated_score is not None:
        scores = torch.where(gen.truncated, torch.full_like(scores, truncated_score), scores)
    if overlong is not None:
        scores = scores + overlong_penalty(gen.response_mask.sum(1), max_new_tokens, *overlong)
    return scores


def collect_rollout(
    prompts: PromptBatch,
    policy: nn.Module,
    tokenizer: Any,
    score: ScoreFn,
    group_size: int,
    sampling: SamplingConfig,
    truncated_score: float | None = None,
    policy_version: int = 0,
    overlong: tuple[int, float] | None = None,
) -> tuple[Rollout, RolloutTimings]:
    """Generate `group_size` responses per prompt (on the policy's device), decode and score them into a
    `Rollout`; responses that hit the length limit score `truncated_score` when it is given. `overlong`:
    (buffer, penalty) of DAPO's over-long shaping, added to every score after that."""
    sampled, timings = sample_responses(prompts, policy, tokenizer, group_size, sampling)
    start = time.perf_counter()
    scores = final_scores(sampled, score, sampling.max_new_tokens, truncated_score, overlong)
    timings.score_s += time.perf_counter() - start  # decoding and scoring
    return sampled.rollout(scores, policy_version), timings
