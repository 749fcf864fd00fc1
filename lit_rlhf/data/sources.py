"""Where prompt rows come from: JSONL or text files, Python lists, `builtin:<task>` streams; and the seeded,
per-rank, resumable order in which they are read."""

from __future__ import annotations

import itertools
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


def read_prompt_file(path: str, prompt_column: str = "prompt", field: str = "data.prompts") -> list[dict[str, Any]]:
    """Rows from a .jsonl file (objects with `prompt_column`) or a text file (one prompt per line); errors name
    `field` (the setting that named the file)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{field}: the file {path!r} does not exist")
    rows: list[dict[str, Any]] = []
    if path.endswith(".jsonl"):
        for line_number, row in jsonl_objects(path, field):
            if not isinstance(row, dict) or prompt_column not in row:
                raise ConfigError(
                    f"{field}: {path}:{line_number} has no field {prompt_column!r}; "
                    "every line needs it (or set data.prompt_column)"
                )
            if not isinstance(row[prompt_column], str):
                raise ConfigError(
                    f"{field}: {path}:{line_number}: field {prompt_column!r} must be a string, "
                    f"got {type(row[prompt_column]).__name__}"
                )
            rows.append(row)
    else:
        with open(path, encoding="utf-8") as handle:
            rows = [{prompt_column: line.rstrip("\n")} for line in handle if line.strip()]
    if not rows:
        raise ConfigError(f"{field}: the file {path!r} holds no prompts")
    return rows


def prompt_rows(prompts: list, prompt_column: str, field: str) -> list[dict[str, Any]]:
    """Rows from a Python list of strings or dicts, each with a string `prompt_column`."""
    rows = [p if isinstance(p, dict) else {prompt_column: p} for p in prompts]
    if not rows:
        raise ConfigError(f"{field}: the prompt list is empty")
    for i, row in enumerate(rows):
        if not isinstance(row.get(prompt_column), str):
            raise ConfigError(f"{field}: row {i} has no string field {prompt_column!r}")
    return rows


def builtin_rows(spec: str, seed: int, count: int, field: str) -> list[dict[str, Any]]:
    """The first `count` rows of the `builtin:<task>` stream drawn with `seed`."""
    return list(itertools.islice(get_task(spec, field).prompts(seed), count))


class PromptStream:
    """Rows of one rank, in a seeded order, with a resumable position.

    A finite source is read in passes, each a new order (seed + pass number when `shuffle`, else the file
    order); an endless built-in source is read in order. Row i of a pass (or of the built-in stream) goes to
    rank i % world_size; the last `len(source) % world_size` rows of a pass are left out, so every rank gets
    `rows_per_pass` rows per pass. `rows_consumed` counts this rank's rows handed out, over all passes.
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
        self._pass: tuple[int, list[dict[str, Any]]] | None = None  # the last pass read: (number, this rank's rows)
        self._cursor: tuple[int, Iterator[dict[str, Any]]] | None = None  # built-in stream: (position, rows from it)

    @property
    def rows_per_pass(self) -> int | None:
        """This rank's rows in one pass over a finite source; None for an endless built-in stream."""
        if isinstance(self.source, str):
            return None
        per_rank = len(self.source) // self.world_size
        if per_rank == 0:
            raise ConfigError(
                f"data.prompts: {len(self.source)} prompts for {self.world_size} processes; "
                "give at least one prompt per process"
            )
        return per_rank

    def pass_rows(self, number: int) -> list[dict[str, Any]]:
        """This rank's rows of pass `number` over a finite source, in order."""
        if self._pass is not None and self._pass[0] == number:
            return self._pass[1]
        per_rank = self.rows_per_pass
        assert per_rank is not None and not isinstance(self.source, str), "an endless stream has no passes"
        usable = per_rank * self.world_size
        order = list(range(len(self.source)))
        if self.shuffle:
            random.Random(self.seed + number).shuffle(order)
        rows = [self.source[index] for index in order[self.rank : usable : self.world_size]]
        self._pass = (number, rows)
        return rows

    def rows(self, start: int, count: int) -> list[dict[str, Any]]:
        """This rank's rows `start` .. `start + count - 1` of the stream (a finite source's passes end to end)."""
        per_pass = self.rows_per_pass
        if per_pass is not None:
            out: list[dict[str, Any]] = []
            while len(out) < count:
                number, offset = divmod(start + len(out), per_pass)
                out.extend(self.pass_rows(number)[offset : offset + count - len(out)])
            return out
        if self._cursor is None or self._cursor[0] != start:  # a new generator only after a jump (resume)
            assert isinstance(self.source, str)
            rows = itertools.islice(
                get_task(self.source, "data.prompts").prompts(self.seed), self.rank, None, self.world_size
            )
            self._cursor = (start, itertools.islice(rows, start, None))
        out = list(itertools.islice(self._cursor[1], count))
        self._cursor = (start + len(out), self._cursor[1])
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            (row,) = self.rows(self.rows_consumed, 1)
            self.rows_consumed += 1
            yield row

    def state_dict(self) -> dict[str, int]:
        return {"rows_consumed": self.rows_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rows_consumed = int(state["rows_consumed"])
