"""Prompt rows -> a left-padded `PromptBatch`, with the prompt length limit enforced."""

from __future__ import annotations

import warnings
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.types import PromptBatch

PROMPT_TRUNCATION = ("error", "left")


class PromptTokenizer:
    """Texts -> left-padded `PromptBatch`, enforcing the prompt length limit."""

    def __init__(self, tokenizer: Any, max_prompt_length: int, truncation: str, prompt_column: str):
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_column = prompt_column
        self._warned = False

    def check_length(self, text: str, where: str) -> None:
        n = len(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        if n > self.max_prompt_length and self.truncation == "error":
            raise ConfigError(
                f"data.max_prompt_length: prompt {where} has {n} tokens, over the limit of {self.max_prompt_length}; "
                "raise data.max_prompt_length, shorten the prompt, or set data.prompt_truncation: left"
            )

    def __call__(self, rows: list[dict[str, Any]]) -> PromptBatch:
        texts = [row[self.prompt_column] for row in rows]
        self.tokenizer.padding_side = "left"
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
        if input_ids.shape[1] > self.max_prompt_length:
            lengths = attention_mask.sum(1)
            worst = int(lengths.argmax())
            if self.truncation == "error":
                self.check_length(texts[worst], repr(texts[worst][:60]))
            if not self._warned:
                warnings.warn(
                    f"data.max_prompt_length: prompts longer than {self.max_prompt_length} tokens are cut from the "
                    "left (data.prompt_truncation=left)",
                    stacklevel=2,
                )
                self._warned = True
            input_ids = input_ids[:, -self.max_prompt_length :]
            attention_mask = attention_mask[:, -self.max_prompt_length :]
        # every extra column of any row, in order of first appearance; None where a row lacks it
        keys = dict.fromkeys(key for row in rows for key in row if key != self.prompt_column)
        meta = {key: [row.get(key) for row in rows] for key in keys}
        return PromptBatch(input_ids=input_ids, attention_mask=attention_mask, texts=texts, meta=meta)
