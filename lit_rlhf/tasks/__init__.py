"""Tasks: prompt sets, rule rewards and tiny local models for examples and tests.

Nothing in the rest of the package imports from here: `builtin:<name>` settings find a task through the
`lit_rlhf.tasks` entry points (`lit_rlhf.registry`), and reward functions are named by dotted path
(`lit_rlhf.tasks.digits.sort_digits_reward`).

- `digits`: sort a short string of digits (the offline default: tokenizer, GPT-2, prompts, reward, preferences).
- `chat`: the VADER sentiment reward and its prompt set for real chat models.
- `arithmetic`, `word_problems`, `countdown`: verifiable tasks (rewards in `lit_rlhf.rewards.verifiable`), sharing
  `text` (row format, char tokenizer, tiny GPT-2) and `expression` (a safe arithmetic parser).
"""
