"""Tasks: prompt sets, rule rewards and tiny local models for examples and tests.

Nothing in the rest of the package imports from here: `builtin:<name>` settings find a task through the
`lit_rlhf.tasks` entry points (`lit_rlhf.registry`), and reward functions are named by dotted path
(`lit_rlhf.tasks.digits.sort_digits_reward`).

- `digits`: sort a short string of digits (the offline default: tokenizer, GPT-2, prompts, reward, preferences).
- `chat`: reward functions and prompt sets for real chat models (VADER sentiment, arithmetic).
"""
