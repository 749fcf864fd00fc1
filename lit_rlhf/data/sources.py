"""Where prompt rows come from: JSONL or text files, Python lists, `builtin:<task>` streams; and the seeded,
per-rank, resumable order in which they are read."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.registry import get_task


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
                raise ConfigError(
                    f"data.prompts: {path}:{line_number}: field {prompt_column!r} must be a string, "
                    f"got {type(row[prompt_column]).__name__}"
                )
            rows.append(row)
    else:
        with open(path, encoding="utf-8") as handle:
            rows = [{prompt_column: line.rstrip("\n")} for line in handle if line.strip()]
    if not rows:
        raise ConfigError(f"data.prompts: the file {path!r} holds no prompts")
    return rows


class PromptStream:
    """Rows of one rank, in a seeded order, with a resumable position.

    A finite source is reshuffled every pass (seed + pass number); an endless built-in source is read in
    order. Row i of the global order goes to rank i % world_size.
    """

    def __init__(
        self, source: list[dict[str, Any]] | str, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1
    ):
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.rows_consumed = 0  # rows of this rank handed out so far

    def _global_rows(self) -> Iterator[dict[str, Any]]:
        if isinstance(self.source, str):
            yield from get_task(self.source, "data.prompts").prompts(self.seed)
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
