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
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

FORMATS = ("####", "boxed", "number")
"""Answer formats a prompt can ask for: after '####' on the last line, inside \\boxed{}, or the bare number."""

ABS_TOL = 1e-6
REL_TOL = 1e-6
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


def _numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order, as exact fractions."""
    found = []
    for match in _NUMBER.finditer(text):
        whole, decimals, den = match["int"], match["frac"], match["den"]
        if whole is None and decimals is None:
            continue
        if den is not None and int(den) == 0:
            continue  # '3/0' is not a number
        value = Fraction((whole or "0").replace(",", "") + (decimals or ""))
        if den is not None:
            value /= int(den)
        found.append(-value if match["sign"] in ("-", "\u2212") else value)
    return found


def parse_number(text: Any) -> Fraction | None:
    """`text` as a number when it is exactly one (an int, a float, a string like '-1,234.5', '$3', '3/4'), else None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, Fraction)):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(text) if text == text and abs(text) != float("inf") else None
    if not isinstance(text, str):
        return None
    cleaned = _latex_to_text(text).strip().rstrip(".").strip()
    match = _NUMBER.fullmatch(cleaned)
    if match is None or not cleaned:
        return None
    numbers = _numbers(cleaned)
    return numbers[0] if len(numbers) == 1 else None


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
    """The final numeric answer of a reply (see the module docstring for the rules), or None when it has no number."""
    tail = after_hashes(text)
    if tail is not None:
        numbers = _numbers(_latex_to_text(tail))
        if numbers:
            return numbers[0]
    boxed = last_boxed(text)
    if boxed is not None:
        numbers = _numbers(_latex_to_text(boxed))
        if numbers:
            return numbers[-1]
    phrases = list(_ANSWER_IS.finditer(text))
    if phrases:
        numbers = _numbers(_latex_to_text(text[phrases[-1].end() :]))
        if numbers:
            return numbers[0]
    numbers = _numbers(_latex_to_text(text))
    return numbers[-1] if numbers else None


def same_number(a: Fraction, b: Fraction, abs_tol: float = ABS_TOL, rel_tol: float = REL_TOL) -> bool:
    """|a - b| <= abs_tol + rel_tol * |b|."""
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
    """1.0 when the final number of the response equals the row's `answer` (within ABS_TOL + REL_TOL * |answer|),
    else 0.0 (also when the response has no number)."""
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
        return "\n" not in line and bool(_numbers(_latex_to_text(line)))
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


def math_verify_answer(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any], **meta: Any
) -> list[float]:
    """1.0 when math-verify finds the response's answer equivalent to `answer` (symbolically: 1/2 = 0.5 = \\frac12),
    else 0.0. A '####' answer line is handed over as its number, since math-verify does not read that marker.
    math-verify's own timeouts use signal.alarm, which works in the main thread only: elsewhere (reward functions
    run on worker threads) they are off, and the reward call's own timeout bounds the work."""
    math_verify = _math_verify()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    answer = _check_answer_column(answer, len(responses), "math_verify_answer")
    scores = []
    for response, expected in zip(responses, answer, strict=True):
        tail = after_hashes(response)
        text = f"${tail.strip()}$" if tail is not None and tail.strip() else response
        gold = math_verify.parse(f"${expected}$", parsing_timeout=timeout)
        found = math_verify.parse(text, parsing_timeout=timeout)
        scores.append(float(bool(gold) and math_verify.verify(gold, found, timeout_seconds=timeout)))
    return scores
