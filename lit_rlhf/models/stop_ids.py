"""The ids that end a response: the tokenizer's EOS, the generation config's and the chat template's end of turn.

Chat models often list several (Llama-3: end of text and end of turn; Qwen2.5: `<|im_end|>` and `<|endoftext|>`)
while their tokenizer names one as `eos_token`; Hugging Face `generate` stops at the first of the generation
config's. Every backend here stops at the first of `stop_token_ids`.
"""

from __future__ import annotations

from typing import Any

_MARKER = "\x00lit_rlhf_reply\x00"
"""Text no template adds itself, rendered as the assistant's reply to find what the template puts after it."""


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The sorted union of the tokenizer's EOS id, `generation_config.eos_token_id` (one id or a list) and the chat
    template's end-of-turn token (the special token it writes right after an assistant reply, when it has one)."""
    ids = set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    ids.update(_as_ids(getattr(generation_config, "eos_token_id", None)))
    end_of_turn = chat_end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return tuple(sorted(ids))


def stop_id_disagreement(tokenizer: Any, generation_config: Any) -> str | None:
    """A one-line warning when the generation config's EOS ids are not just the tokenizer's EOS id, else None."""
    configured = sorted(set(_as_ids(getattr(generation_config, "eos_token_id", None))))
    own = getattr(tokenizer, "eos_token_id", None)
    if not configured or configured == [own]:
        return None
    spelled = ", ".join(f"{i} {_token(tokenizer, i)!r}" for i in configured)
    stops = list(stop_token_ids(tokenizer, generation_config))
    return (
        f"the tokenizer's eos_token {_token(tokenizer, own)!r} (id {own}) and the generation config's eos_token_id "
        f"[{spelled}] disagree; responses stop at the first of ids {stops} (their union, as Hugging Face generate)"
    )


def chat_end_of_turn_id(tokenizer: Any) -> int | None:
    """The id of the special token the chat template writes right after an assistant reply, or None (no
    template, a template that cannot render a reply, or plain text after it)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template may refuse this conversation (roles, tools); then it names no end of turn
        return None
    if not isinstance(text, str) or _MARKER not in text:
        return None
    after = text.split(_MARKER, 1)[1].lstrip(" ")
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    for spelling in sorted(added, key=len, reverse=True):  # the longest first: `<|im_end|>` before `<|im`
        if spelling and after.startswith(spelling):
            return int(added[spelling])
    return None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(i) for i in value]


def _token(tokenizer: Any, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    return convert(token_id) if callable(convert) else str(token_id)
