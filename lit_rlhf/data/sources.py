"""Where prompt rows come from: JSONL, JSON or text files, Python lists, Hugging Face `datasets`, `builtin:<task>`
streams; the checks every row passes; and the seeded, per-rank, resumable order in which rows are read."""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.registry import get_task

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a chat prompt may use."""

FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".txt": "txt"}
"""Prompt file formats by suffix (compared case-insensitively)."""


def check_file(path: str, field: str) -> None:
    """A ConfigError naming `field` when `path` is a folder or does not exist."""
    if os.path.isdir(path):
        raise ConfigError(
            f"{field}: {path!r} is a folder, not a prompt file; give a .jsonl, .json or .txt file (a dataset saved "
            "with save_to_disk: load it with datasets.load_from_disk and pass the Dataset from Python)"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"{field}: the file {path!r} does not exist")


def read_text(path: str, field: str) -> str:
    """The UTF-8 text of a file (a leading BOM dropped); errors name `field`, and the line and byte of bad bytes."""
    check_file(path, field)
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{field}: {path}:{line} is not UTF-8 (byte {err.start} of the file, {data[err.start : err.start + 1]!r}); "
            "save the file as UTF-8"
        ) from err


def text_lines(path: str, field: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) for each line of a UTF-8 text file."""
    text = read_text(path, field).replace("\r\n", "\n")
    yield from enumerate(text.split("\n"), start=1)


def jsonl_objects(path: str, field: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file; errors name `field`, file and line."""
    for line_number, line in text_lines(path, field):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{field}: {path}:{line_number} is not valid JSON ({err})") from err
        yield line_number, row


def check_messages(messages: list, where: str, column: str) -> None:
    """A chat prompt: a list of {'role', 'content'} messages with known roles, string contents, a user turn."""
    if not messages:
        raise ConfigError(f"{where}: field {column!r} is an empty message list; give at least one user message")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(
                f"{where}: field {column!r}, message {j} is {message!r}; each message needs 'role' and 'content'"
            )
        if message["role"] not in ROLES:
            raise ConfigError(
                f"{where}: field {column!r}, message {j} has role {message['role']!r}; use one of {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise ConfigError(
                f"{where}: field {column!r}, message {j} ({message['role']}): content must be a string, got "
                f"{type(message['content']).__name__}; give the message text as one string"
            )
    if not any(message["role"] == "user" for message in messages):
        raise ConfigError(f"{where}: field {column!r} has no user message; a chat prompt needs at least one")


def json_messages(value: Any, column: str, messages_column: str, where: str) -> Any:
    """`value` with a conversation stored as a JSON string (how CSV exports and many datasets keep a `messages`
    column: '[{"role": "user", "content": "..."}]') parsed into its message list.

    In `messages_column` a string must be such a JSON list (anything else is a ConfigError naming `where`); in the
    prompt column a string is parsed only when it is a JSON list of objects with a 'role', else it is the text."""
    if not isinstance(value, str):
        return value
    in_messages = column == messages_column
    text = value.strip()
    if not text.startswith("["):
        if in_messages:
            raise ConfigError(
                f"{where}: field {column!r} holds a string ({value[:60]!r}), not a message list; give a list of "
                "{'role', 'content'} messages (or its JSON text), or put plain prompts in data.prompt_column"
            )
        return value
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        if not in_messages:
            return value
        raise ConfigError(
            f"{where}: field {column!r} holds a string that is not a valid JSON message list ({err}): "
            f"{value[:60]!r}; give a list of {{'role', 'content'}} messages"
        ) from err
    conversation = isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed)
    if not conversation and not in_messages:
        return value
    if not isinstance(parsed, list):
        raise ConfigError(f"{where}: field {column!r} holds JSON that is not a message list: {value[:60]!r}")
    check_messages(parsed, where, column)
    return parsed


def prompt_value(
    row: dict[str, Any], prompt_column: str, messages_column: str, where: str = "a prompt row"
) -> str | list:
    """A checked row's prompt: the string or message list in `prompt_column`, else the messages in
    `messages_column`; a message list stored as a JSON string is parsed (`json_messages`)."""
    column = prompt_column if prompt_column in row else messages_column
    return json_messages(row[column], column, messages_column, where)


def check_row(row: Any, where: str, prompt_column: str, messages_column: str, noun: str) -> dict[str, Any]:
    """`row` when it is an object holding a non-empty string prompt or a valid message list; else a ConfigError
    saying where (`where` starts with the setting's name; `noun` is what a missing prompt is called)."""
    if not isinstance(row, dict):
        raise ConfigError(
            f"{where} is a {type(row).__name__}, not an object; give a prompt string or an object with "
            f"{prompt_column!r} (or {messages_column!r})"
        )
    column = prompt_column if prompt_column in row else messages_column
    if column not in row:
        raise ConfigError(
            f"{where} has no {noun} {prompt_column!r} (nor a message list in {messages_column!r}); its fields "
            f"are {sorted(row)}; every row needs one (or set data.prompt_column / data.messages_column)"
        )
    value = json_messages(row[column], column, messages_column, where)
    if value is not row[column]:
        row = {**row, column: value}  # the parsed conversation; the caller's row is left as it was
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: field {column!r} is an empty prompt ({value!r}); remove the row or fill it")
    elif isinstance(value, list):
        check_messages(value, where, column)
    else:
        raise ConfigError(
            f"{where}: field {column!r} must be a string, got {type(value).__name__} "
            "(or a list of {'role', 'content'} messages)"
        )
    return row


def checked_rows(
    items: list,
    where: Callable[[int], str],
    prompt_column: str,
    messages_column: str,
    empty: str,
    noun: str = "string field",
) -> list[dict[str, Any]]:
    """Each item (a prompt string or a row object) checked, strings wrapped as {prompt_column: text}."""
    if not items:
        raise ConfigError(empty)
    return [
        check_row(
            {prompt_column: item} if isinstance(item, str) else item, where(i), prompt_column, messages_column, noun
        )
        for i, item in enumerate(items)
    ]


def file_format(path: str, field: str) -> str:
    """'jsonl', 'json' or 'txt' from the case-insensitive suffix of `path`."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FILE_FORMATS:
        raise ConfigError(
            f"{field}: cannot tell the format of {path!r} from its suffix {suffix!r}; name it .jsonl (one JSON "
            "object per line), .json (a JSON array of objects or strings) or .txt (one prompt per line)"
        )
    return FILE_FORMATS[suffix]


def read_prompt_file(
    path: str, prompt_column: str = "prompt", field: str = "data.prompts", messages_column: str = "messages"
) -> list[dict[str, Any]]:
    """Checked rows from a .jsonl, .json (array) or .txt (one prompt per line, blank lines skipped) file; errors
    name `field` (the setting that named the file) and the line or item."""
    check_file(path, field)
    kind = file_format(path, field)
    empty = f"{field}: the file {path!r} holds no prompts"
    if kind == "txt":
        lines = [(n, line) for n, line in text_lines(path, field) if line.strip()]
        return checked_rows(
            [line for _, line in lines],
            lambda i: f"{field}: {path}:{lines[i][0]}",
            prompt_column,
            messages_column,
            empty,
        )
    if kind == "jsonl":
        numbered = list(jsonl_objects(path, field))
        return checked_rows(
            [row for _, row in numbered],
            lambda i: f"{field}: {path}:{numbered[i][0]}",
            prompt_column,
            messages_column,
            empty,
            "field",
        )
    try:
        items = json.loads(read_text(path, field))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{field}: {path}:{err.lineno} is not valid JSON ({err})") from err
    if not isinstance(items, list):
        raise ConfigError(
            f"{field}: {path} holds a JSON {type(items).__name__}, not an array; a .json prompt file is an array of "
            "prompt strings or row objects (use .jsonl for one object per line)"
        )
    return checked_rows(items, lambda i: f"{field}: {path} item {i}", prompt_column, messages_column, empty, "field")


def dataset_rows(spec: Any, split: str | None, field: str, split_field: str) -> list[dict[str, Any]] | None:
    """The rows of a Hugging Face `Dataset`, or of split `split` of a `DatasetDict`; None for anything else."""
    if not type(spec).__module__.startswith("datasets"):
        return None
    import datasets

    if isinstance(spec, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ConfigError(
            f"{field}: got a streaming {type(spec).__name__}; give a Dataset (load without streaming=True)"
        )
    if isinstance(spec, datasets.DatasetDict):
        splits = sorted(spec)
        if split is None:
            raise ConfigError(f"{field}: got a DatasetDict with splits {splits}; choose one with {split_field}")
        if split not in spec:
            raise ConfigError(
                f"{split_field}: the DatasetDict given as {field} has no split {split!r}; its splits: {splits}"
            )
        spec = spec[split]
    if isinstance(spec, datasets.Dataset):
        return spec.to_list()
    return None


def load_prompt_rows(
    spec: Any, prompt_column: str, messages_column: str, field: str, split: str | None, split_field: str
) -> list[dict[str, Any]]:
    """Checked rows from a file path, a list of strings/objects, or a `datasets` Dataset/DatasetDict (`split`)."""
    if isinstance(spec, str):
        return read_prompt_file(spec, prompt_column, field, messages_column)
    rows = dataset_rows(spec, split, field, split_field)
    if rows is not None:
        return checked_rows(
            rows, lambda i: f"{field}: row {i}", prompt_column, messages_column, f"{field}: the dataset is empty"
        )
    if isinstance(spec, (list, tuple)):
        return checked_rows(
            list(spec),
            lambda i: f"{field}: row {i}",
            prompt_column,
            messages_column,
            f"{field}: the prompt list is empty",
        )
    if isinstance(spec, dict):
        raise ConfigError(
            f"{field}: got a dict ({list(spec)[:5]}), not a list of rows; give a list of prompt strings or row objects "
            "(a dict of columns is not read as prompts: make it a datasets.Dataset.from_dict(...) or a list)"
        )
    kind = "a fraction" if isinstance(spec, (int, float)) else f"a {type(spec).__name__}"
    only_val = " (only data.val_prompts takes a fraction)" if isinstance(spec, (int, float)) else ""
    raise ConfigError(
        f"{field}: got {kind} ({spec!r}); give a .jsonl/.json/.txt file, a list of prompts, a datasets Dataset or "
        f"builtin:<task>{only_val}"
    )


MAX_EXCLUDED_IN_A_ROW = 20_000
"""Consecutive rows of a built-in stream found in the excluded set after which `builtin_rows` gives up."""


def prompt_key(row: dict[str, Any]) -> str:
    """What a prompt row asks (its `prompt` text or `messages`), as a string to compare rows by."""
    return json.dumps([row.get("prompt"), row.get("messages")], sort_keys=True)


def builtin_rows(
    spec: str, seed: int, count: int, field: str, exclude: frozenset[str] = frozenset(), excluded_from: str = ""
) -> list[dict[str, Any]]:
    """The first `count` rows of the `builtin:<task>` held-out stream (its prompt stream if it has none) drawn with
    `seed`, skipping rows whose `prompt_key` is in `exclude` (the rows of setting `excluded_from`)."""
    task = get_task(spec, field)
    rows: list[dict[str, Any]] = []
    skipped = 0
    for row in (task.held_out_prompts or task.prompts)(seed):
        if len(rows) == count:
            break
        if prompt_key(row) in exclude:
            skipped += 1
            if skipped >= MAX_EXCLUDED_IN_A_ROW:
                raise ConfigError(
                    f"{field}: {spec} gave only rows already in {excluded_from} for {skipped} draws ({len(rows)} "
                    f"of {count} found): the task has too few distinct prompts for both sets; lower data.val_size "
                    "or give a file"
                )
            continue
        skipped = 0
        rows.append(row)
    return rows


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
        if self._cursor is None or self._cursor[0] > start:  # a new generator only after a jump back (resume)
            assert isinstance(self.source, str)
            rows = itertools.islice(
                get_task(self.source, "data.prompts").prompts(self.seed), self.rank, None, self.world_size
            )
            self._cursor = (start, itertools.islice(rows, start, None))
        elif self._cursor[0] < start:  # a jump forward: skip the rows in between
            collections.deque(itertools.islice(self._cursor[1], start - self._cursor[0]), maxlen=0)
            self._cursor = (start, self._cursor[1])
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
