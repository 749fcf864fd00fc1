"""The data section: prompt sets, columns and the functions that read them, prompt lengths against the limit."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.data.sources import PromptStream
from lit_rlhf.preflight.report import Section
from lit_rlhf.rewards.binding import SignatureError, column_parameters
from lit_rlhf.rewards.columns import required_columns
from lit_rlhf.rewards.functions import RewardFn, callable_name

STREAM_SAMPLE = 64
"""Rows drawn from an endless `builtin:<task>` stream to look at."""
LENGTH_SAMPLE = 5000
"""At most this many rows of a prompt set are tokenised for the length distribution (evenly spaced)."""


def training_rows(datamodule: Any, count: int | None = None) -> list[dict[str, Any]]:
    """The training rows (all of a finite set, or `count` of it; `STREAM_SAMPLE` drawn from a task stream)."""
    if isinstance(datamodule.source, str):
        stream = PromptStream(datamodule.source, datamodule.seed, datamodule.shuffle, 0, 1)
        return stream.rows(0, count or STREAM_SAMPLE)
    return list(datamodule.source[:count] if count else datamodule.source)


def prompt_sets(datamodule: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """(setting, rows) for the training rows and each distinct held-out set."""
    sets = [("data.prompts", training_rows(datamodule))]
    seen: set[int] = set()
    for field, rows in (
        ("data.val_prompts", datamodule.val_rows),
        ("data.test_prompts", datamodule.test_rows),
        ("data.predict_prompts", datamodule.predict_rows),
    ):
        if rows and id(rows) not in seen:
            sets.append((field, rows))
            seen.add(id(rows))
    return sets


def check_data(
    section: Section, datamodule: Any, tokenizer: Any, reward_fns: Sequence[RewardFn], metric_fns: Sequence[RewardFn]
) -> None:
    """Describe the prompt sets and find missing columns and prompts over `data.max_prompt_length`."""
    _describe_sources(section, datamodule)
    sets = prompt_sets(datamodule)
    _describe_columns(section, datamodule, sets[0][1], reward_fns, metric_fns)
    for field, rows in sets:
        fns = list(reward_fns) if field == "data.prompts" else [*reward_fns, *metric_fns]
        _missing_columns(section, field, rows, fns, datamodule.prompt_column)
    encoder = PromptTokenizer(
        tokenizer,
        datamodule.max_prompt_length,
        datamodule.prompt_truncation,
        datamodule.prompt_column,
        datamodule.messages_column,
        datamodule.special_tokens_in_prompts,
    )
    for field, rows in sets:
        _prompt_lengths(section, field, rows, encoder)


def _describe_sources(section: Section, dm: Any) -> None:
    if isinstance(dm.source, str):
        section.line(f"data.prompts: {dm.source}, an endless stream ({STREAM_SAMPLE} rows drawn to check)")
    else:
        held = f" ({dm.held_out_from_prompts} more held out by data.val_prompts)" if dm.held_out_from_prompts else ""
        section.line(f"data.prompts: {len(dm.source)} training rows{held}")
    sizes = []
    for name, rows in (("val", dm.val_rows), ("test", dm.test_rows), ("predict", dm.predict_rows)):
        same = rows is dm.val_rows and name != "val"
        sizes.append(f"{name} {'= val' if same and rows is not None else len(rows) if rows else 'none'}")
    section.line("held-out rows: " + ", ".join(sizes))


def _describe_columns(
    section: Section, dm: Any, rows: list[dict[str, Any]], reward_fns: Sequence[RewardFn], metric_fns: Sequence[Any]
) -> None:
    counts = Counter(key for row in rows for key in row if key not in (dm.prompt_column, dm.messages_column))
    shown = ", ".join(f"{k} ({n}/{len(rows)})" for k, n in sorted(counts.items())) or "none"
    section.line(f"columns besides the prompt: {shown}")
    for kind, fns in (("reward", reward_fns), ("metric", metric_fns)):
        for fn in fns:
            needed = sorted(required_columns(fn))
            try:
                optional = sorted({p.name for p in column_parameters(fn)} - set(needed))
            except SignatureError:
                optional = []
            reads = ", ".join(needed + [f"{name} (optional)" for name in optional]) or "no column"
            section.line(f"{kind} {callable_name(fn)} reads {reads}")


def _missing_columns(
    section: Section, field: str, rows: list[dict[str, Any]], fns: Sequence[RewardFn], prompt_column: str
) -> None:
    for fn in fns:
        for column in sorted(required_columns(fn)):
            lacking = [i for i, row in enumerate(rows) if column not in row or column == prompt_column]
            if lacking:
                shown = ", ".join(map(str, lacking[:5])) + (", ..." if len(lacking) > 5 else "")
                section.block(
                    f"{field}: {len(lacking)} of {len(rows)} rows lack the column {column!r} that "
                    f"{callable_name(fn)} needs (rows {shown}); add it to every row, or give the parameter a default",
                    field,
                )


def _prompt_lengths(section: Section, field: str, rows: list[dict[str, Any]], encoder: PromptTokenizer) -> None:
    step = max(1, len(rows) // LENGTH_SAMPLE)
    picked = rows[::step]
    try:
        lengths = [len(ids) for ids in encoder.encode(picked, field)[1]]
    except ConfigError as err:
        section.refused(err, field)
        return
    limit = encoder.max_prompt_length
    over = sum(n > limit for n in lengths)
    cut = sorted(lengths)
    p95 = cut[min(len(cut) - 1, int(0.95 * len(cut)))]
    of = f"{len(picked)} of {len(rows)} rows" if step > 1 else f"{len(rows)} rows"
    section.line(
        f"{field} prompt tokens ({of}): min {cut[0]}, median {statistics.median(cut):g}, p95 {p95}, max {cut[-1]}; "
        f"limit {limit}: {over} over"
    )
    if not over:
        return
    scaled = over * step
    if encoder.truncation == "error":
        section.block(
            f"{field}: {scaled} of {len(rows)} prompts are longer than data.max_prompt_length={limit} tokens (the "
            f"longest {cut[-1]}): the run would stop at the first; raise it to {cut[-1]}, or set "
            "data.prompt_truncation: left",
            "data.max_prompt_length",
        )
    else:
        section.warn(
            f"{field}: {scaled} of {len(rows)} prompts are longer than {limit} tokens and will lose their start "
            f"(data.prompt_truncation: left; the longest {cut[-1]})",
            "data.max_prompt_length",
        )
