"""The algorithms: pure tensor formulas (`losses`), rollout -> experience (`experience`), and the loss of one
micro-batch (`objective`). PPO, GRPO and their variants are settings of this one code path."""
