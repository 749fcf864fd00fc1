"""Rewards for answers that can be checked: find the final number in a reply and compare it with the row's answer.

Reward functions follow the contract `fn(prompts, responses, **meta) -> list[float]` and read the prompt rows'
`answer` column (any number, or a string such as "1,234", "-3", "0.5" or "3/4"):

- `exact_answer`: 1.0 when the reply's final answer equals `answer` (within a small tolerance), else 0.0; also the
  held-out exact accuracy when named in `model.metric_fns`;
- `format_reward`: 1.0 when the reply gives a number in the format its row asks for (the `answer_format` column:
  "####" or "boxed"), else 0.0;
- `math_verify_answer`: symbolic equivalence by the `math-verify` package (`pip install 'lit_rlhf[math]'`).

The final answer of a reply (`extract_answer`) is, in this order of preference: the first number after the last
"####"; the last number inside the last `\\boxed{...}` (nested braces allowed, `\\frac{a}{b}` read as a/b); the first
number after the last "answer is" / "answer:"; else the last number anywhere. Numbers may carry a sign (also the
unicode minus U+2212, or "+"), thousands commas ("1,234"), a decimal part, a fraction bar ("3/4"; "3/0" is no
number), and a "$" or a unit around them. A sign counts only where it does not follow a digit or a letter, so
"10-3" reads as 10 and 3.

Powers are read as their value, never as their mantissa or exponent: scientific notation ("1e3", "1.5E-2",
"1.2 \\times 10^{3}", "3*10**4") and exponents ("2^{10}", "2^3^2" = 2^9, "-2^2" = -4, "9^{9}") are computed exactly
when the result has at most MAX_DIGITS digits; a larger one ("9^{9^{9}}"), a fractional or unreadable exponent
("4^{1/2}", "2^{x}"), a number written with more than MAX_DIGITS digits, and a number that is itself an exponent of
something else ("x^2", "(1+2)^2") are *refused*: they count as a number that is no answer (a reply whose final
answer is one scores 0, it does not fall back to another number). Nothing is ever evaluated beyond that size.

Integers are compared exactly (an integer `answer` needs exactly that value: 12000012 is not 12000000, nor is
2.0000001 2); other answers within ABS_TOL + REL_TOL * |answer|.
"""

from __future__ import annotations

import functools
import numbers
import re
import threading
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np

from lit_rlhf.rewards.functions import isolated

FORMATS = ("####", "boxed", "number")
"""Answer formats a prompt can ask for: after '####' on the last line, inside \\boxed{}, or the bare number."""

ABS_TOL = 1e-6
REL_TOL = 1e-6
"""The tolerance for an `answer` that is not an integer; an integer answer is compared exactly."""
MAX_DIGITS = 1000
"""The most digits a number in a reply may have, written out or as the value of a power; more is refused."""
_MAX_BITS = int(MAX_DIGITS * 3.33)
_MAX_DEPTH = 8
"""Nested exponents deeper than this are refused (bounds the recursion)."""
MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's parse and verify time limits, in the main thread."""

_NUMBER = re.compile(
    r"(?P<sign>(?<![\w.)\]])[-+\u2212])?\$?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?P<frac>\.\d+)?"
    r"(?(int)(?:/(?P<den>\d+)(?!\d|\.\d))?)"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


_SCI_E = re.compile(r"[eE](?P<sign>[-+\u2212])?(?P<digits>\d+)")
_POWER = re.compile(r"\s*(?:\^|\*\*(?=\s*[\d{(+\-\u2212]))\s*")
_TIMES_TEN = re.compile(r"\s*(?:\\times|\\cdot|\u00d7|\*|x)\s*10\s*(?:\^|\*\*)\s*")
_EXPONENT_BEFORE = re.compile(r"(?:\^|(?<=[\w)\]}])\*\*)\s*[{(]?\s*$")
"""Before a number that is the exponent of something else ('x^2', 'x**2'; not markdown bold '**42**')."""
_PLAIN = re.compile(r"(?P<sign>[-+\u2212])?(?P<digits>\d+(?:\.\d+)?)")
_CLOSING = {"{": "}", "(": ")"}


def _power(base: Fraction | None, exponent: Fraction | None) -> Fraction | None:
    """base ** exponent exactly, or None (refused) when either is refused, the exponent is not an integer, the base
    is 0 with a negative exponent, or the result would have more than MAX_DIGITS digits (never computed)."""
    if base is None or exponent is None or exponent.denominator != 1:
        return None
    e = int(exponent)
    if abs(base) in (0, 1):
        return None if base == 0 and e < 0 else base ** (e % 2 if base == -1 else min(abs(e), 1))
    size = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if abs(e) * size > _MAX_BITS:
        return None
    return base**e


def _group(text: str, pos: int) -> int | None:
    """The index just past the bracket matching the one at `pos`, or None when it does not close."""
    opening, depth = text[pos], 0
    for i in range(pos, len(text)):
        depth += (text[i] == opening) - (text[i] == _CLOSING[opening])
        if depth == 0:
            return i + 1
    return None


def _operand(text: str, pos: int, depth: int) -> tuple[Fraction | None, int] | None:
    """The exponent starting at `pos` (a {group}, a (group) or a plain number, itself maybe raised to a power) and
    the index after it; None when there is none there."""
    if pos < len(text) and text[pos] in _CLOSING:
        end = _group(text, pos)
        if end is None:
            return None
        return (_single(text[pos + 1 : end - 1], depth + 1) if depth < _MAX_DEPTH else None), end
    match = _PLAIN.match(text, pos)
    if match is None:
        return None
    value = _decimal(match["digits"])
    if value is not None and match["sign"] in ("-", "\u2212"):
        value = -value
    power = _POWER.match(text, match.end())
    if power is not None:
        inner = _operand(text, power.end(), depth + 1) if depth < _MAX_DEPTH else (None, len(text))
        if inner is not None:
            return _power(value, inner[0]), inner[1]
    return value, match.end()


def _single(text: str, depth: int) -> Fraction | None:
    """The value of `text` when it is exactly one number (a power too), else None."""
    text = text.strip()
    found = _scan(text, depth)
    if len(found) != 1 or found[0][0] != 0 or found[0][1] != len(text):
        return None
    return found[0][2]


def _decimal(digits: str) -> Fraction | None:
    """'1234' or '12.5' as a fraction; None (refused) past MAX_DIGITS digits."""
    return Fraction(digits) if len(digits) <= MAX_DIGITS + 1 else None


def _scan(text: str, depth: int = 0) -> list[tuple[int, int, Fraction | None]]:
    """(start, end, value) of every number in `text`, in order; the value None for a refused one (module docstring)."""
    found: list[tuple[int, int, Fraction | None]] = []
    pos = 0
    while pos <= len(text):
        match = _NUMBER.search(text, pos)
        if match is None:
            break
        whole, decimals, den = match["int"], match["frac"], match["den"]
        if whole is None and decimals is None:
            pos = match.end() + 1 if match.end() == match.start() else match.end()
            continue
        end = match.end()
        value: Fraction | None = _decimal((whole or "0").replace(",", "") + (decimals or ""))
        if den is not None:
            if not den.strip("0"):
                pos = end
                continue  # '3/0' is not a number
            divisor = _decimal(den)
            value = None if value is None or divisor is None else value / divisor
        if _EXPONENT_BEFORE.search(text[max(0, match.start() - 16) : match.start()]):
            value = None  # an exponent of something that is not a number: 'x^2'
        sci, power, times_ten = _SCI_E.match(text, end), _POWER.match(text, end), _TIMES_TEN.match(text, end)
        if sci is not None:
            digits = sci["digits"]
            exponent = Fraction(int(digits)) if len(digits) <= 6 else None
            if exponent is not None and sci["sign"] in ("-", "\u2212"):
                exponent = -exponent
            value = None if den is not None or value is None else _scaled(value, exponent)
            end = sci.end()
        elif power is not None and (operand := _operand(text, power.end(), depth)) is not None:
            value = None if den is not None else _power(value, operand[0])
            end = operand[1]
        elif times_ten is not None and (operand := _operand(text, times_ten.end(), depth)) is not None:
            value = None if den is not None or value is None else _scaled(value, operand[0])
            end = operand[1]
        if value is not None and match["sign"] in ("-", "\u2212"):
            value = -value
        found.append((match.start(), end, value))
        pos = end
    return found


def _scaled(value: Fraction, exponent: Fraction | None) -> Fraction | None:
    """value * 10**exponent, refused like `_power`."""
    scale = _power(Fraction(10), exponent)
    if scale is None or value.numerator.bit_length() + scale.numerator.bit_length() > _MAX_BITS:
        return None
    return value * scale


def _numbers(text: str) -> list[Fraction | None]:
    """Every number in `text`, in order, as exact fractions; None for a refused one (module docstring)."""
    return [value for _, _, value in _scan(text)]


def final_number(text: str) -> Fraction | None:
    """The last number in `text` (None when there is none, or when the last one is refused)."""
    found = _numbers(_latex_to_text(text))
    return found[-1] if found else None


def parse_number(text: Any) -> Fraction | None:
    """`text` as a number when it is exactly one (an int, a float, a numpy scalar, a Decimal, a string like
    '-1,234.5', '$3', '3/4', '1e3', '2^{10}'), else None (also for a refused one: module docstring). A float is read
    as its shortest decimal spelling (1e23 is 10**23, 0.1 is 1/10)."""
    if isinstance(text, bool | np.bool_):
        return None
    if not isinstance(text, str) and getattr(text, "ndim", None) == 0 and hasattr(text, "item"):
        return parse_number(text.item())  # a numpy scalar or 0-d array, a 0-d tensor
    if isinstance(text, Fraction):
        return text
    if isinstance(text, numbers.Integral):
        return Fraction(int(text))
    if isinstance(text, Decimal):
        return Fraction(text) if text.is_finite() else None
    if isinstance(text, numbers.Real):
        value = float(text)
        return Fraction(repr(value)) if value == value and abs(value) != float("inf") else None
    if not isinstance(text, str):
        return None
    cleaned = _latex_to_text(text).strip().rstrip(".").strip()
    return _single(cleaned, 0) if cleaned else None


def _latex_to_text(text: str) -> str:
    """LaTeX spellings of numbers as plain text: \\frac{a}{b} -> a/b; thin spaces, \\$, \\%, \\text{} dropped."""
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    text = re.sub(r"\\text\s*\{([^{}]*)\}", r" \1 ", text)
    for spelling in ("\\!", "\\,", "\\;", "\\ "):
        text = text.replace(spelling, "")
    return text.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces matched; None if none closes."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def after_hashes(text: str) -> str | None:
    """The text after the last '####', or None when there is none."""
    _, sep, tail = text.rpartition("####")
    return tail if sep else None


def extract_answer(text: str) -> Fraction | None:
    """The final numeric answer of a reply (see the module docstring for the rules), or None when it has no number
    or its final answer is a refused one."""
    tail = after_hashes(text)
    if tail is not None:
        found = _numbers(_latex_to_text(tail))
        if found:
            return found[0]
    boxed = last_boxed(text)
    if boxed is not None:
        found = _numbers(_latex_to_text(boxed))
        if found:
            return found[-1]
    phrases = list(_ANSWER_IS.finditer(text))
    if phrases:
        found = _numbers(_latex_to_text(text[phrases[-1].end() :]))
        if found:
            return found[0]
    return final_number(text)


def same_number(a: Fraction, b: Fraction, abs_tol: float = ABS_TOL, rel_tol: float = REL_TOL) -> bool:
    """a == b when the expected `b` is an integer, else |a - b| <= abs_tol + rel_tol * |b|."""
    if b.denominator == 1:
        return a == b
    return abs(a - b) <= abs_tol + rel_tol * abs(b)


def _reference(value: Any, i: int) -> Fraction:
    number = parse_number(value)
    if number is None:
        raise ValueError(
            f"row {i} of the batch has answer {value!r}, which is not a number; the 'answer' column must hold a "
            "number or a string such as '42', '-1,234.5' or '3/4'"
        )
    return number


def _check_answer_column(answer: Sequence[Any] | None, n: int, fn: str) -> Sequence[Any]:
    if answer is None:
        raise ValueError(f"{fn} needs an 'answer' column in the prompt rows")
    if len(answer) != n:
        raise ValueError(f"{fn}: {len(answer)} answers for {n} responses")
    return answer


def exact_answer(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any], **meta: Any) -> list[float]:
    """1.0 when the final number of the response equals the row's `answer` (exactly for an integer answer, else
    within ABS_TOL + REL_TOL * |answer|), else 0.0 (also when the response has no number, or a refused one)."""
    answer = _check_answer_column(answer, len(responses), "exact_answer")
    scores = []
    for i, (response, expected) in enumerate(zip(responses, answer, strict=True)):
        found = extract_answer(response)
        scores.append(float(found is not None and same_number(found, _reference(expected, i))))
    return scores


def follows_format(response: str, answer_format: str) -> bool:
    """Whether `response` gives a number in `answer_format`: '####' then a number (and at most a unit or a period
    after it, on the same line), a number inside the last \\boxed{}, or ('number') nothing but a number (and a
    period)."""
    if answer_format == "####":
        tail = after_hashes(response)
        if tail is None:
            return False
        line = tail.strip()
        found = _numbers(_latex_to_text(line))
        return "\n" not in line and bool(found) and found[0] is not None
    if answer_format == "boxed":
        boxed = last_boxed(response)
        return boxed is not None and parse_number(boxed) is not None
    if answer_format == "number":
        return parse_number(response.strip().removesuffix(".")) is not None
    raise ValueError(f"answer_format {answer_format!r} is not one of {FORMATS}")


def format_reward(
    prompts: Sequence[str], responses: Sequence[str], answer_format: Sequence[str], **meta: Any
) -> list[float]:
    """1.0 when the response gives its final answer in its row's `answer_format` (one of FORMATS), else 0.0.
    With '####' the answer line must be the last line; with 'boxed' the box must hold exactly one number."""
    if answer_format is None:
        raise ValueError(f"format_reward needs an 'answer_format' column in the prompt rows (one of {FORMATS})")
    return [float(follows_format(r, f)) for r, f in zip(responses, answer_format, strict=True)]


MAX_EXPONENT = 10_000
"""`math_verify_answer` scores 0 without calling math-verify for a reply with a numeric exponent larger than this."""


def huge_power(text: str) -> bool:
    """Whether `text` raises something to a numeric exponent above MAX_EXPONENT in size ('9^{9^{9}}', '2**99999')."""
    text = _latex_to_text(text)
    for power in re.finditer(r"\^|\*\*", text):
        operand = _operand(text, len(text) - len(text[power.end() :].lstrip()), 0)
        if operand is not None and operand[0] is not None and abs(operand[0]) > MAX_EXPONENT:
            return True
    return False


@functools.lru_cache(maxsize=1)
def _math_verify():
    try:
        import math_verify
    except ImportError as err:
        raise ImportError(
            "math_verify_answer needs the math-verify package: pip install 'lit_rlhf[math]' "
            "(or pip install math-verify)"
        ) from err
    return math_verify


@isolated
def math_verify_answer(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any], **meta: Any
) -> list[float]:
    """1.0 when math-verify finds the response's answer equivalent to `answer` (symbolically: 1/2 = 0.5 = \\frac12),
    else 0.0. A '####' answer line is handed over as its number, since math-verify does not read that marker.
    It is marked `isolated`: as a reward or metric function it runs in a worker process, in that process's main
    thread, where math-verify's own timeouts (signal.alarm, MATH_VERIFY_TIMEOUT_S per parse and verify) work, and
    `reward_timeout_s` kills the process when a call overruns it. Called directly off the main thread its own
    timeouts are off."""
    math_verify = _math_verify()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    answer = _check_answer_column(answer, len(responses), "math_verify_answer")
    scores = []
    for response, expected in zip(responses, answer, strict=True):
        tail = after_hashes(response)
        text = f"${tail.strip()}$" if tail is not None and tail.strip() else response
        if huge_power(text):
            scores.append(0.0)  # sympy would compute it: refused as no answer, like exact_answer does
            continue
        gold = math_verify.parse(f"${expected}$", parsing_timeout=timeout)
        found = math_verify.parse(text, parsing_timeout=timeout)
        scores.append(float(bool(gold) and math_verify.verify(gold, found, timeout_seconds=timeout)))
    return scores
