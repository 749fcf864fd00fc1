"""Offline reward functions and prompt sets for real pretrained chat models (no network, no model download).

- `vader_sentiment_reward`: the VADER lexicon's compound sentiment of each reply, in [-1, 1] (positive is
  high). Needs `pip install vaderSentiment` (in the `real` extra).
- `sentiment_rows`: one "write a sentence about <topic>" prompt per topic, as chat rows (`messages`, rendered by
  the policy tokenizer's chat template: SmolLM2-Instruct's adds its default system prompt) or plain prompts.

Written as JSONL for `RolloutDataModule(prompts=path)` by `scripts/make_chat_prompts.py --task sentiment`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from lit_rlhf.tasks.text import make_row

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


def sentiment_rows(chat: bool = True) -> list[dict[str, Any]]:
    """One prompt per topic: write a sentence about it (a user message when `chat`, else a plain prompt)."""
    return [make_row(f"Write one sentence about {topic}.", chat) for topic in TOPICS]
