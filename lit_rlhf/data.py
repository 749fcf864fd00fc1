"""The rollout DataModule: prompt sources, left-padded tokenisation, per-rank sharding, the rollout stream.

The stream is lazy: a rollout is generated only when `training_step(self, dataloader_iter)` asks for the
next batch, so it always comes from the policy as it is after the previous update (Lightning does not
prefetch for that signature).
"""

from __future__ import annotations

import json
import os
import random
import warnings
from typing import Any, Iterable, Iterator

import lightning as L

from lit_rlhf.config import ConfigError
from lit_rlhf.types import PromptBatch

PROMPT_TRUNCATION = ("error", "left")


def jsonl_objects(path: str, field: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file; errors name `field`, file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"{field}: the file {path!r} does not exist")
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{field}: {path}:{line_number} is not valid JSON ({err})") from err
            yield line_number, row


def read_prompt_file(path: str, prompt_column: str = "prompt") -> list[dict[str, Any]]:
    """Rows from a .jsonl file (objects with `prompt_column`) or a text file (one prompt per line)."""
    if not os.path.isfile(path):
        raise ConfigError(f"data.prompts: the file {path!r} does not exist")
    rows: list[dict[str, Any]] = []
    if path.endswith(".jsonl"):
        for line_number, row in jsonl_objects(path, "data.prompts"):
            if not isinstance(row, dict) or prompt_column not in row:
                raise ConfigError(
                    f"data.prompts: {path}:{line_number} has no field {prompt_column!r}; "
                    "every line needs it (or set data.prompt_column)"
                )
            if not isinstance(row[prompt_column], str):
                raise ConfigError(f"data.prompts: {path}:{line_number}: field {prompt_column!r} must be a string, "
                                  f"got {type(row[prompt_column]).__name__}")
            rows.append(row)
    else:
        with open(path, encoding="utf-8") as handle:
            rows = [{prompt_column: line.rstrip("\n")} for line in handle if line.strip()]
    if not rows:
        raise ConfigError(f"data.prompts: the file {path!r} holds no prompts")
    return rows


def _builtin_rows(name: str, seed: int) -> Iterator[dict[str, Any]]:
    from lit_rlhf.builtin import TASKS, sort_digits_prompts

    if name != "digits":
        raise ConfigError(f"data.prompts: unknown built-in task {name!r}; available: {TASKS}")
    return sort_digits_prompts(seed=seed)


class PromptStream:
    """Rows of one rank, in a seeded order, with a resumable position.

    A finite source is reshuffled every pass (seed + pass number); an endless built-in source is read in
    order. Row i of the global order goes to rank i % world_size.
    """

    def __init__(self, source: list[dict[str, Any]] | str, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1):
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.rows_consumed = 0  # rows of this rank handed out so far

    def _global_rows(self) -> Iterator[dict[str, Any]]:
        if isinstance(self.source, str):
            yield from _builtin_rows(self.source, self.seed)
            return
        epoch = 0
        # drop the tail that does not split evenly, so every rank sees the same number of rows per pass
        usable = len(self.source) - len(self.source) % self.world_size
        if usable == 0:
            raise ConfigError(f"data.prompts: {len(self.source)} prompts for {self.world_size} processes")
        while True:
            order = list(range(len(self.source)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            for index in order[:usable]:
                yield self.source[index]
            epoch += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip = self.rows_consumed
        for i, row in enumerate(self._global_rows()):
            if i % self.world_size != self.rank:
                continue
            if skip > 0:
                skip -= 1
                continue
            self.rows_consumed += 1
            yield row

    def state_dict(self) -> dict[str, int]:
        return {"rows_consumed": self.rows_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rows_consumed = int(state["rows_consumed"])


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
        meta = {key: [row.get(key) for row in rows] for key in rows[0] if key != self.prompt_column}
        return PromptBatch(input_ids=input_ids, attention_mask=attention_mask, texts=texts, meta=meta)


class RolloutStream:
    """Iterable of rollouts: each `next()` tokenises the next prompt batch and asks `make_rollout` for it."""

    def __init__(self, prompts: PromptStream, batch_size: int, to_batch: PromptTokenizer, make_rollout: Any | None):
        self.prompts = prompts
        self.batch_size = batch_size
        self.to_batch = to_batch
        self.make_rollout = make_rollout  # PromptBatch -> rollout; None yields the PromptBatch itself

    def __iter__(self) -> Iterator[Any]:
        rows: list[dict[str, Any]] = []
        for row in self.prompts:
            rows.append(row)
            if len(rows) == self.batch_size:
                batch = self.to_batch(rows)
                rows = []
                yield batch if self.make_rollout is None else self.make_rollout(batch)


class RolloutDataModule(L.LightningDataModule):
    """Owns the prompts and the rollout stream.

    Args:
        prompts: 'builtin:digits', a .jsonl/.txt file, or (from Python) a list of strings or dicts.
        batch_size: prompts per step and per process; each gets `group_size` responses.
        max_prompt_length: prompt token limit.
        prompt_truncation: 'error' (default) or 'left' (cut the start of long prompts, with a warning).
        prompt_column: field of the prompt text in .jsonl rows; the other fields reach reward functions.
        tokenizer: defaults to the module's tokenizer.
        seed: order of the prompts.
        shuffle: reshuffle a finite prompt set each pass.
    """

    def __init__(
        self,
        prompts: str | list = "builtin:digits",
        batch_size: int = 16,
        max_prompt_length: int = 256,
        prompt_truncation: str = "error",
        prompt_column: str = "prompt",
        tokenizer: Any = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size: must be >= 1, got {batch_size}")
        if max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length: must be >= 1, got {max_prompt_length}")
        if prompt_truncation not in PROMPT_TRUNCATION:
            raise ConfigError(f"data.prompt_truncation: use one of {PROMPT_TRUNCATION}, got {prompt_truncation!r}")
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.prompt_column = prompt_column
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.source = self._load_source(prompts)
        self.stream: PromptStream | None = None
        self._pending_state: dict[str, int] | None = None

    def _load_source(self, prompts: str | Iterable) -> list[dict[str, Any]] | str:
        if isinstance(prompts, str):
            if prompts.startswith("builtin:"):
                name = prompts[len("builtin:") :]
                _builtin_rows(name, self.seed)  # validates the name
                return name
            return read_prompt_file(prompts, self.prompt_column)
        rows = [p if isinstance(p, dict) else {self.prompt_column: p} for p in prompts]
        if not rows:
            raise ConfigError("data.prompts: the prompt list is empty")
        for i, row in enumerate(rows):
            if not isinstance(row.get(self.prompt_column), str):
                raise ConfigError(f"data.prompts: row {i} has no string field {self.prompt_column!r}")
        return rows

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer is not None:
            from lit_rlhf.models import load_tokenizer

            if not hasattr(self.tokenizer, "pad_token_id"):
                self.tokenizer = load_tokenizer(self.tokenizer, field="data.tokenizer")
            return self.tokenizer
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is None or getattr(module, "tokenizer", None) is None:
            raise ConfigError("data.tokenizer: no tokenizer given and the module has none; pass one")
        return module.tokenizer

    def setup(self, stage: str) -> None:
        tokenizer = self._resolve_tokenizer()
        self.prompt_tokenizer = PromptTokenizer(tokenizer, self.max_prompt_length, self.prompt_truncation, self.prompt_column)
        if isinstance(self.source, list) and self.prompt_truncation == "error":
            for i, row in enumerate(self.source):  # fail before any model is loaded
                self.prompt_tokenizer.check_length(row[self.prompt_column], f"#{i}")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        self.stream = PromptStream(self.source, self.seed, self.shuffle, rank, world)
        if self._pending_state is not None:
            self.stream.load_state_dict(self._pending_state)
            self._pending_state = None
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and hasattr(module, "check_rollout_batch"):
            module.check_rollout_batch(self.batch_size)

    def train_dataloader(self) -> RolloutStream:
        module = self.trainer.lightning_module if self.trainer is not None else None
        make_rollout = getattr(module, "make_rollout", None)
        return RolloutStream(self.stream, self.batch_size, self.prompt_tokenizer, make_rollout)

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_stream": self.stream.state_dict() if self.stream is not None else {"rows_consumed": 0}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("prompt_stream", {"rows_consumed": 0})
        if self.stream is not None:
            self.stream.load_state_dict(state)
        else:
            self._pending_state = state
