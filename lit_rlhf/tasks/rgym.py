"""`builtin:reasoning_gym/<dataset>?<knob>=<value>&...`: any reasoning-gym dataset as a task (needs
`pip install 'lit_rlhf[reasoning-gym]'`).

The knobs are the fields of the dataset's config (`chain_sum?min_terms=2&max_terms=3&max_digits=2`), each value read
as JSON (`true`, `3`, `[1, 2]`; anything that is not JSON is a string; an enum knob takes the enum's values), plus
`answer_format`: `final` (the default: the answer is what the last line gives after its last `=`, `is` or
`answer:`), `tags` (inside the reply's last `<answer></answer>`) or `last_line` (the reply's last non-empty line).
reasoning-gym's own `seed` and `size` are set from the stream's seed and cannot be knobs.

Rows are chat rows: the dataset's question and the answer instruction as one user message, with the columns
`rg_task` (the spec, which says how to rebuild the dataset), `rg_entry` (the dataset's item: question, answer,
metadata) and `answer_format`. `score_answer` scores a reply with the dataset's own `score_answer` on the extracted
answer; `solved` is 1 where that score is full marks (held-out exact accuracy); `answer_format_reward` is 1 for a
reply in the asked format (one non-empty line for `final` and `last_line`, a non-empty tagged answer for `tags`).
A reply the dataset's scorer raises on (some parse without a guard) scores 0, with one warning per task, as long as
the scorer gives the entry's own answer full marks; otherwise its error propagates.

**Held out by content.** reasoning-gym seeds item i with `seed + i`, so two nearby seeds share most items. Here a
question belongs to the held-out share when the SHA-256 of its text falls in the lowest `HELD_OUT_SHARE` of the
range: the training stream (`prompts`, any seed) skips those questions and the held-out stream
(`held_out_prompts`) yields only them, each once. No held-out question is ever trained on, whatever the seeds.

**Seeded means the same problems in every process.** Some generators iterate over a Python set of strings or sympy
symbols (`polynomial_multiplication` picks its terms from one), so their problems change with Python's string-hash
seed, which is random in every process unless `PYTHONHASHSEED` is set: the held-out set of one run would not be the
next run's, or the untrained model's. When a task is named without a fixed `PYTHONHASHSEED`, its first problems are
made here and in two interpreters with hash seeds 0 and 1; if they differ, that is a `ConfigError` asking for one.
"""

from __future__ import annotations

import difflib
import enum
import functools
import hashlib
import json
import os
import random
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import fields
from subprocess import PIPE, Popen
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from lit_rlhf.config import ConfigError
from lit_rlhf.registry import Task, TaskFamily
from lit_rlhf.tasks import rgym_fingerprint
from lit_rlhf.tasks.text import make_row, text_policy, text_tokenizer

FAMILY = "reasoning_gym"
INSTALL = "pip install 'lit_rlhf[reasoning-gym]'"
INSTRUCTIONS = {
    "final": "Give the final answer on the last line.",
    "tags": "Give only the final answer, between <answer> and </answer>.",
    "last_line": "Give only the final answer, alone on the last line.",
}
"""What each prompt adds after the question to say how to answer, per `answer_format`."""
OWN_KNOBS = ("answer_format",)
RESERVED = ("seed", "size")
HELD_OUT_SHARE = 0.125
"""The share of distinct questions that only the held-out stream yields."""
CHUNK = 1000
"""Items per reasoning-gym dataset instance (some generate all their items up front)."""
MAX_MISSES = 20_000
"""Items drawn in a row without a usable one before a stream gives up (the knobs allow too few problems)."""
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FINAL = re.compile(r"(?:=|\bis\b:?|\banswer:)((?:(?!=|\bis\b).)*)$", re.IGNORECASE)
_DECORATION = " \t*$`.\"'"
"""Stripped from around a 'final' answer: spaces, markdown emphasis and maths, a full stop, quotes."""


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise ConfigError(f"builtin:{FAMILY}/... needs the reasoning-gym package: {INSTALL}") from err
    return DATASETS


def parse_spec(spec: str, field: str) -> tuple[str, dict[str, Any], str]:
    """'<dataset>?<knob>=<value>&...' -> (dataset, the dataset's knobs, answer_format), each checked."""
    name, _, query = spec.partition("?")
    datasets = _registry()
    if name not in datasets:
        close = difflib.get_close_matches(name, datasets, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"one of {len(datasets)} such as {sorted(datasets)[:8]}"
        raise ConfigError(f"{field}: reasoning-gym has no dataset {name!r}; {hint}")
    knobs: dict[str, Any] = {}
    for pair in query.split("&") if query else []:
        key, has_value, text = pair.partition("=")
        if not key or not has_value or key in knobs:
            problem = "is given twice" if key in knobs else "is not <knob>=<value>"
            raise ConfigError(f"{field}: {pair!r} in {spec!r} {problem}")
        try:
            knobs[key] = json.loads(text)
        except ValueError:
            knobs[key] = text
    answer_format = knobs.pop("answer_format", "final")
    if answer_format not in INSTRUCTIONS:
        raise ConfigError(f"{field}: answer_format must be one of {sorted(INSTRUCTIONS)}, got {answer_format!r}")
    allowed = sorted(f.name for f in fields(datasets[name][1]) if f.name not in RESERVED)
    for key in knobs:
        if key in RESERVED:
            raise ConfigError(f"{field}: {key!r} is set by lit_rlhf from data.seed and the stream; drop it")
        if key not in allowed:
            raise ConfigError(f"{field}: {name} has no knob {key!r}; its knobs: {', '.join(allowed + list(OWN_KNOBS))}")
    hints = get_type_hints(datasets[name][1])
    knobs = {key: _as_enum(value, hints[key], f"{field}: {name} knob {key!r}") for key, value in knobs.items()}
    for key, value in knobs.items():
        _check_scalar(value, hints[key], f"{field}: {name} knob {key!r}")
    return name, knobs, answer_format


def _check_scalar(value: Any, hint: Any, where: str) -> None:
    """A `ConfigError` when a bool knob's value is not true/false, or a number knob's is not a number (the
    query string's values are JSON: 'False', 'yes' or '1' would reach a bool knob as a truthy string or int)."""
    options = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)  # not list[int]'s int
    kinds = {kind for kind in options if kind in (bool, int, float)}
    if value is None and type(None) in options:
        return
    if kinds == {bool}:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not a boolean; write true or false (lower case)")
    elif kinds and (isinstance(value, bool) or not isinstance(value, int | float)):
        wanted = " or ".join(sorted(k.__name__ for k in kinds))
        raise ConfigError(f"{where}: {value!r} is not a number ({wanted})")
    elif kinds == {int} and isinstance(value, float):
        raise ConfigError(f"{where}: {value!r} is not an integer")


def _as_enum(value: Any, hint: Any, where: str) -> Any:
    """`value` with each string that the knob's type `hint` says is an Enum made into that Enum, by its value
    (`aiw?task_types=["siblings"]`: `list[TaskType]`); any other value as it is."""
    kinds = [kind for kind in (hint, *get_args(hint)) if isinstance(kind, type) and issubclass(kind, enum.Enum)]
    if not kinds:
        return value
    if isinstance(value, list):
        return [_as_enum(item, kinds[0], where) for item in value]
    if not isinstance(value, str):
        return value
    try:
        return kinds[0](value)
    except ValueError:
        choices = [member.value for member in kinds[0]]
        raise ConfigError(f"{where}: {value!r} is not one of {choices}") from None


def make_dataset(name: str, knobs: dict[str, Any], seed: int, field: str) -> Any:
    """reasoning-gym's dataset `name` with `knobs`, `CHUNK` items from `seed`; a `ConfigError` for bad knobs."""
    dataset_cls, config_cls = _registry()[name]
    try:
        config = config_cls(**knobs, seed=seed, size=CHUNK)
        return dataset_cls(config=config)
    except (AssertionError, TypeError, ValueError) as err:
        raise ConfigError(f"{field}: {name} refuses the knobs {knobs}: {err or type(err).__name__}") from err


def held_out(question: str) -> bool:
    """Whether `question` is in the held-out share (by the SHA-256 of its text, whatever the seed)."""
    digest = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return digest < HELD_OUT_SHARE * 2**64


def _items(name: str, knobs: dict[str, Any], seed: int, field: str) -> Iterator[dict[str, Any]]:
    """An endless stream of items: chunk c comes from a dataset seeded from (seed, c)."""
    chunk = 0
    while True:
        dataset = make_dataset(name, knobs, random.Random(f"{seed}:{chunk}").randrange(2**31), field)
        yield from (dataset[i] for i in range(CHUNK))
        chunk += 1


def _rows(spec: str, seed: int, held: bool, field: str) -> Iterator[dict[str, Any]]:
    """The items whose question is (`held`) or is not in the held-out share, as chat rows; held-out ones once each."""
    name, knobs, answer_format = parse_spec(spec, field)
    seen: set[str] = set()
    misses = 0
    for item in _items(name, knobs, seed, field):
        question = item["question"]
        if held_out(question) != held or (held and question in seen):
            misses += 1
            if misses >= MAX_MISSES:
                kind = "new held-out" if held else "training"
                raise ConfigError(
                    f"{field}: builtin:{FAMILY}/{spec} gave no {kind} question in {MAX_MISSES} draws "
                    f"({len(seen)} held-out so far): its knobs allow too few distinct problems; widen them"
                    + (" or lower data.val_size" if held else "")
                )
            continue
        misses = 0
        if held:
            seen.add(question)
        text = f"{question}\n{INSTRUCTIONS[answer_format]}"
        yield make_row(text, True, rg_task=spec, rg_entry=item, answer_format=answer_format)


def hash_seed_is_random() -> bool:
    """Whether this process (and the processes it starts) hash strings with a random seed: no fixed
    PYTHONHASHSEED."""
    return os.environ.get("PYTHONHASHSEED", "random") in ("", "random")


@functools.cache
def depends_on_hash_seed(spec: str) -> bool:
    """Whether the problems of `spec` change with Python's string-hash seed: its fingerprint here and in two fresh
    interpreters started with PYTHONHASHSEED 0 and 1 (a few seconds, once per spec and process)."""
    name, knobs, _ = parse_spec(spec, "depends_on_hash_seed")
    run = f"import runpy; runpy.run_path({rgym_fingerprint.__file__!r}, run_name='__main__')"  # no lit_rlhf import
    script = [sys.executable, "-c", run, rgym_fingerprint.encode(name, knobs, CHUNK)]
    children = [
        Popen(script, env={**os.environ, "PYTHONHASHSEED": str(hash_seed)}, stdout=PIPE, stderr=PIPE, text=True)
        for hash_seed in (0, 1)
    ]
    prints = {rgym_fingerprint.fingerprint(name, knobs, CHUNK)}
    for child in children:
        out, err = child.communicate()
        if child.returncode:
            raise RuntimeError(f"making {name}'s problems in a fresh interpreter failed:\n{err[-2000:]}")
        prints.add(out.strip())
    return len(prints) > 1


def _member(spec: str, field: str) -> Task:
    """The task for '<dataset>?<knobs>', its spec and knob values checked now (before any model loads): the config
    must take them and the generator must make a problem with them."""
    name, knobs, _ = parse_spec(spec, field)
    dataset = make_dataset(name, knobs, 0, field)
    try:
        dataset[0]
    except Exception as err:  # a generator that fails on its knobs fails in its own way; name the knobs
        raise ConfigError(
            f"{field}: {name} accepts the knobs {knobs} but fails to make a problem with them ({err!r}); check them "
            "against its config (a list knob and its weights knob must have the same length)"
        ) from err
    if hash_seed_is_random() and depends_on_hash_seed(spec):
        raise ConfigError(
            f"{field}: builtin:{FAMILY}/{spec}: {name}'s problems change with Python's string-hash seed, which is "
            "random in every process, so its training problems and held-out set would differ from run to run "
            "(and between the processes of one run); start Python with a fixed seed: PYTHONHASHSEED=0 python "
            "train.py ... (export it for torchrun and scripts)"
        )
    return _task(spec)


@functools.cache
def _task(spec: str) -> Task:
    return Task(
        name=f"{FAMILY}/{spec}",
        tokenizer=text_tokenizer,
        policy=text_policy,
        prompts=lambda seed: _rows(spec, seed, False, "data.prompts"),
        held_out_prompts=lambda seed: _rows(spec, seed, True, "data.val_prompts"),
    )


FAMILY_ENTRY = TaskFamily(
    name=FAMILY,
    member=_member,
    usage=f"builtin:{FAMILY}/<dataset>?<knob>=<value>&... (e.g. builtin:{FAMILY}/chain_sum?max_terms=3)",
)


# ------------------------------------------------------------------------------------------- rewards and metrics


def extract(response: str, answer_format: str) -> str | None:
    """The answer in `response`, stripped; None when there is none. 'tags': inside the last <answer></answer>;
    'last_line': the last non-empty line; 'final': of that line, what follows its last '=', 'is' or 'answer:'
    (all of it when it has none), without markdown emphasis, `$`, quotes or a final full stop."""
    if answer_format == "tags":
        found = _ANSWER_TAG.findall(response)
        return found[-1].strip() if found else None
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    if answer_format == "last_line":
        return lines[-1] if lines else None
    if answer_format == "final":
        if not lines:
            return None
        match = _FINAL.search(lines[-1])
        answer = (match.group(1) if match else lines[-1]).strip(_DECORATION)
        return answer or None
    raise ValueError(f"answer_format must be one of {sorted(INSTRUCTIONS)}, got {answer_format!r}")


@functools.cache
def _scorer(spec: str) -> Any:
    name, knobs, _ = parse_spec(spec, "rg_task")
    return make_dataset(name, knobs, 0, "rg_task")


def _scores(responses: Sequence[str], rg_task: Sequence[str], rg_entry: Sequence[Any], fmt: Sequence[str]):
    return [
        _score(task, extract(response, answer_format), entry)
        for response, task, entry, answer_format in zip(responses, rg_task, rg_entry, fmt, strict=True)
    ]


def _score(task: str, answer: str | None, entry: dict[str, Any]) -> float:
    """The dataset's `score_answer`; 0.0 for an answer it raises on while it scores the entry's own answer (some
    scorers parse without a guard: prime_factorization's `int()` on 'The prime factors are 3'). A scorer that
    raises on the right answer too is broken, and that error propagates."""
    scorer = _scorer(task)
    try:
        return float(scorer.score_answer(answer, entry))
    except Exception as err:
        scorer.score_answer(entry["answer"], entry)
        _warn_unscorable(task, answer, repr(err))
        return 0.0


_WARNED_UNSCORABLE: set[str] = set()


def _warn_unscorable(task: str, answer: str | None, error: str) -> None:
    """Once per task: a reply scored 0 because the dataset's scorer raised on it."""
    if task in _WARNED_UNSCORABLE:
        return
    _WARNED_UNSCORABLE.add(task)
    warnings.warn(
        f"rg_task {task!r}: the dataset's score_answer raised {error} on the answer {answer!r}; such a reply scores "
        "0 (the scorer gives its own answer full marks, so the reply, not the task, is malformed)",
        stacklevel=2,
    )


def score_answer(
    prompts: Sequence[str],
    responses: Sequence[str],
    rg_task: Sequence[str],
    rg_entry: Sequence[Any],
    answer_format: Sequence[str],
    **meta: Any,
) -> list[float]:
    """The dataset's own `score_answer` of each reply's extracted answer (partial credit where it gives some)."""
    return _scores(responses, rg_task, rg_entry, answer_format)


def solved(
    prompts: Sequence[str],
    responses: Sequence[str],
    rg_task: Sequence[str],
    rg_entry: Sequence[Any],
    answer_format: Sequence[str],
    **meta: Any,
) -> list[float]:
    """1.0 where the dataset's `score_answer` gives full marks, else 0.0: exact accuracy."""
    return [float(s >= 1.0) for s in _scores(responses, rg_task, rg_entry, answer_format)]


def answer_format_reward(
    prompts: Sequence[str], responses: Sequence[str], answer_format: Sequence[str], **meta: Any
) -> list[float]:
    """1.0 where the reply answers in the row's `answer_format`, else 0.0: a non-empty answer between
    <answer></answer> ('tags'), or a reply of one non-empty line ('last_line', 'final')."""
    return [float(_follows(r, f)) for r, f in zip(responses, answer_format, strict=True)]


def _follows(response: str, answer_format: str) -> bool:
    if answer_format in ("last_line", "final"):
        return len([line for line in response.splitlines() if line.strip()]) == 1
    return bool(extract(response, answer_format))
