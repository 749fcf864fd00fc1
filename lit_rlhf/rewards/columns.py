"""Which dataset columns a reward or metric function needs, and a check that every prompt row has them.

A function is called as `fn(prompts, responses, **meta)`, `meta` holding the rows' extra columns (or by name,
see `lit_rlhf.rewards.binding`). A parameter other than the texts (the first two positional ones, or those named
`prompts`, `responses`, `completions`) that has no default (e.g. `answer` in `def exact_answer(prompts,
responses, answer, **kw)`) is a column the function needs; a row without it would fail mid-training, so
`check_columns` refuses it first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.binding import SignatureError, column_parameters
from lit_rlhf.rewards.functions import RewardFn, callable_path


def required_columns(fn: RewardFn) -> set[str]:
    """Names of the parameters of `fn`, other than those taking the texts, that are passed by keyword and have no
    default; an empty set when the signature cannot be read (or bound: refused where the function is set up)."""
    try:
        return {p.name for p in column_parameters(fn) if p.default is p.empty and p.kind is not p.POSITIONAL_ONLY}
    except SignatureError:
        return set()


def check_columns(
    fns: Iterable[RewardFn], rows: list[dict[str, Any]], field: str, prompt_column: str, kind: str = "reward"
) -> None:
    """A ConfigError naming the function, the column and the rows (first five and the count) of `field` that
    lack a column some function in `fns` needs (the prompt column itself is never passed as a column)."""
    for fn in fns:
        for column in sorted(required_columns(fn)):
            lacking = [i for i, row in enumerate(rows) if column not in row or column == prompt_column]
            if lacking:
                shown = ", ".join(map(str, lacking[:5])) + (", ..." if len(lacking) > 5 else "")
                raise ConfigError(
                    f"{field}: the {kind} function {callable_path(fn)} needs the column {column!r} (a parameter "
                    f"without a default), but {len(lacking)} of {len(rows)} rows lack it (rows {shown}); add the "
                    f"column to every row, or give the parameter a default"
                )
