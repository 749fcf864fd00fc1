"""Scores: reward functions (`functions`), reward models (`reward_model`), their weighted sum (`composer`),
and reward-model training on preference pairs (`training`)."""
