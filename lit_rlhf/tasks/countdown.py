"""`builtin:countdown`: reach a target number from given numbers with + - * / and parentheses.

`countdown_prompts(seed, count=4, max_number=50, max_target=200, chat=False)` is an endless, seeded stream of rows

    {"prompt": "Using the numbers [4, 17, 9, 30], each at most once, ... make 151. ... '#### <expression>'.",
     "numbers": [4, 17, 9, 30], "target": 151}

Every instance is solvable: its target is the value of a random expression over all its numbers.
`builtin:countdown_chat` is the same stream as chat rows.

The rules `check_countdown` applies to the expression after the last '####' (or else in the last \\boxed{}):
it parses (`lit_rlhf.tasks.expression`: integers, + - * /, parentheses, no unary minus), uses each given number
at most once (a number given twice may be used twice), divides only exactly (every division leaves a whole
number; intermediate results may be negative), never by zero, and equals the target.

Reward and held-out metric: `lit_rlhf.tasks.countdown.countdown_reward` (1.0 or 0.0).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from lit_rlhf.registry import Task
from lit_rlhf.rewards.verifiable import after_hashes, last_boxed
from lit_rlhf.tasks.expression import ExpressionError, evaluate
from lit_rlhf.tasks.text import make_row, text_policy, text_tokenizer

_OPS = "+-*/"


def check_countdown(expression: str, numbers: Sequence[int], target: int) -> str | None:
    """None when `expression` reaches `target` by the rules (module docstring), else the reason it does not."""
    try:
        value, used = evaluate(expression, integer_steps=True)
    except ExpressionError as err:
        return str(err)
    extra = Counter(int(u) for u in used) - Counter(int(n) for n in numbers)  # integers: no decimals here
    if extra:
        return f"uses {sorted(extra.elements())} beyond the given numbers {list(numbers)}"
    if value != target:
        return f"equals {value}, not {target}"
    return None


def countdown_expression(response: str) -> str | None:
    """The expression a response gives: after the last '####' (its first line), else in the last \\boxed{}."""
    tail = after_hashes(response)
    if tail is not None:
        return tail.strip().split("\n")[0].rstrip(". ")
    boxed = last_boxed(response)
    return boxed.strip() if boxed is not None else None


def countdown_reward(
    prompts: Sequence[str], responses: Sequence[str], numbers: Sequence[Sequence[int]], target: Sequence[int], **meta
) -> list[float]:
    """1.0 when the response's expression (`countdown_expression`) passes `check_countdown`, else 0.0."""
    scores = []
    for response, given, goal in zip(responses, numbers, target, strict=True):
        expression = countdown_expression(response)
        scores.append(float(expression is not None and check_countdown(expression, given, int(goal)) is None))
    return scores


def countdown_instance(
    rng: random.Random, count: int = 4, max_number: int = 50, max_target: int = 200
) -> tuple[list[int], int, str]:
    """(numbers, target, a solution): `count` numbers in 1..max_number and a target in 1..max_target reached by a
    random expression over all of them (positive whole intermediate results, exact divisions)."""
    if count < 2 or max_number < 1 or max_target < 1:
        raise ValueError(f"need count >= 2, max_number >= 1, max_target >= 1; got {count}, {max_number}, {max_target}")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        parts = [(n, str(n)) for n in numbers]
        while len(parts) > 1:
            (a, a_text), (b, b_text) = parts.pop(rng.randrange(len(parts))), parts.pop(rng.randrange(len(parts)))
            op = rng.choice(_OPS)
            if (op == "-" and a <= b) or (op == "/" and a % b != 0):
                op = rng.choice("+*")
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            parts.append((value, f"({a_text} {op} {b_text})"))
        target, text = parts[0]
        if 1 <= target <= max_target:
            return numbers, target, text[1:-1]


def countdown_prompts(
    seed: int = 0, count: int = 4, max_number: int = 50, max_target: int = 200, chat: bool = False
) -> Iterator[dict[str, Any]]:
    """An endless, seeded stream of solvable rows {prompt | messages, numbers, target} (module docstring).
    Bad settings raise ValueError here, not at the first row."""
    countdown_instance(random.Random(0), count, max_number, max_target)
    return _countdown_rows(random.Random(seed), count, max_number, max_target, chat)


def _countdown_rows(
    rng: random.Random, count: int, max_number: int, max_target: int, chat: bool
) -> Iterator[dict[str, Any]]:
    while True:
        numbers, target, _ = countdown_instance(rng, count, max_number, max_target)
        text = (
            f"Using the numbers {numbers}, each at most once, and the operations + - * / with parentheses, write an "
            f"expression that equals {target}. Every division must leave a whole number. Give the expression on the "
            "last line as '#### <expression>'."
        )
        yield make_row(text, chat, numbers=numbers, target=target)


TASK = Task(
    name="countdown",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: countdown_prompts(seed=seed),
)
CHAT_TASK = Task(
    name="countdown_chat",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: countdown_prompts(seed=seed, chat=True),
)
