"""Chat prompts: message lists rendered by the policy tokenizer's chat template, and tokenised so that the
template's own markers are special tokens while a special-token spelling typed in a message stays text.

The rendered text (with the generation prompt) is the prompt that reward functions receive. It is tokenised
without adding special tokens again: a template that writes `{{ bos_token }}` already holds the BOS.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from lit_rlhf.config import ConfigError


def tokenizer_name(tokenizer: Any) -> str:
    """The tokenizer's name or path when it has one, else its class name."""
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def special_spellings(tokenizer: Any) -> list[str]:
    """The text of every special token (added tokens marked special), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    spellings = {token.content for token in added.values() if getattr(token, "special", False)}
    spellings.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((s for s in spellings if s), key=len, reverse=True)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> str:
    """The prompt text: `messages` through the chat template, with the generation prompt added."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{where} is a chat prompt (a message list), but the tokenizer {tokenizer_name(tokenizer)!r} has no chat "
            "template; give plain string prompts, or set tokenizer.chat_template"
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        check_generation_prompt(tokenizer, messages, text)
        return text
    except Exception as err:  # a template may refuse a conversation, e.g. roles that do not alternate
        raise ConfigError(
            f"{where}: the chat template of {tokenizer_name(tokenizer)!r} refused the messages "
            f"({type(err).__name__}: {err}); change the messages to the form the template accepts"
        ) from err


CHECKED_TEMPLATES: set[str] = set()
"""Chat templates already checked for a generation prompt (once per template, not per row)."""


def check_generation_prompt(tokenizer: Any, messages: list[dict[str, Any]], text: str) -> None:
    """Warn (once per template) when the template renders the same text without `add_generation_prompt`: the
    prompt then ends without the assistant header, and the policy continues the user's turn instead of answering."""
    template = str(tokenizer.chat_template)
    if template in CHECKED_TEMPLATES or messages[-1].get("role") == "assistant":
        return
    CHECKED_TEMPLATES.add(template)
    if tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False) == text:
        warnings.warn(
            f"the chat template of {tokenizer_name(tokenizer)!r} ignores add_generation_prompt (the same text with "
            "and without it): if it never adds the assistant's header, the policy continues the user's turn "
            f"instead of answering. A prompt ends {text[-40:]!r}; check that this is the assistant's header, or use "
            "a template that adds it under `{% if add_generation_prompt %}`",
            stacklevel=2,
        )


def content_spans(tokenizer: Any, messages: list[dict[str, Any]], text: str, where: str) -> list[tuple[int, int]]:
    """(start, end) of each message's content in the rendered `text`, found by rendering placeholders instead.

    A ConfigError when the template does not copy each content verbatim (e.g. it trims or rewrites it): then the
    content cannot be told apart from the template's text.
    """
    marks = [f"\ue000{j}\ue001" for j in range(len(messages))]
    skeleton = render_chat(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)], where)
    spans: list[tuple[int, int]] = []
    shift = 0  # how much longer the real text is than the skeleton up to here
    for mark, message in zip(marks, messages, strict=True):
        at = skeleton.find(mark)
        if at < 0 or skeleton.count(mark) != 1:
            break
        start = at + shift
        spans.append((start, start + len(message["content"])))
        shift += len(message["content"]) - len(mark)
    rebuilt = skeleton
    for mark, message in zip(marks, messages, strict=True):
        rebuilt = rebuilt.replace(mark, message["content"], 1)
    if len(spans) != len(messages) or rebuilt != text:
        raise ConfigError(
            f"{where}: a message spells a special token of {tokenizer_name(tokenizer)!r}, and its chat template "
            "does not copy message contents verbatim, so that spelling cannot be kept as text; remove it from "
            "the message"
        )
    return spans


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[str, list[int]]:
    """The rendered prompt text and its token ids (no special tokens added to the template's own).

    When no message spells a special token, this is exactly `tokenizer(text, add_special_tokens=False)`. When one
    does, the text is cut at the template's special tokens (those outside message contents), which map to their
    ids, and each stretch between them is tokenised on its own with `split_special_tokens=True`, so the spelling
    in a message becomes ordinary tokens.
    """
    text = render_chat(tokenizer, messages, where)
    spellings = special_spellings(tokenizer)
    if not any(s in m["content"] for m in messages for s in spellings):
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    spans = content_spans(tokenizer, messages, text, where)
    pattern = re.compile("|".join(map(re.escape, spellings)))
    ids: list[int] = []
    cursor = 0
    for match in pattern.finditer(text):
        if any(start < match.end() and match.start() < end for start, end in spans):
            continue  # a spelling typed in (or reaching into) a message: text
        ids += _plain_ids(tokenizer, text[cursor : match.start()])
        ids.append(tokenizer.convert_tokens_to_ids(match.group()))
        cursor = match.end()
    return text, ids + _plain_ids(tokenizer, text[cursor:])


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
