"""The loss of one micro-batch: clipped policy loss + vf_coef * value loss (+ kl_coef * KL when it is in the
loss) - entropy_coef * entropy, with its statistics.

Every term is normalised by its *minibatch's* totals (`MinibatchTotals`), so the losses of a minibatch's
micro-batches add up exactly to the loss of the whole minibatch (as veRL's `agg_loss` does), and so do the
token-share statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from lit_rlhf.algorithms import losses
from lit_rlhf.algorithms.experience import PolicyForward
from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.types import Experience


@dataclass(frozen=True)
class MinibatchTotals:
    """What a micro-batch's loss is normalised by: its minibatch's totals."""

    tokens: Tensor  # () float: valid loss tokens of the minibatch, at least 1
    sequences: int  # rows of the minibatch
    max_new_tokens: int  # the constant length of Dr.GRPO's `seq_mean_token_sum_norm`

    @classmethod
    def of(cls, minibatch: Experience, max_new_tokens: int) -> MinibatchTotals:
        return cls(minibatch.loss_mask.sum().clamp(min=1), minibatch.batch_size, max_new_tokens)


def ppo_objective(
    current: PolicyForward, mb: Experience, algo: AlgorithmConfig, totals: MinibatchTotals
) -> tuple[Tensor, dict[str, float]]:
    """The loss of micro-batch `mb` under the current policy's forward, and its statistics (each this
    micro-batch's share of the minibatch value, so they add up over micro-batches).

    For the exact KL (`kl_estimator: full`) in the loss, `current` is a forward given the reference's (it holds
    the KL).
    """
    mask = mb.loss_mask

    def aggregate(per_token: Tensor) -> Tensor:
        return losses.aggregate_loss(
            per_token, mask, algo.loss_aggregation, totals.tokens, totals.sequences, totals.max_new_tokens
        )

    def token_share(per_token: Tensor) -> float:
        return float(losses.masked_sum(per_token.detach().float(), mask) / totals.tokens)

    policy_tokens, stats = policy_term(current, mb, algo, token_share)
    policy_loss = aggregate(policy_tokens)
    loss = policy_loss
    stats["policy/loss"] = float(policy_loss.detach())
    if current.values is not None:
        if mb.values is None or mb.returns is None:
            raise ValueError("ppo_objective: a critic's loss needs the experience's values and returns")
        value_tokens, value_clipped = losses.clipped_value_loss(current.values, mb.values, mb.returns, algo.value_clip)
        value_loss = aggregate(value_tokens)
        loss = loss + algo.vf_coef * value_loss
        stats["value/loss"] = float(value_loss.detach())
        stats["value/clipfrac"] = token_share(value_clipped.float())
    if algo.uses_reference and not algo.kl_in_reward:
        estimator = algo.filled.kl_estimator
        kl_loss = aggregate(kl_to_reference(current, mb, estimator))
        loss = loss + algo.filled.kl_coef * kl_loss
        stats["policy/kl_loss"] = float(kl_loss.detach())
    entropy = current.entropy if algo.entropy_coef else current.entropy.detach()
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * aggregate(entropy)
    stats["objective/entropy"] = token_share(entropy)
    return loss, stats


def policy_term(
    current: PolicyForward, mb: Experience, algo: AlgorithmConfig, token_share: Callable[[Tensor], float]
) -> tuple[Tensor, dict[str, float]]:
    """The clipped policy loss per token (B, T), weighted by truncated importance sampling against the sampler
    when `algorithm.tis_cap` is set and the rollout kept the sampler's log-probs, and its statistics."""
    # the ratio at `ratio_level` (per token, or GSPO's per sequence), given as a log-ratio against a zero "old"
    mask = mb.loss_mask
    ratio_log = losses.policy_log_ratio(current.logprobs, mb.old_logprobs, mask, algo.ratio_level)
    policy_tokens, clipped = losses.clipped_policy_loss(
        ratio_log,
        ratio_log.new_zeros(()).expand_as(ratio_log),
        mb.advantages,
        algo.clip_eps_low,
        algo.filled.clip_eps_high,
        algo.dual_clip,
    )
    stats: dict[str, float] = {}
    if algo.tis_cap is not None and mb.sampler_logprobs is not None:  # another engine sampled: correct for it
        weight, capped = losses.truncated_importance_weight(mb.old_logprobs, mb.sampler_logprobs, algo.tis_cap)
        policy_tokens = policy_tokens * weight
        stats.update({"policy/tis_weight_mean": token_share(weight), "policy/tis_capped_frac": token_share(capped)})
    log_ratio = (current.logprobs - mb.old_logprobs).detach()
    stats["policy/clipfrac"] = token_share(clipped.float())
    stats["policy/approx_kl"] = token_share(0.5 * log_ratio**2)
    stats["policy/ratio_mean"] = token_share(ratio_log.detach().exp())
    return policy_tokens, stats


def kl_to_reference(current: PolicyForward, mb: Experience, estimator: str) -> Tensor:
    """Per-token KL of the current policy to the reference, differentiable: (B, T)."""
    if estimator == "full":
        if current.kl is None:
            raise ValueError("kl_to_reference: the exact KL needs a policy forward given the reference's")
        return current.kl
    if mb.ref_logprobs is None:
        raise ValueError("kl_to_reference: the experience has no reference log-probs")
    return losses.kl_from_logprobs(current.logprobs, mb.ref_logprobs, estimator)


__all__ = ["MinibatchTotals", "kl_to_reference", "policy_term", "ppo_objective"]
