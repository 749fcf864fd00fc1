"""Held-out evaluation with an environment: held-out prompts are answered in conversations with it, as
training rollouts are (with `val_sampling` and `val_samples_per_prompt`), so `val/reward_mean` includes the
environment's rewards and metric functions see the whole conversation."""

from __future__ import annotations

from lit_rlhf.models.actor_critic import eval_mode
from lit_rlhf.rollout.multi_turn import MultiTurnCollector
from lit_rlhf.training.evaluation import HeldOutEvaluation
from lit_rlhf.types import PromptBatch, Rollout


class MultiTurnEvaluation(HeldOutEvaluation):
    """`HeldOutEvaluation` whose answers are conversations when the module has a `multi_turn` collector."""

    multi_turn: MultiTurnCollector | None

    def answer(self, prompts: PromptBatch) -> Rollout:
        if self.multi_turn is None:
            return super().answer(prompts)
        with eval_mode(self.actor_critic):
            rollout, _ = self.multi_turn.collect(
                prompts,
                self.actor_critic.policy,
                self.tokenizer,
                self.compute_scores,
                self.val_samples_per_prompt,
                self.val_sampling,
            )
        return rollout
