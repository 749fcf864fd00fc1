"""The rewards section: each reward and metric function called once, on a few real rows, with stand-in responses.

The stand-ins are an empty reply, a few random tokens, a long run of random tokens (`max_new_tokens` of them) and,
when the rows have a reference column (`answer`, `solution`, ...), the reference answer itself. A reward that
gives every stand-in of a row the same score cannot tell responses apart: when one of them is the reference
answer that blocks the run; without one (a strict reward may score every guess 0) it is a warning.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.preflight.data import prompt_sets
from lit_rlhf.preflight.report import Section
from lit_rlhf.rewards.columns import required_columns
from lit_rlhf.rewards.functions import RewardError, RewardFn, call_reward_fn, callable_name

ROWS = 4
REFERENCE_COLUMNS = ("answer", "solution", "reference", "ground_truth", "target", "label", "completion")
SHORT_RANDOM = 4


def _spread(rows: list[dict[str, Any]], fn: RewardFn, count: int) -> list[dict[str, Any]]:
    """`count` rows spread over `rows`, of those that have every column `fn` needs (the data section names the
    others)."""
    needed = required_columns(fn)
    usable = [row for row in rows if needed <= row.keys()]
    step = max(1, len(usable) // count)
    return usable[::step][:count]


def stand_ins(row: dict[str, Any], tokenizer: Any, long_tokens: int, seed: int) -> dict[str, str]:
    """Responses to score for `row`: empty, random tokens (short and long), and the reference answer if any."""
    rng = random.Random(seed)
    size = len(tokenizer)

    def random_text(n: int) -> str:
        return tokenizer.decode([rng.randrange(size) for _ in range(n)], skip_special_tokens=True)

    found = {"empty": "", "random": random_text(SHORT_RANDOM), "long": random_text(long_tokens)}
    reference = reference_answer(row)
    if reference is not None:
        found[f"reference ({reference[0]})"] = reference[1]
    return found


def reference_answer(row: dict[str, Any]) -> tuple[str, str] | None:
    """(where, text) of the row's reference answer: a column named like one, or such a key of a dict column
    (reasoning-gym's `rg_entry['answer']`); None when the row has none."""
    column = next((c for c in REFERENCE_COLUMNS if row.get(c) is not None), None)
    if column is not None:
        return column, str(row[column])
    for name, value in row.items():
        key = next((k for k in REFERENCE_COLUMNS if isinstance(value, dict) and value.get(k) is not None), None)
        if key is not None:
            return f"{name}.{key}", str(value[key])
    return None


def check_rewards(section: Section, module: Any, datamodule: Any, tokenizer: Any) -> None:
    """Score stand-ins with every reward function (on training rows) and metric function (on held-out rows)."""
    sets = prompt_sets(datamodule)
    held_out = sets[1][1] if len(sets) > 1 else sets[0][1]
    long_tokens = module.sampling.max_new_tokens
    nan_score = module.reward.nan_score
    for fn in module.reward.reward_fns:
        _score(section, fn, "reward", _spread(sets[0][1], fn, ROWS), datamodule, tokenizer, long_tokens, nan_score)
    for fn in module.metric_fns.values():
        _score(section, fn, "metric", _spread(held_out, fn, ROWS), datamodule, tokenizer, long_tokens, nan_score)
    if module.specs.reward_model is not None:
        section.line("reward model: not loaded here; --dry-run scores real responses with it")
    environment = module.hparams.get("environment")
    if environment is not None:
        section.line("environment: its per-turn rewards come with the rollouts (--dry-run runs them)")
    elif not module.reward.reward_fns and module.specs.reward_model is None:
        section.block("no reward: no reward functions, no reward model and no environment", "model.reward_fns")


def _score(
    section: Section,
    fn: RewardFn,
    kind: str,
    rows: list[dict[str, Any]],
    dm: Any,
    tokenizer: Any,
    long_tokens: int,
    nan_score: float | None,
) -> None:
    if not rows:
        section.line(f"{kind} {callable_name(fn)}: no row has the columns it needs; not called")
        return
    texts = PromptTokenizer(tokenizer, 10**9, "left", dm.prompt_column, dm.messages_column, "text")
    batch = texts(rows)
    per_row = [stand_ins(row, tokenizer, long_tokens, seed=i) for i, row in enumerate(rows)]
    names = list(dict.fromkeys(name for found in per_row for name in found))
    cells = [(i, name) for i in range(len(rows)) for name in names if name in per_row[i]]
    prompts = [batch.texts[i] for i, _ in cells]
    responses = [per_row[i][name] for i, name in cells]
    meta = {key: [values[i] for i, _ in cells] for key, values in batch.meta.items()}
    try:
        scores = call_reward_fn(fn, prompts, responses, meta, nan_score)
    except RewardError as err:
        section.block(f"{kind} {callable_name(fn)} failed on stand-in responses: {err}", f"model.{kind}_fns")
        return
    table = {cell: float(score) for cell, score in zip(cells, scores.tolist(), strict=True)}
    shown = []
    for name in names:
        values = torch.tensor([v for (i, n), v in table.items() if n == name])
        shown.append(f"{name} {values.mean():.3g} [{values.min():.3g}, {values.max():.3g}]")
    section.line(f"{kind} {callable_name(fn)} on {len(rows)} rows: " + ", ".join(shown))
    if kind == "reward":
        _judge(section, fn, table, len(rows), any(name.startswith("reference") for name in names))


def _judge(section: Section, fn: RewardFn, table: dict[tuple[int, str], float], rows: int, reference: bool) -> None:
    """Flag a reward whose score does not depend on the response."""
    by_row = [{v for (i, _), v in table.items() if i == row} for row in range(rows)]
    if any(len(values) > 1 for values in by_row):
        return
    every = set().union(*by_row)
    what = (
        f"gives {every.pop():.4g} to every stand-in response of every row"
        if len(every) == 1
        else "gives each row one score whatever the response (it reads the prompt or the columns only)"
    )
    tried = "an empty, a random and a long reply" + (" and the reference answer" if reference else "")
    message = f"reward {callable_name(fn)} {what}, on {rows} rows with {tried}: it cannot tell responses apart"
    if reference:
        section.block(message, "model.reward_fns")
    else:
        section.warn(message + " (a strict reward may score every guess alike: check it)", "model.reward_fns")
