"""Reward functions and an optional reward model, combined with weights into one (B,) score per response."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.functions import RewardError, RewardFn, call_reward_fn
from lit_rlhf.rewards.reward_model import SequenceRewardModel


class RewardComposer:
    """Weighted sum of reward functions and an optional reward model -> (B,) scores."""

    def __init__(
        self,
        reward_fns: Sequence[RewardFn] = (),
        weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
    ):
        self.reward_fns = list(reward_fns)
        if weights is None:
            weights = [1.0] * len(self.reward_fns)
        if len(weights) != len(self.reward_fns):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(self.reward_fns)} reward functions; "
                "give one weight per function"
            )
        self.weights = [float(w) for w in weights]
        self.reward_model_weight = reward_model_weight
        self.nan_score = nan_score

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        meta: dict[str, list[Any]],
        reward_model: SequenceRewardModel | None = None,
        sequence_ids: Tensor | None = None,
        sequence_mask: Tensor | None = None,
        last_index: Tensor | None = None,
    ) -> Tensor:
        """(B,) float32 scores on CPU. The reward model reads `sequence_ids` at `last_index` when it
        shares the policy tokenizer, else the prompt+response texts."""
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for fn, weight in zip(self.reward_fns, self.weights, strict=True):
            total += weight * call_reward_fn(fn, prompts, responses, meta, self.nan_score)
        if reward_model is not None:
            if sequence_ids is None:
                raise ValueError("RewardComposer: a reward model needs sequence_ids (the policy's token ids)")
            if reward_model.tokenizer is None:
                if sequence_mask is None or last_index is None:
                    raise ValueError(
                        "RewardComposer: a reward model that shares the policy's tokenizer needs "
                        "sequence_mask and last_index"
                    )
                rm_scores = reward_model.score_ids(sequence_ids, sequence_mask, last_index)
            else:
                texts = [p + r for p, r in zip(prompts, responses, strict=True)]
                rm_scores = reward_model.score_texts(texts, sequence_ids.device)
            total += self.reward_model_weight * rm_scores.cpu()
        if not math.isfinite(float(total.sum())):
            raise RewardError("the combined reward is not finite; check the reward model's outputs")
        return total
