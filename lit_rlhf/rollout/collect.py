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


@torch.no_grad()
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
    timings = RolloutTimings()
    device = next(policy.parameters()).device
    prompts = prompts.to(device)
    G = group_size

    start = time.perf_counter()
    gen = generate(policy, prompts, G, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    timings.generate_s = time.perf_counter() - start

    start = time.perf_counter()
    prompt_texts = [text for text in prompts.texts for _ in range(G)]
    meta = {key: [v for v in values for _ in range(G)] for key, values in prompts.meta.items()}
    responses = decode_responses(tokenizer, gen.response_ids, gen.response_mask)
    scores = score(prompt_texts, responses, meta, gen).to(device).float()
    if truncated_score is not None:
        scores = torch.where(gen.truncated, torch.full_like(scores, truncated_score), scores)
    if overlong is not None:
        scores = scores + overlong_penalty(gen.response_mask.sum(1), sampling.max_new_tokens, *overlong)
    timings.score_s = time.perf_counter() - start
    rollout = Rollout(
        prompt_ids=gen.prompt_ids,
        prompt_mask=gen.prompt_mask,
        response_ids=gen.response_ids,
        response_mask=gen.response_mask,
        truncated=gen.truncated,
        scores=scores,
        prompts=prompt_texts,
        responses=responses,
        meta=meta,
        policy_version=policy_version,
    )
    return rollout, timings
