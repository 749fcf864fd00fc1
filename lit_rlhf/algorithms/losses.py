"""Pure tensor functions for PPO and GRPO: masks, KL estimators, advantages and losses.

Nothing here knows about configs, models or Lightning; only torch is imported.
Shapes: B = sequences, T = response length, G = group size. What comes from the logits (log-probs, entropy, the
exact KL) is computed in `chunked_logprobs`.
Every per-token tensor is on the (B, T) response grid and `mask` is True on valid response tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

GROUP_ESTIMATORS = ("grpo", "batch_std", "dr_grpo", "rloo")
RATIO_LEVELS = ("token", "sequence", "sequence_token")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


# ----------------------------------------------------------------------------- masked statistics


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is True (over all elements, or along `dim`)."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over masked-in elements; 0 where nothing is masked in (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over all masked-in elements (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(x, mask)
    count = mask.sum()
    sq = masked_sum((x - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `x` to unit variance (and zero mean if `shift_mean`) over masked-in elements.

    Positions outside the mask are returned as 0.
    """
    mean = masked_mean(x, mask)
    # rsqrt(var + eps) keeps the float rounding of an all-equal input near 0 instead of amplifying it
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


# ----------------------------------------------------------------------------- KL


def kl_from_logprobs(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs: (B, T) -> (B, T).

    With d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 (>= 0).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(
        f"unknown sampled KL estimator {estimator!r}; choose one of k1, k2, k3 (the exact KL: chunked_logprobs)"
    )


# ----------------------------------------------------------------------------- advantages


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last True position per row: (B, T) -> (B,); 0 for an all-False row."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(dim=1)


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """PPO per-token rewards: -kl_coef * KL on every valid token, plus the score on the last one.

    scores (B,), kl (B, T), mask (B, T) -> (B, T); zero outside the mask.
    """
    rewards = torch.where(mask.bool(), -kl_coef * kl, torch.zeros_like(kl)).float()
    has_tokens = mask.bool().any(dim=1)
    last = last_token_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.where(has_tokens, scores.float(), torch.zeros_like(scores, dtype=torch.float32))
    return rewards


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response grid.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last valid token is 0),
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t.
    rewards, values, mask: (B, T) -> advantages (B, T), returns (B, T); both zero outside the mask.
    Masked positions are assumed to come after all valid ones in each row (right padding).
    """
    maskf = mask.float()
    values = torch.where(mask.bool(), values.float(), 0.0)  # where, not *, so padding garbage cannot leak
    rewards = torch.where(mask.bool(), rewards.float(), 0.0)
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # a masked position contributes nothing and passes nothing back
        advantage = advantage * maskf[:, t]
        advantages[:, t] = advantage
        next_advantage = advantage
        next_value = values[:, t]
    returns = (advantages + values) * maskf
    return advantages, returns


def group_advantages(scores: Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-sequence advantages from scores of G samples per prompt: (B,) -> (B,).

    Rows b*G .. b*G+G-1 belong to one prompt. Estimators:
      grpo       (s - group mean) / (group std + eps)
      batch_std  (s - group mean) / (std over the whole batch + eps)
      dr_grpo    s - group mean (no std division)
      rloo       s - mean of the other G-1 scores of the group
    A group whose scores are all equal gets zero advantage.
    """
    if scores.shape[0] % group_size != 0:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    grouped = scores.float().view(-1, group_size)  # (B/G, G)
    mean = grouped.mean(dim=1, keepdim=True)
    # The float mean of equal scores need not equal them (8 x 0.1 -> 0.1 - 7e-9), and dividing that residue by
    # a ~0 std gives a spurious advantage; an all-equal group is therefore zeroed exactly.
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(all_equal, torch.zeros_like(grouped), grouped - mean)
    if estimator == "grpo":
        std = grouped.std(dim=1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(mean)
        out = centred / (std + eps)
    elif estimator == "batch_std":
        std = scores.float().std(unbiased=True) if scores.numel() > 1 else scores.new_zeros(())
        out = centred / (std + eps)
    elif estimator == "dr_grpo":
        out = centred
    elif estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs a group size of at least 2")
        out = centred * group_size / (group_size - 1)
    else:
        raise ValueError(f"unknown group advantage estimator {estimator!r}; choose one of {GROUP_ESTIMATORS}")
    return out.reshape(-1)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over each row's valid tokens (0 after the last one): (B, T) -> (B, T).

    Zero outside the mask; masked positions are assumed to come after all valid ones (right padding).
    """
    rewards = torch.where(mask.bool(), rewards.float(), 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(mask.bool(), returns, 0.0)


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ ([Hu 2025](https://arxiv.org/abs/2501.03262)): the discounted returns of the token rewards,
    whitened over the valid tokens of the whole batch (no critic, no group): (B, T) -> (B, T), 0 outside the mask.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft over-long punishment ([Yu et al. 2025](https://arxiv.org/abs/2503.14476), eq. 13): (B,) -> (B,).

    0 for lengths <= max_len - buffer, then falling linearly to -penalty at max_len (and staying there beyond).
    """
    excess = (lengths.float() - (max_len - buffer)) / buffer
    return -penalty * excess.clamp(min=0.0, max=1.0)


def top_entropy_mask(entropy: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """The highest-entropy `fraction` of the valid tokens ([Wang et al. 2025](https://arxiv.org/abs/2506.01939)).

    entropy, mask (B, T) -> (B, T) bool: mask & (entropy >= the k-th largest valid entropy), k = ceil(fraction * n)
    of the n valid tokens of the whole tensor; every token tied with the k-th is kept. All False when n = 0.
    """
    valid = entropy[mask.bool()]  # (n,)
    if valid.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    k = max(1, math.ceil(fraction * valid.numel() - 1e-9))
    threshold = torch.topk(valid.float(), k).values[-1]
    return mask.bool() & (entropy.float() >= threshold)


# ----------------------------------------------------------------------------- losses


def policy_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """The log of the importance ratio on every token: (B, T) x3 -> (B, T).

    token           log pi - log pi_old                                                    (PPO)
    sequence        log s_i = mean over row i's valid tokens of (log pi - log pi_old), on every token
                    (GSPO, [Zheng et al. 2025](https://arxiv.org/abs/2507.18071), eq. 7)
    sequence_token  sg[log s_i] + log pi - sg[log pi]: the value of log s_i, each token's own gradient (GSPO-token)
    A row without valid tokens has log s_i = 0.
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    seq = masked_mean(log_ratio, mask, dim=1)[:, None].expand_as(log_ratio)  # (B, T)
    if level == "sequence":
        return seq
    if level == "sequence_token":
        return seq.detach() + logprobs - logprobs.detach()
    raise ValueError(f"unknown ratio level {level!r}; choose one of {RATIO_LEVELS}")


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    With `dual_clip` = c > 1, the loss of tokens with A < 0 is capped at -c * A.
    All inputs (B, T) -> (per-token loss (B, T), clipped (B, T) bool: the clipped branch was taken).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    was_clipped = clipped_term > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        negative = advantages < 0
        capped = negative & (loss > cap)
        loss = torch.where(capped, cap, loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Value loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    With `clip` None it is the plain 0.5 * (V - R)^2. (B, T) -> (per-token loss, clipped bool).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens; scalar (0-dim)."""
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    return 1.0 - var_residual / var_returns.clamp(min=1e-8)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    total_tokens: float | Tensor | None = None,
    total_sequences: float | None = None,
    max_response_len: int | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token_mean               sum over valid tokens / total_tokens
    seq_mean_token_mean      sum over sequences of (mean over the sequence's tokens) / total_sequences
    seq_mean_token_sum_norm  sum over valid tokens / (max_response_len * total_sequences)   (Dr.GRPO)

    `total_tokens` and `total_sequences` are the counts of the whole minibatch, so that summing the results
    of its micro-batches gives the minibatch's loss exactly. They default to this batch's own counts.
    """
    maskf = mask.float()
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        denom = maskf.sum() if total_tokens is None else total_tokens
        return per_token.sum() / torch.as_tensor(denom, dtype=torch.float32).clamp(min=1)
    n_seq = float(per_token.shape[0]) if total_sequences is None else float(total_sequences)
    if mode == "seq_mean_token_mean":
        per_seq = per_token.sum(1) / maskf.sum(1).clamp(min=1)
        return per_seq.sum() / max(n_seq, 1.0)
    if mode == "seq_mean_token_sum_norm":
        length = per_token.shape[1] if max_response_len is None else max_response_len
        return per_token.sum() / (length * max(n_seq, 1.0))
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")


def truncated_importance_weight(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling for a rollout sampled by another engine than the trainer's model (vLLM's
    kernels, or a stale copy): per token min(pi_old / pi_sampler, cap), no gradient. (B, T), (B, T) -> the weights
    (B, T) and where the cap bit (B, T) bool.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    https://fengyao.notion.site/off-policy-rl
    """
    ratio = torch.exp(old_logprobs.detach().float() - sampler_logprobs.float())
    return ratio.clamp(max=cap), ratio > cap
