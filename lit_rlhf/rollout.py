"""One rollout: generate, score, evaluate, advantages. The only place PPO and GRPO branch.

`collect_experience` turns a `PromptBatch` into an `Experience`, all under no_grad.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf import losses
from lit_rlhf.config import AlgorithmConfig, SamplingConfig
from lit_rlhf.models import ActorCritic, causal_lm_response_forward
from lit_rlhf.rewards import RewardComposer, SequenceRewardModel
from lit_rlhf.types import Experience, PromptBatch


@dataclass
class Generation:
    """Sampled responses on the response grid."""

    prompt_ids: Tensor  # (B, P) left padded, each prompt repeated G times
    prompt_mask: Tensor  # (B, P)
    response_ids: Tensor  # (B, T) right padded with pad after the first EOS
    response_mask: Tensor  # (B, T) bool, up to and including the first EOS
    truncated: Tensor  # (B,) bool, no EOS within the limit


@dataclass
class RolloutTimings:
    generate_s: float = 0.0
    score_s: float = 0.0
    evaluate_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def response_mask_from_ids(response_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """(B, T) ids -> mask (B, T) bool up to and including the first EOS, truncated (B,) bool."""
    is_eos = response_ids == eos_token_id
    eos_seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # an EOS strictly earlier
    mask = ~eos_seen_before
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


@torch.no_grad()
def generate(
    policy: nn.Module,
    prompts: PromptBatch,
    group_size: int,
    sampling: SamplingConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample `group_size` responses per prompt (KV cache, stops at EOS).

    `sampling.backend` 'lean' runs `lit_rlhf.sampling.lean_generate` (it alone uses `generator`; None: the
    global RNG); 'generate' runs Hugging Face `generate` (global RNG).
    """
    if sampling.backend == "lean":
        from lit_rlhf.sampling import lean_generate

        return lean_generate(policy, prompts, group_size, sampling, eos_token_id, pad_token_id, generator)
    from transformers import GenerationConfig

    prompt_ids = prompts.input_ids.repeat_interleave(group_size, dim=0)  # (B, P)
    prompt_mask = prompts.attention_mask.repeat_interleave(group_size, dim=0)  # (B, P)
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k if sampling.top_k > 0 else None,
        top_p=sampling.top_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    response_ids = out[:, prompt_ids.shape[1] :]  # (B, T)
    response_mask, truncated = response_mask_from_ids(response_ids, eos_token_id)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_token_id))
    return Generation(prompt_ids, prompt_mask, response_ids, response_mask, truncated)


def decode_responses(tokenizer: Any, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """Response texts up to (not including) the first EOS.

    Other special tokens the policy produced stay in the text, so a reward function sees exactly what was
    generated (skipping them would let a policy pad its answer with invisible tokens).
    """
    keep = response_mask & (response_ids != tokenizer.eos_token_id)
    rows = [ids[k].tolist() for ids, k in zip(response_ids.cpu(), keep.cpu())]
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


@torch.no_grad()
def evaluate_logprobs(
    actor_critic: ActorCritic,
    reference: nn.Module | None,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_ids: Tensor,
    temperature: float,
    full_kl: bool,
    policy_forward: bool = True,
) -> dict[str, Tensor | None]:
    """Old log-probs, values and reference log-probs (B, T); the exact KL (B, T) when `full_kl`.

    With `policy_forward` False the policy is not run: the update's own first forward supplies the old
    log-probs (valid only for a single pass over the rollout without a critic).
    """
    T = response_ids.shape[1]
    out: dict[str, Tensor | None] = {"old_logprobs": None, "values": None, "ref_logprobs": None, "full_kl": None}
    logits = None
    if policy_forward or full_kl:
        logits, out["values"] = actor_critic(input_ids, attention_mask, T)
        out["old_logprobs"] = losses.logprobs_from_logits(logits, response_ids, temperature)
    if reference is not None:
        ref_logits, _ = causal_lm_response_forward(reference, input_ids, attention_mask, T)
        out["ref_logprobs"] = losses.logprobs_from_logits(ref_logits, response_ids, temperature)
        if full_kl:
            out["full_kl"] = losses.full_kl_from_logits(logits, ref_logits, temperature)
    return out


def compute_advantages(
    algo: AlgorithmConfig,
    scores: Tensor,
    kl: Tensor | None,
    values: Tensor | None,
    mask: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Advantages (B, T), returns (B, T) or None, and per-sequence total reward (B,).

    PPO: token rewards = score at the last token - beta*KL (when the KL is in the reward), then GAE.
    GRPO family: group-normalised scores broadcast over the response tokens.
    """
    maskf = mask.float()
    kl_in_reward = kl if (kl is not None and algo.kl_in_reward) else torch.zeros_like(maskf)
    rewards = losses.token_rewards(scores, kl_in_reward, mask, algo.kl_coef)  # (B, T)
    total_reward = rewards.sum(dim=1)  # (B,)
    if algo.advantage_estimator == "gae":
        advantages, returns = losses.gae_advantages(rewards, values, mask, algo.gamma, algo.lam)
        if algo.whiten_advantages:
            advantages = losses.masked_whiten(advantages, mask)
        return advantages, returns, total_reward
    seq_scores = total_reward if algo.kl_in_reward else scores.float()
    per_seq = losses.group_advantages(seq_scores, algo.group_size, algo.advantage_estimator, algo.group_eps)
    return per_seq[:, None] * maskf, None, total_reward


def with_advantages(
    exp: Experience,
    algo: AlgorithmConfig,
    old_logprobs: Tensor | None,
    values: Tensor | None,
    full_kl: Tensor | None = None,
) -> Experience:
    """The rollout completed with its old log-probs (B, T), values (B, T), per-token KL and advantages.

    The KL is `full_kl` when given, else the sampled-token estimator of old against reference log-probs.
    Called by the rollout, or by the update on its own forward's detached outputs when the rollout left
    the advantages to it (`AlgorithmConfig.policy_forward_in_rollout`).
    """
    kl = full_kl
    if kl is None and exp.ref_logprobs is not None and old_logprobs is not None:
        kl = losses.kl_from_logprobs(old_logprobs, exp.ref_logprobs, algo.kl_estimator)
    advantages, returns, _ = compute_advantages(algo, exp.scores, kl, values, exp.response_mask)
    return dataclasses.replace(exp, old_logprobs=old_logprobs, values=values, kl=kl, advantages=advantages,
                               returns=returns)


@torch.no_grad()
def collect_experience(
    prompts: PromptBatch,
    actor_critic: ActorCritic,
    reference: nn.Module | None,
    reward_model: SequenceRewardModel | None,
    composer: RewardComposer,
    tokenizer: Any,
    algo: AlgorithmConfig,
    sampling: SamplingConfig,
    policy_version: int = 0,
) -> tuple[Experience, RolloutTimings]:
    """Generate, score and evaluate one batch of prompts into an `Experience`."""
    timings = RolloutTimings()
    device = next(actor_critic.parameters()).device
    prompts = prompts.to(device)
    G = algo.group_size

    start = time.perf_counter()
    gen = generate(actor_critic.policy, prompts, G, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    timings.generate_s = time.perf_counter() - start

    start = time.perf_counter()
    prompt_texts = [text for text in prompts.texts for _ in range(G)]
    meta = {key: [v for v in values for _ in range(G)] for key, values in prompts.meta.items()}
    responses = decode_responses(tokenizer, gen.response_ids, gen.response_mask)
    input_ids = torch.cat([gen.prompt_ids, gen.response_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([gen.prompt_mask, gen.response_mask.long()], dim=1)  # (B, P+T)
    last_index = gen.prompt_ids.shape[1] + losses.last_token_index(gen.response_mask)  # (B,) in the full sequence
    scores = composer(prompt_texts, responses, meta, reward_model, input_ids, attention_mask, last_index)
    scores = scores.to(device)
    if algo.truncated_score is not None:
        scores = torch.where(gen.truncated, torch.full_like(scores, algo.truncated_score), scores)
    timings.score_s = time.perf_counter() - start

    start = time.perf_counter()
    policy_forward = algo.policy_forward_in_rollout(gen.response_ids.shape[0])
    evaluated = evaluate_logprobs(
        actor_critic, reference, input_ids, attention_mask, gen.response_ids, sampling.temperature,
        full_kl=algo.kl_estimator == "full", policy_forward=policy_forward,
    )
    experience = Experience(
        prompt_ids=gen.prompt_ids,
        prompt_mask=gen.prompt_mask,
        response_ids=gen.response_ids,
        response_mask=gen.response_mask,
        loss_mask=gen.response_mask & ~(gen.truncated[:, None] & algo.mask_truncated),
        old_logprobs=None,
        advantages=None,
        scores=scores.float(),
        truncated=gen.truncated,
        ref_logprobs=evaluated["ref_logprobs"],
        prompts=prompt_texts,
        responses=responses,
        policy_version=policy_version,
    )
    if policy_forward or not algo.advantages_need_policy:
        experience = with_advantages(experience, algo, evaluated["old_logprobs"], evaluated["values"],
                                     evaluated["full_kl"])
    timings.evaluate_s = time.perf_counter() - start
    return experience, timings
