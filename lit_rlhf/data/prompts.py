"""Prompt rows -> a left-padded `PromptBatch`, with the prompt length limit enforced.

A plain string prompt is tokenised with the tokenizer's special tokens added (e.g. a BOS). A special token's
spelling in it (`<eos>`, `<|im_start|>`) is ambiguous: typed text, or a chat template rendered by hand. It is
refused unless `special_tokens_in_prompts` says which ('text': `split_special_tokens=True`; 'parse': the
special token). A chat prompt
(a message list) is rendered by the chat template and tokenised as `lit_rlhf.data.chat.encode_chat` says.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lit_rlhf.config import ConfigError
from lit_rlhf.data.chat import encode_chat
from lit_rlhf.data.sources import prompt_value
from lit_rlhf.types import PromptBatch

CHECK_CHUNK = 1024
"""Rows per tokenizer call when `check_lengths` walks a whole prompt set."""
CONVERSATIONS = "messages"
"""The column a batch's conversations are found in (`lit_rlhf.rewards.binding` reads it for TRL-form rewards, which
take conversational prompts and completions as message lists), whichever column of the rows held them."""


class PromptTokenizer:
    """Rows -> left-padded `PromptBatch`, enforcing the prompt length limit."""

    def __init__(
        self,
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str,
        prompt_column: str,
        messages_column: str = "messages",
        special_tokens_in_prompts: str = "error",
    ):
        self.tokenizer = tokenizer
        self.special_tokens_in_prompts = special_tokens_in_prompts
        self.special_spellings = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self._warned = False

    def encode(
        self, rows: list[dict[str, Any]], field: str = "data.prompts", first: int = 0
    ) -> tuple[list[str], list[list[int]]]:
        """The prompt texts (chat prompts rendered) and their token ids; plain prompts in one tokenizer call.
        Errors name `rows[i]` as row `first + i` of `field`."""
        values = [
            prompt_value(row, self.prompt_column, self.messages_column, f"{field}: row {first + i}")
            for i, row in enumerate(rows)
        ]
        texts = [value if isinstance(value, str) else "" for value in values]
        ids: list[list[int]] = [[] for _ in rows]
        plain = [i for i, value in enumerate(values) if isinstance(value, str)]
        if plain:
            if self.special_tokens_in_prompts == "error":
                self.refuse_special_spellings([texts[i] for i in plain], [first + i for i in plain], field)
            encoded = self.tokenizer(
                [texts[i] for i in plain],
                add_special_tokens=True,
                split_special_tokens=self.special_tokens_in_prompts != "parse",
                return_attention_mask=False,
                return_token_type_ids=False,
            )["input_ids"]
            for i, row_ids in zip(plain, encoded, strict=True):
                ids[i] = list(row_ids)
        for i, value in enumerate(values):
            if not isinstance(value, str):
                texts[i], ids[i] = encode_chat(self.tokenizer, value, f"{field}: row {first + i}")
        return texts, ids

    def refuse_special_spellings(self, texts: list[str], row_numbers: list[int], field: str) -> None:
        """Raise if a plain prompt spells one of the tokenizer's special tokens (see the module docstring)."""
        for text, number in zip(texts, row_numbers, strict=True):
            found = next((t for t in self.special_spellings if t in text), None)
            if found is not None:
                raise ConfigError(
                    f"{field}: row {number} spells the special token {found!r} in a plain string prompt; give the "
                    "conversation as a message list (the tokenizer's chat template renders it), or set "
                    "data.special_tokens_in_prompts: parse (a template you rendered yourself) or text (keep the "
                    "spelling as literal text)"
                )

    def too_long(self, n: int, where: str) -> ConfigError:
        return ConfigError(
            f"data.max_prompt_length: prompt {where} has {n} tokens, over the limit of {self.max_prompt_length}; "
            "raise data.max_prompt_length, shorten the prompt, or set data.prompt_truncation: left"
        )

    def check_rows(self, rows: list[dict[str, Any]], field: str) -> None:
        """Tokenise every row once, in chunks: chat templates must apply, and (with truncation 'error') every
        prompt must fit `max_prompt_length` (prompt i named '#i', '#i of <field>' for held-out sets). With
        truncation 'left' only the chat prompts are rendered."""
        suffix = "" if field == "data.prompts" else f" of {field}"
        if self.truncation != "error":  # lengths do not matter: only chat prompts need rendering
            values = [
                prompt_value(row, self.prompt_column, self.messages_column, f"{field}: row {i}")
                for i, row in enumerate(rows)
            ]
            plain = [(i, value) for i, value in enumerate(values) if isinstance(value, str)]
            if self.special_tokens_in_prompts == "error":
                self.refuse_special_spellings([value for _, value in plain], [i for i, _ in plain], field)
            for i, value in enumerate(values):
                if not isinstance(value, str):
                    encode_chat(self.tokenizer, value, f"{field}: row {i}")
            return
        for start in range(0, len(rows), CHECK_CHUNK):
            _, ids = self.encode(rows[start : start + CHECK_CHUNK], field, start)
            for i, row_ids in enumerate(ids, start=start):
                if len(row_ids) > self.max_prompt_length:
                    raise self.too_long(len(row_ids), f"#{i}{suffix}")

    def __call__(self, rows: list[dict[str, Any]]) -> PromptBatch:
        texts, ids = self.encode(rows)
        lengths = [len(row_ids) for row_ids in ids]
        if max(lengths) > self.max_prompt_length:
            worst = max(range(len(rows)), key=lengths.__getitem__)
            if self.truncation == "error":
                raise self.too_long(lengths[worst], repr(texts[worst][:60]))
            if not self._warned:
                warnings.warn(
                    f"data.max_prompt_length: prompts longer than {self.max_prompt_length} tokens are cut from the "
                    "left (data.prompt_truncation=left)",
                    stacklevel=2,
                )
                self._warned = True
            ids = [row_ids[-self.max_prompt_length :] for row_ids in ids]
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise ConfigError("data.tokenizer: the tokenizer has no pad token; set tokenizer.pad_token")
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(row_ids)) + row_ids for row_ids in ids], dtype=torch.long)
        attention_mask = torch.tensor(
            [[0] * (width - len(row_ids)) + [1] * len(row_ids) for row_ids in ids], dtype=torch.long
        )
        # every extra column of any row, in order of first appearance; None where a row lacks it
        keys = dict.fromkeys(key for row in rows for key in row if key != self.prompt_column)
        meta: dict[str, list[Any]] = {key: [row.get(key) for row in rows] for key in keys}
        if CONVERSATIONS not in meta and (conversations := self.conversations(rows)) is not None:
            meta[CONVERSATIONS] = conversations
        return PromptBatch(input_ids=input_ids, attention_mask=attention_mask, texts=texts, meta=meta)

    def conversations(self, rows: list[dict[str, Any]]) -> list[list[Any]] | None:
        """Each row's message list when every row's prompt is one (in `prompt_column`, as TRL's conversational
        rows hold it, or in `messages_column`), else None."""
        values = [prompt_value(row, self.prompt_column, self.messages_column) for row in rows]
        chats = [value for value in values if not isinstance(value, str)]
        return chats if len(chats) == len(values) else None
