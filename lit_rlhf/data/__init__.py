"""Prompts in: sources (files, lists, built-in tasks), tokenisation, and the rollout DataModule."""
