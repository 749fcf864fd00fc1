"""Advantage estimators as data: one table, `ESTIMATORS`, from the name `algorithm.advantage_estimator` takes to
an `Estimator`, i.e. the function that computes the advantages and the facts about it the settings checks read.

Adding an estimator is one function of `AdvantageInputs` plus one entry in `ESTIMATORS`: the config accepts the
name, the group-size, dynamic-sampling and multi-turn checks read its declarations, and
`experience.compute_advantages` calls it (docs/design.md, "Adding an advantage estimator";
tests/unit/test_estimator_table.py checks every entry's declarations on real numbers).

Pure like `losses`, whose formulas the functions here only combine: nothing imports configs, models or
Lightning. Shapes: B = sequences, T = response length, G = group size; `mask` is True on valid response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_rlhf.algorithms import losses

TokenWalk = Literal["never", "when_discounted", "always"]
"""How an estimator's advantage depends on a token's place in the response grid: 'never' (one advantage per
sequence, broadcast over its tokens), 'when_discounted' (a return discounted along the grid: position matters
only with gamma < 1), 'always' (a recursion through every position, e.g. GAE's lambda and value bootstrap)."""

Advantages = tuple[Tensor, "Tensor | None"]
"""advantages (B, T), returns (B, T) or None (the value head's target; only an estimator with a critic)."""


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read: the rollout's numbers and the settings that shape them."""

    scores: Tensor  # (B,) one score per response; rows g*G .. g*G+G-1 answer one prompt
    reward_kl: Tensor | None  # (B, T) the per-token KL that enters the reward; None: no KL term in the reward
    kl_coef: float  # beta, the weight of `reward_kl`
    kl_in_reward: bool  # algorithm.kl_in_reward (True even when no KL was computed, e.g. kl_coef 0)
    values: Tensor | None  # (B, T) float32 critic values; None without a critic
    mask: Tensor  # (B, T) bool, True on valid response tokens
    group_size: int  # G
    gamma: float  # discount along the grid
    lam: float  # GAE's lambda
    whiten: bool  # algorithm.whiten_advantages (GAE only; REINFORCE++ always whitens)
    group_eps: float  # added to the std in group normalisation

    def token_rewards(self, scores: Tensor | None = None) -> Tensor:
        """(B, T) per-token rewards: -beta * KL on valid tokens (when the KL is in the reward), plus the score
        (`scores`, default the rollout's) on each row's last valid token; `losses.token_rewards`."""
        maskf = self.mask.float()
        kl = self.reward_kl if self.reward_kl is not None else torch.zeros_like(maskf)
        return losses.token_rewards(self.scores if scores is None else scores, kl, self.mask, self.kl_coef)


AdvantageFn = Callable[[AdvantageInputs], Advantages]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: how it computes, and what the settings checks need to know about it."""

    compute: AdvantageFn
    """A pure function of `AdvantageInputs` -> advantages (B, T) (0 outside the mask), returns (B, T) or None."""
    needs_critic: bool
    """It reads `values` (raises without them) and returns the value head's targets; the module then trains a
    value head (`AlgorithmConfig.uses_critic`)."""
    min_group_size: int
    """The fewest responses per prompt it works with; `AlgorithmConfig` refuses a smaller `group_size`."""
    zeroes_tied_groups: bool
    """A group whose G scores are all exactly equal gets exactly zero advantage on every token (with no KL in the
    reward), whatever the other groups hold. Dynamic sampling drops tied groups, so it needs this."""
    walks_token_grid: TokenWalk
    """See `TokenWalk`. Multi-turn rollouts put environment tokens between the policy's, so an estimator that
    walks the grid is refused there ('when_discounted': unless gamma == 1)."""


# ----------------------------------------------------------------------------- the estimators


def gae(inputs: AdvantageInputs) -> Advantages:
    """PPO's generalised advantage estimation ([Schulman et al. 2015](https://arxiv.org/abs/1506.02438)) on the
    token rewards with the critic's values, then whitened over the valid tokens of the batch (`whiten`); the
    returns, taken before whitening, are the value head's targets."""
    rewards = inputs.token_rewards()  # (B, T)
    if inputs.values is None:
        raise ValueError("compute_advantages: GAE needs the critic's values")
    advantages, returns = losses.gae_advantages(rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)
    if inputs.whiten:
        advantages = losses.masked_whiten(advantages, inputs.mask)
    return advantages, returns


def _group_normalised(inputs: AdvantageInputs, kind: str) -> Advantages:
    """`losses.group_advantages` of kind `kind` on the scores (or, with the KL in the reward, on the KL-penalised
    sequence rewards s - beta * sum_t KL_t), broadcast over each response's valid tokens."""
    rewards = inputs.token_rewards()  # (B, T)
    seq_scores = rewards.sum(dim=1) if inputs.kl_in_reward else inputs.scores.float()  # (B,)
    per_seq = losses.group_advantages(seq_scores, inputs.group_size, kind, inputs.group_eps)  # (B,)
    return per_seq[:, None] * inputs.mask.float(), None


def grpo(inputs: AdvantageInputs) -> Advantages:
    """GRPO ([Shao et al. 2024, DeepSeekMath](https://arxiv.org/abs/2402.03300)): (s - group mean) / (group std +
    eps), the unbiased group std."""
    return _group_normalised(inputs, "grpo")


def batch_std(inputs: AdvantageInputs) -> Advantages:
    """(s - group mean) / (std over the whole batch + eps)."""
    return _group_normalised(inputs, "batch_std")


def dr_grpo(inputs: AdvantageInputs) -> Advantages:
    """Dr. GRPO ([Liu et al. 2025](https://arxiv.org/abs/2503.20783)): s - group mean, no std division."""
    return _group_normalised(inputs, "dr_grpo")


def rloo(inputs: AdvantageInputs) -> Advantages:
    """RLOO ([Ahmadian et al. 2024](https://arxiv.org/abs/2402.14740)): s - the mean of the other G-1 scores of
    the group."""
    return _group_normalised(inputs, "rloo")


def reinforce_pp(inputs: AdvantageInputs) -> Advantages:
    """REINFORCE++ ([Hu 2025](https://arxiv.org/abs/2501.03262)): the discounted returns of the token rewards,
    whitened over the valid tokens of the batch; no critic, no group (works with G = 1)."""
    rewards = inputs.token_rewards()
    return losses.reinforce_pp_advantages(rewards, inputs.mask, inputs.gamma), None


def reinforce_pp_baseline(inputs: AdvantageInputs) -> Advantages:
    """REINFORCE++-baseline ([Hu 2025](https://arxiv.org/abs/2501.03262)): as `reinforce_pp`, from the scores
    minus their group mean (0 for a tied group, before the batch whitening)."""
    centred = losses.group_advantages(inputs.scores, inputs.group_size, "dr_grpo")  # (B,) s - group mean
    rewards = inputs.token_rewards(centred)
    return losses.reinforce_pp_advantages(rewards, inputs.mask, inputs.gamma), None


def _group_estimator(compute: AdvantageFn) -> Estimator:
    return Estimator(compute, needs_critic=False, min_group_size=2, zeroes_tied_groups=True, walks_token_grid="never")


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae, needs_critic=True, min_group_size=1, zeroes_tied_groups=False, walks_token_grid="always"),
    "grpo": _group_estimator(grpo),
    "batch_std": _group_estimator(batch_std),
    "dr_grpo": _group_estimator(dr_grpo),
    "rloo": _group_estimator(rloo),
    "reinforce_pp": Estimator(
        reinforce_pp, needs_critic=False, min_group_size=1, zeroes_tied_groups=False, walks_token_grid="when_discounted"
    ),
    "reinforce_pp_baseline": Estimator(
        reinforce_pp_baseline,
        needs_critic=False,
        min_group_size=2,
        zeroes_tied_groups=False,  # the batch whitening shifts a tied group's zeros by the batch mean
        walks_token_grid="when_discounted",
    ),
}
"""`algorithm.advantage_estimator` -> its `Estimator`: the one list of estimators."""
