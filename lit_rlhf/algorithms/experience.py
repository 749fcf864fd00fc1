"""A scored rollout becomes an `Experience`: the sampling policy's log-probs and values, the reference's
log-probs, the per-token KL, and the advantages.

Formulas (and their papers) are in `losses`; which advantages a setting gets is the table in `estimators`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms import estimators, losses
from lit_rlhf.algorithms.chunked_logprobs import HeadStats, head_stats
from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.forward import ResponseForward, causal_lm_response_forward
from lit_rlhf.types import Experience, Rollout


@dataclass
class PolicyForward:
    """The actor-critic's outputs on the response grid and what the loss reads of them (0 outside the response
    mask): the log-probs of the sampled tokens and the entropy at the sampling temperature, and, for a forward
    given the reference's, the exact KL to it and its log-probs."""

    response: ResponseForward  # the LM head's input (B, T, H) and the head
    values: Tensor | None  # (B, T) float32; None without a critic
    logprobs: Tensor  # (B, T) float32
    entropy: Tensor  # (B, T) float32
    kl: Tensor | None = None  # (B, T) float32, KL(pi || pi_ref) over the vocabulary; None: no reference given
    ref_logprobs: Tensor | None = None  # (B, T) float32; None: no reference given

    def detach(self) -> PolicyForward:
        def detached(x: Tensor | None) -> Tensor | None:
            return x.detach() if x is not None else None

        return PolicyForward(
            self.response.detach(),
            detached(self.values),
            self.logprobs.detach(),
            self.entropy.detach(),
            detached(self.kl),
            detached(self.ref_logprobs),
        )


def response_stats(
    forward: ResponseForward,
    rollout: Rollout,
    temperature: float,
    chunk_tokens: int | None,
    reference: ResponseForward | None = None,
    entropy: bool = True,
) -> HeadStats:
    """`chunked_logprobs.head_stats` of the rollout's response tokens: each valid token's log-prob, entropy and
    (with the reference's forward) exact KL and reference log-prob, on the (B, T) grid, 0 outside the response mask.
    Only the valid tokens go through the head."""
    mask = rollout.response_mask  # (B, T) bool
    ref = None if reference is None else (reference.head_inputs[mask], reference.head)
    stats = head_stats(
        forward.head_inputs[mask],  # (N, H)
        rollout.response_ids[mask],  # (N,)
        forward.head,
        temperature,
        ref,
        entropy,
        chunk_tokens,
    )

    def on_grid(values: Tensor | None) -> Tensor | None:
        if values is None:
            return None
        return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)

    return HeadStats(*(on_grid(getattr(stats, f.name)) for f in dataclasses.fields(stats)))  # type: ignore[arg-type]


def policy_forward(
    actor_critic: ActorCritic,
    rollout: Rollout,
    temperature: float,
    chunk_tokens: int | None,
    reference: ResponseForward | None = None,
) -> PolicyForward:
    """One actor-critic forward over prompt + response (with grad when grad is enabled); with the reference's
    forward, also the exact KL to it."""
    response, values = actor_critic(rollout.input_ids(), rollout.attention_mask(), rollout.response_ids.shape[1])
    stats = response_stats(response, rollout, temperature, chunk_tokens, reference)
    assert stats.entropy is not None
    return PolicyForward(response, values, stats.logprobs, stats.entropy, stats.kl, stats.ref_logprobs)


@torch.no_grad()
def frozen_forward(
    model: nn.Module, rollout: Rollout, share_prompts: bool = False, length_groups: int = 1
) -> ResponseForward:
    """A no-grad forward on the response grid of a model that does not train here: the reference, or the copy of
    the policy that sampled a stale rollout (`share_prompts`: each distinct prompt run once; `length_groups`: rows
    of similar response length apart, 0 after each group's longest response)."""
    response_len = rollout.response_ids.shape[1]
    return causal_lm_response_forward(
        model, rollout.input_ids(), rollout.attention_mask(), response_len, share_prompts, length_groups
    )


def compute_advantages(
    algo: AlgorithmConfig, scores: Tensor, kl: Tensor | None, values: Tensor | None, mask: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Advantages (B, T) and returns (B, T) or None, from the configured estimator of `estimators.ESTIMATORS`.

    scores (B,), kl (B, T) or None (it enters the reward only with `kl_in_reward`), values (B, T) or None,
    mask (B, T). The formulas and their papers are in `estimators` and `losses`.
    """
    inputs = estimators.AdvantageInputs(
        scores=scores,
        reward_kl=kl if algo.filled.kl_in_reward else None,
        kl_coef=algo.filled.kl_coef,
        kl_in_reward=algo.filled.kl_in_reward,
        values=values,
        mask=mask,
        group_size=algo.filled.group_size,
        gamma=algo.gamma,
        lam=algo.lam,
        whiten=algo.whiten_advantages,
        group_eps=algo.group_eps,
    )
    return algo.estimator.compute(inputs)


AdvantageFn = Callable[[Rollout, "Tensor | None", "Tensor | None"], "tuple[Tensor, Tensor | None]"]
"""(rollout, kl (B, T) or None, values (B, T) or None) -> advantages (B, T), returns (B, T) or None:
`RLHFModule.compute_advantages`."""


def make_experience(
    rollout: Rollout,
    algo: AlgorithmConfig,
    sampling_policy: PolicyForward,
    ref_logprobs: Tensor | None,
    advantages_of: AdvantageFn | None = None,
) -> Experience:
    """The complete experience of `rollout` from the sampling policy's (detached) forward and the reference's
    log-probs ((B, T), None without a reference or with the exact KL, which the policy's forward then holds with
    them). `advantages_of` replaces `compute_advantages` when given."""
    policy = sampling_policy.detach()
    kl = None
    if policy.kl is not None:  # the exact KL: the forward was given the reference's
        kl, ref_logprobs = policy.kl, policy.ref_logprobs
    elif ref_logprobs is not None:
        kl = losses.kl_from_logprobs(policy.logprobs, ref_logprobs, algo.filled.kl_estimator)
    if advantages_of is None:
        advantages, returns = compute_advantages(algo, rollout.scores, kl, policy.values, rollout.response_mask)
    else:
        advantages, returns = advantages_of(rollout, kl, policy.values)
    loss_mask = rollout.response_mask & ~(rollout.truncated[:, None] & algo.mask_truncated)
    if algo.entropy_top_fraction is not None:  # over the whole rollout, so every micro-batch sees the same tokens
        loss_mask = losses.top_entropy_mask(policy.entropy, loss_mask, algo.entropy_top_fraction)
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
    return Experience(
        **fields,
        loss_mask=loss_mask,
        old_logprobs=policy.logprobs,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        kl=kl,
        values=policy.values,
        returns=returns,
    )


def shaping_metrics(exp: Experience, algo: AlgorithmConfig, max_new_tokens: int) -> dict[str, float]:
    """Metrics of the settings that reshape scores or the loss mask (empty when none is on)."""
    metrics: dict[str, float] = {}
    if algo.overlong_buffer is not None:
        lengths = exp.response_mask.sum(1)
        penalty = losses.overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        metrics["rollout/overlong_penalty_mean"] = float(penalty.mean())
    if algo.entropy_top_fraction is not None:
        candidates = exp.response_mask & ~(exp.truncated[:, None] & algo.mask_truncated)
        metrics["policy/entropy_selected_frac"] = float(exp.loss_mask.sum() / candidates.sum().clamp(min=1))
    return metrics


SAMPLER_DIFF_THRESHOLD = 0.1
"""A token whose trainer and sampler log-probs differ by more than this (nats) counts in
`sampler/frac_diff_over_0.1`."""


def sampler_metrics(exp: Experience) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's (an engine of its own such as vLLM, or a stale copy
    of the policy with asynchronous rollouts): mean and max |log pi_old - log pi_sampler| over the policy's tokens,
    the share over `SAMPLER_DIFF_THRESHOLD`, and the importance weights pi_old / pi_sampler before any cap (mean,
    min, max); none with the synchronous in-process samplers, which are the trainer's model."""
    if exp.sampler_logprobs is None:
        return {}
    mask = exp.response_mask
    log_ratio = (exp.old_logprobs - exp.sampler_logprobs)[mask]
    if log_ratio.numel() == 0:
        return {}
    diff, weight = log_ratio.abs(), log_ratio.exp()
    return {
        "sampler/logprob_diff_mean": float(diff.mean()),
        "sampler/logprob_diff_max": float(diff.max()),
        f"sampler/frac_diff_over_{SAMPLER_DIFF_THRESHOLD}": float((diff > SAMPLER_DIFF_THRESHOLD).float().mean()),
        "sampler/is_weight_mean": float(weight.mean()),
        "sampler/is_weight_min": float(weight.min()),
        "sampler/is_weight_max": float(weight.max()),
    }
