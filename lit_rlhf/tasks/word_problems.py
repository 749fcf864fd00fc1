"""`builtin:word_problems`: short GSM-style word problems from templates, each with its answer computed here.

`word_problem_prompts(seed, templates=None, answer_format="####", chat=False)` is an endless, seeded stream of rows

    {"prompt": "Mia buys 4 notebooks at $3 each and pays with a $20 bill. How many dollars of change does Mia get?
     Give the final answer on the last line as '#### <number>'.", "answer": "8", "answer_format": "####",
     "template": "shopping"}

Templates (`TEMPLATES`): shopping, sharing, rates, ages, savings, recipe, discount; every answer is a whole number
of at least 0. `builtin:word_problems_chat` is the same stream as chat rows. Reward
`lit_rlhf.rewards.verifiable.exact_answer` (and `format_reward`); held-out metric `exact_answer`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lit_rlhf.registry import Task
from lit_rlhf.tasks.text import INSTRUCTIONS, check_format, make_row, text_policy, text_tokenizer

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sofia", "Kenji", "Amara", "Tom")
ITEMS = ("notebooks", "pens", "apples", "stickers", "marbles", "cookies", "cards", "books")


@dataclass(frozen=True)
class WordProblem:
    text: str
    answer: int
    values: dict[str, int]
    """The quantities the text states, by name (tests recompute the answer from them)."""


def _shopping(rng: random.Random) -> WordProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    bill = next(b for b in (20, 50, 100, 200) if b >= count * price)
    text = (
        f"{name} buys {count} {item} at ${price} each and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get?"
    )
    return WordProblem(text, bill - count * price, {"count": count, "price": price, "bill": bill})


def _sharing(rng: random.Random) -> WordProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, eaten = rng.randint(2, 8), rng.randint(3, 12), rng.randint(1, 3)
    text = (
        f"{name} has {friends * each} {item} and shares them equally among {friends} friends. "
        f"Each friend then gives away {eaten} of their {item}. How many {item} does each friend have left?"
    )
    return WordProblem(text, each - eaten, {"total": friends * each, "friends": friends, "given": eaten})


def _rates(rng: random.Random) -> WordProblem:
    speed1, hours1, speed2, hours2 = rng.randint(20, 90), rng.randint(1, 5), rng.randint(20, 90), rng.randint(1, 5)
    text = (
        f"A train travels at {speed1} km per hour for {hours1} hours, then at {speed2} km per hour for {hours2} "
        "hours. How many kilometres does it travel in total?"
    )
    values = {"speed1": speed1, "hours1": hours1, "speed2": speed2, "hours2": hours2}
    return WordProblem(text, speed1 * hours1 + speed2 * hours2, values)


def _ages(rng: random.Random) -> WordProblem:
    older, younger = rng.sample(NAMES, 2)
    gap, years, future = rng.randint(2, 30), rng.randint(2, 10), rng.randint(15, 40)
    text = (
        f"{older} is {gap} years older than {younger}. In {years} years, {younger} will be {future} years old. "
        f"How old is {older} now?"
    )
    return WordProblem(text, future - years + gap, {"gap": gap, "years": years, "future": future})


def _savings(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(5, 40), rng.randint(3, 12)
    spent = rng.randint(1, weekly * weeks)
    text = (
        f"{name} saves ${weekly} every week. After {weeks} weeks, {name} spends ${spent} on a bike lock. "
        f"How many dollars does {name} have left?"
    )
    return WordProblem(text, weekly * weeks - spent, {"weekly": weekly, "weeks": weeks, "spent": spent})


def _recipe(rng: random.Random) -> WordProblem:
    cups, batch, times = rng.randint(2, 6), rng.choice((6, 8, 10, 12, 24)), rng.randint(2, 6)
    text = (
        f"A recipe uses {cups} cups of flour to make {batch} cookies. "
        f"How many cups of flour are needed to make {batch * times} cookies?"
    )
    return WordProblem(text, cups * times, {"cups": cups, "batch": batch, "wanted": batch * times})


def _discount(rng: random.Random) -> WordProblem:
    price, percent = 20 * rng.randint(1, 25), rng.choice((10, 20, 25, 50, 75))
    text = f"A jacket costs ${price}. It is on sale for {percent}% off. What is the sale price in dollars?"
    return WordProblem(text, price * (100 - percent) // 100, {"price": price, "percent": percent})


TEMPLATES: dict[str, Callable[[random.Random], WordProblem]] = {
    "shopping": _shopping,
    "sharing": _sharing,
    "rates": _rates,
    "ages": _ages,
    "savings": _savings,
    "recipe": _recipe,
    "discount": _discount,
}


def word_problem_prompts(
    seed: int = 0, templates: Sequence[str] | None = None, answer_format: str = "####", chat: bool = False
) -> Iterator[dict[str, Any]]:
    """An endless, seeded stream of rows {prompt | messages, answer, answer_format, template}, each from a template
    drawn uniformly from `templates` (all of `TEMPLATES` by default). Bad settings raise ValueError here."""
    check_format(answer_format)
    names = list(TEMPLATES) if templates is None else list(templates)
    unknown = [t for t in names if t not in TEMPLATES]
    if not names or unknown:
        raise ValueError(f"templates must be a non-empty list of {sorted(TEMPLATES)}, got {templates!r}")
    return _word_problem_rows(random.Random(seed), names, answer_format, chat)


def _word_problem_rows(
    rng: random.Random, names: list[str], answer_format: str, chat: bool
) -> Iterator[dict[str, Any]]:
    while True:
        template = rng.choice(names)
        problem = TEMPLATES[template](rng)
        text = f"{problem.text} {INSTRUCTIONS[answer_format]}"
        yield make_row(text, chat, answer=str(problem.answer), answer_format=answer_format, template=template)


TASK = Task(
    name="word_problems",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: word_problem_prompts(seed=seed),
)
CHAT_TASK = Task(
    name="word_problems_chat",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: word_problem_prompts(seed=seed, chat=True),
)
