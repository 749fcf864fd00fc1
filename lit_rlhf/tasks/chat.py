"""Offline reward functions and prompt sets for real pretrained chat models (no network, no model download).

- `vader_sentiment_reward`: the VADER lexicon's compound sentiment of each reply, in [-1, 1] (positive is
  high). Needs `pip install vaderSentiment` (in the `real` extra).
- `arithmetic_reward`: 1 when the last integer in the reply equals the row's `answer` column, else 0.

Prompt sets in the ChatML format of SmolLM2-Instruct (the chat template its tokenizer carries, default system
prompt included), written as JSONL rows for `RolloutDataModule(prompts=path)` by `scripts/make_chat_prompts.py`:

    python scripts/make_chat_prompts.py --task sentiment --out configs/prompts/smollm2_topics.jsonl
    python scripts/make_chat_prompts.py --task arithmetic --out configs/prompts/smollm2_arithmetic.jsonl

Arithmetic rows carry an `answer` column, which reaches `arithmetic_reward` as the keyword list `answer`.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from typing import Any

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOPICS = (
    "the sea",
    "a rainy morning",
    "your neighbour's dog",
    "Mondays",
    "a train journey",
    "old books",
    "coffee",
    "winter",
    "a city at night",
    "gardening",
    "homework",
    "a birthday party",
    "the moon",
    "traffic",
    "a small village",
    "cooking dinner",
    "a football match",
    "the desert",
    "mountains",
    "a library",
    "a long queue",
    "summer holidays",
    "a thunderstorm",
    "the first day at a new job",
    "a cat",
    "music",
    "a bicycle ride",
    "the market",
    "an empty house",
    "a letter from a friend",
    "bread",
    "the forest",
)

_INTEGER = re.compile(r"-?\d+")


def chatml(user: str, system: str = SMOLLM2_SYSTEM) -> str:
    """One user turn in SmolLM2-Instruct's chat format, ending where the assistant's reply starts."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@functools.lru_cache(maxsize=1)
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "vader_sentiment_reward needs the vaderSentiment package: pip install vaderSentiment "
            "(or pip install -e '.[real]')"
        ) from err
    return SentimentIntensityAnalyzer()


def vader_sentiment_reward(prompts: Sequence[str], responses: Sequence[str], **meta: Any) -> list[float]:
    """VADER compound sentiment of each response in [-1, 1]; an empty reply scores 0."""
    analyzer = _vader()
    return [float(analyzer.polarity_scores(r)["compound"]) for r in responses]


def last_integer(text: str) -> int | None:
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def arithmetic_reward(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any] | None = None, **meta: Any
) -> list[float]:
    """1.0 when the last integer of the reply equals `answer` (a column of the prompt rows), else 0.0."""
    if answer is None:
        raise ValueError("arithmetic_reward needs an 'answer' column in the prompt rows")
    return [1.0 if last_integer(r) == int(a) else 0.0 for r, a in zip(responses, answer, strict=True)]


def sentiment_rows(seed: int = 0) -> list[dict[str, Any]]:
    """One prompt per topic: write a sentence about it."""
    del seed
    return [{"prompt": chatml(f"Write one sentence about {topic}.")} for topic in TOPICS]


def arithmetic_rows(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """`n` additions of two numbers from 1 to 20, with their answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": chatml(f"What is {a} + {b}? Reply with the number only."), "answer": a + b})
    return rows
