"""One rollout: sample `group_size` responses per prompt with the current policy, decode and score them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_rlhf.algorithms.losses import last_token_index
from lit_rlhf.config import AlgorithmConfig, SamplingConfig
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.reward_model import SequenceRewardModel
from lit_rlhf.rollout.generation import decode_responses, generate
from lit_rlhf.types import PromptBatch, Rollout


@dataclass
class RolloutTimings:
    generate_s: float = 0.0
    score_s: float = 0.0


@torch.no_grad()
def collect_rollout(
    prompts: PromptBatch,
    policy: nn.Module,
    tokenizer: Any,
    composer: RewardComposer,
    reward_model: SequenceRewardModel | None,
    algo: AlgorithmConfig,
    sampling: SamplingConfig,
    policy_version: int = 0,
) -> tuple[Rollout, RolloutTimings]:
    """Generate and score one batch of prompts (on the policy's device) into a `Rollout`."""
    timings = RolloutTimings()
    device = next(policy.parameters()).device
    prompts = prompts.to(device)
    G = algo.filled.group_size

    start = time.perf_counter()
    gen = generate(policy, prompts, G, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    timings.generate_s = time.perf_counter() - start

    start = time.perf_counter()
    prompt_texts = [text for text in prompts.texts for _ in range(G)]
    meta = {key: [v for v in values for _ in range(G)] for key, values in prompts.meta.items()}
    responses = decode_responses(tokenizer, gen.response_ids, gen.response_mask)
    input_ids = torch.cat([gen.prompt_ids, gen.response_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([gen.prompt_mask, gen.response_mask.long()], dim=1)  # (B, P+T)
    last_index = gen.prompt_ids.shape[1] + last_token_index(gen.response_mask)  # (B,) in the full sequence
    scores = composer(prompt_texts, responses, meta, reward_model, input_ids, attention_mask, last_index)
    scores = scores.to(device).float()
    if algo.truncated_score is not None:
        scores = torch.where(gen.truncated, torch.full_like(scores, algo.truncated_score), scores)
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
        policy_version=policy_version,
    )
    return rollout, timings
