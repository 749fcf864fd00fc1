"""`builtin:arithmetic`: compute an integer expression, with the difficulty set by knobs.

`arithmetic_prompts(seed, digits=2, ops="+-", steps=1)` is an endless, seeded stream of rows such as

    {"prompt": "Calculate 37 - 48. Give the final answer on the last line as '#### <number>'.",
     "answer": "-11", "answer_format": "####"}

The defaults (also `builtin:arithmetic`'s) leave a small chat model room to learn: SmolLM2-135M-Instruct answers
31% of them right untrained (greedy), against 94% for one-digit sums and 3% for `ops="+-*", steps=2`.

- `digits`: operands have 1 to `digits` digits (an int), or `(low, high)` digits;
- `max_operand`: instead of `digits`, operands drawn uniformly from 1..`max_operand` (e.g. 12: times tables);
- `ops`: the operators drawn from, any of "+-*/"; division is always exact (the divisor divides the dividend);
- `steps`: operators per expression (1 is 'a op b'), with parentheses where the order needs them;
- `answer_format`: '####', 'boxed' or 'number' (the instruction in the prompt, and the `answer_format` column);
- `chat`: rows with `messages` (one user turn) instead of `prompt`.

`builtin:arithmetic` is the default stream, `builtin:arithmetic_chat` the same as chat rows. Reward
`lit_rlhf.rewards.verifiable.exact_answer` (and `format_reward`); held-out metric `exact_answer`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lit_rlhf.registry import Task
from lit_rlhf.tasks.text import INSTRUCTIONS, check_format, make_row, text_policy, text_tokenizer

OPERATORS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class Expression:
    """An expression tree's text, exact value, and the precedence of its top operator (3 for a number)."""

    text: str
    value: Fraction
    precedence: int = 3


def _combine(left: Expression, op: str, right: Expression) -> Expression:
    """`left op right`, parenthesising a child whose operator binds more loosely, and a right child of equal
    precedence under '-' or '/' (a - (b + c), a / (b * c))."""
    level = _PRECEDENCE[op]
    left_text = f"({left.text})" if left.precedence < level else left.text
    wrap_right = right.precedence < level or (right.precedence == level and op in "-/")
    right_text = f"({right.text})" if wrap_right else right.text
    values = {
        "+": lambda: left.value + right.value,
        "-": lambda: left.value - right.value,
        "*": lambda: left.value * right.value,
        "/": lambda: left.value / right.value,
    }
    return Expression(f"{left_text} {op} {right_text}", values[op](), level)


def _digit_range(digits: int | tuple[int, int]) -> tuple[int, int]:
    low, high = (1, digits) if isinstance(digits, int) else digits
    if not 1 <= low <= high:
        raise ValueError(f"digits must be a positive int or (low, high) with 1 <= low <= high, got {digits!r}")
    return low, high


def _number(rng: random.Random, low: int, high: int, max_operand: int | None = None) -> int:
    if max_operand is not None:
        return rng.randint(1, max_operand)
    n = rng.randint(low, high)
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)


def _divisor(rng: random.Random, value: Fraction, low: int, high: int) -> int | None:
    """A divisor of the integer `value` with low..high digits, 1 only when nothing else fits; None for none."""
    smallest, largest = 10 ** (low - 1), 10**high - 1
    if value == 0:
        return rng.randint(max(smallest, 1), largest)
    n = abs(int(value))
    found = [d for d in range(max(smallest, 1), min(largest, n) + 1) if n % d == 0]
    proper = [d for d in found if d > 1]
    return rng.choice(proper or found) if found else None


def random_expression(
    rng: random.Random,
    digits: int | tuple[int, int] = 2,
    ops: str = "+-",
    steps: int = 1,
    max_operand: int | None = None,
):
    """A random expression with `steps` operators from `ops` over numbers of `digits` digits (or 1..`max_operand`);
    every division exact."""
    if not ops or set(ops) - set(OPERATORS):
        raise ValueError(f"ops must be a non-empty string of operators from {OPERATORS!r}, got {ops!r}")
    if set(ops) == {"/"}:
        raise ValueError("ops='/' alone cannot chain exact divisions; add another operator, e.g. ops='*/'")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if max_operand is not None and (
        isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1
    ):
        raise ValueError(f"max_operand must be a positive int or None, got {max_operand!r}")
    low, high = _digit_range(digits)
    if max_operand is not None:
        low, high = 1, len(str(max_operand))  # the divisor search's digit bounds
    expr = Expression(str(n := _number(rng, low, high, max_operand)), Fraction(n))
    for _ in range(steps):
        op = rng.choice(ops)
        if op == "/":
            divisor = _divisor(rng, expr.value, low, high)
            if divisor is not None:
                expr = _combine(expr, "/", Expression(str(divisor), Fraction(divisor)))
                continue
            op = rng.choice(ops.replace("/", ""))  # no divisor of this value has the allowed digits
        leaf = Expression(str(n := _number(rng, low, high, max_operand)), Fraction(n))
        expr = _combine(expr, op, leaf) if rng.random() < 0.5 else _combine(leaf, op, expr)
    return expr


def arithmetic_prompts(
    seed: int = 0,
    digits: int | tuple[int, int] = 2,
    ops: str = "+-",
    steps: int = 1,
    answer_format: str = "####",
    chat: bool = False,
    max_operand: int | None = None,
) -> Iterator[dict[str, Any]]:
    """An endless, seeded stream of arithmetic rows {prompt | messages, answer, answer_format} (module docstring).
    Bad settings raise ValueError here, not at the first row."""
    check_format(answer_format)
    random_expression(random.Random(0), digits, ops, steps, max_operand)
    return _arithmetic_rows(random.Random(seed), digits, ops, steps, answer_format, chat, max_operand)


def _arithmetic_rows(
    rng: random.Random,
    digits: int | tuple[int, int],
    ops: str,
    steps: int,
    answer_format: str,
    chat: bool,
    max_operand: int | None,
) -> Iterator[dict[str, Any]]:
    while True:
        expr = random_expression(rng, digits, ops, steps, max_operand)
        text = f"Calculate {expr.text}. {INSTRUCTIONS[answer_format]}"
        yield make_row(text, chat, answer=str(expr.value), answer_format=answer_format)


TASK = Task(
    name="arithmetic",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: arithmetic_prompts(seed=seed),
)
CHAT_TASK = Task(
    name="arithmetic_chat",
    tokenizer=text_tokenizer,
    policy=text_policy,
    prompts=lambda seed: arithmetic_prompts(seed=seed, chat=True),
)
