"""Sampling and scoring: the lean KV-cache sampler, the generation backends, and `collect_rollout`."""
