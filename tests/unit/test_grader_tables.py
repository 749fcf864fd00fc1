"""Adversarial replies for every grader, with the score a careful human grader gives each, written by hand.

Every false credit is a reward-hacking channel: these tables hold replies that spell a number another way (scientific
notation, powers, huge or odd numbers), hide it, or game the extraction, and the expected score of each.
"""

from __future__ import annotations

import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from lit_rlhf.rewards.verifiable import (
    exact_answer,
    extract_answer,
    format_reward,
    huge_power,
    math_verify_answer,
    parse_number,
)
from lit_rlhf.tasks.calculator import CalculatorEnvironment
from lit_rlhf.tasks.countdown import countdown_reward
from lit_rlhf.tasks.digits import sort_digits_reward, sorted_exactly

BIG = "1" + "0" * 5000

# (reply, the row's answer, score); a careful grader's verdicts
EXACT_ANSWER = [
    # scientific notation and powers: their value, never the mantissa or exponent
    ("#### 1e3", 1, 0.0),
    ("#### 1e3", 1000, 1.0),
    ("#### 1e3", 3, 0.0),
    ("#### 1.5E2", 150, 1.0),
    ("#### 2.5e-1", "1/4", 1.0),
    ("\\boxed{2^{10}}", 10, 0.0),
    ("\\boxed{2^{10}}", 1024, 1.0),
    ("\\boxed{2^{10}}", 2, 0.0),
    ("\\boxed{2^10}", 1024, 1.0),
    ("The answer is 2**5", 32, 1.0),
    ("The answer is 2**5", 5, 0.0),
    ("#### 1.2 \\times 10^{3}", 1200, 1.0),
    ("#### 1.2 \\times 10^{3}", 3, 0.0),
    ("#### 3 x 10^2", 300, 1.0),
    ("#### -2^2", -4, 1.0),
    ("#### 2^3^2", 512, 1.0),
    ("#### 2^{-2}", "0.25", 1.0),
    # powers too large to compute, or not numbers: no answer, and no fallback to another number
    ("\\boxed{9^{9^{9}}}", 9, 0.0),
    ("\\boxed{9^{9^{9}}}", 387_420_489, 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", 9, 0.0),
    ("#### 10^{100000}", 10, 0.0),
    ("#### 1e100000", 1, 0.0),
    ("#### 1e100000", 100000, 0.0),
    ("#### 4^{1/2}", 2, 0.0),
    ("#### 4^{1/2}", 4, 0.0),
    ("#### 0^{-1}", 0, 0.0),
    ("so the area is r^2", 2, 0.0),
    ("x^{2} = 49 so x^2", 2, 0.0),
    ("(1+2)^2", 2, 0.0),
    ("2^{x}", 2, 0.0),
    # integers exactly: near misses are wrong however large the answer
    ("#### 12000012", 12_000_000, 0.0),
    ("#### 12000000", 12_000_000, 1.0),
    ("#### 12,000,000", "12000000", 1.0),
    ("#### 12000000.5", 12_000_000, 0.0),
    ("#### 7.0000001", 7, 0.0),
    ("#### 7.000", 7, 1.0),
    ("#### 123456789012345678901", 123_456_789_012_345_678_900, 0.0),
    ("#### 123456789012345678901", 123_456_789_012_345_678_901, 1.0),
    # huge numbers: refused past MAX_DIGITS digits (no crash on Python's int-string limit)
    (f"#### {BIG}", 1, 0.0),
    (f"#### {BIG}", 0, 0.0),
    (f"the answer is {BIG[:900]}", int(BIG[:900]), 1.0),
    # answers given as numpy scalars, Decimals, floats, tensors
    ("#### 5", np.int64(5), 1.0),
    ("#### 5", np.float32(5.0), 1.0),
    ("#### 6", np.int64(5), 0.0),
    ("#### 0.1", np.float64(0.1), 1.0),
    ("#### 0.5", Decimal("0.5"), 1.0),
    ("#### 100000000000000000000000", 1e23, 1.0),
    ("#### 5", np.array(5), 1.0),
    ("#### 5", torch.tensor(5), 1.0),
    # extraction games
    ("#### 5 or #### 6", 6, 1.0),
    ("#### 5 or #### 6", 5, 0.0),
    ("The answer is **42**.", 42, 1.0),
    ("I'm not sure. 41 42 43", 42, 0.0),
    ("#### ", 0, 0.0),
    ("#### -0", 0, 1.0),
    ("#### 3/0", 0, 0.0),
    ("#### \u22127", -7, 1.0),
    ("10-3", 7, 0.0),
]


@pytest.mark.parametrize(("reply", "answer", "score"), EXACT_ANSWER)
def test_exact_answer_table(reply, answer, score):
    assert exact_answer(["q"], [reply], answer=[answer]) == [score]


def test_the_exact_answer_table_is_large_enough():
    assert len(EXACT_ANSWER) >= 40


@pytest.mark.parametrize(
    "reply",
    [
        "\\boxed{9^{9^{9^{9}}}}",
        "#### 2^{2^{2^{2^{2^{2^{2^{2^{2^{2}}}}}}}}}",
        "#### 1e999999999",
        f"#### {BIG}^{{{BIG}}}",
    ],
)
def test_a_huge_power_is_refused_without_being_computed(reply):
    start = time.perf_counter()
    assert extract_answer(reply) is None
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        (np.int64(-3), Fraction(-3)),
        (np.float32(0.5), Fraction(1, 2)),
        (np.bool_(True), None),
        ("1e3", Fraction(1000)),
        ("2^{10}", Fraction(1024)),
        ("9^{9^{9}}", None),
        (Decimal("NaN"), None),
        (float("inf"), None),
        (1e23, 10**23),
    ],
)
def test_parse_number_reads_numpy_scalars_and_powers(answer, value):
    assert parse_number(answer) == value


# (reply, answer_format, score)
FORMAT_REWARD = [
    ("#### 1e3", "####", 1.0),
    ("#### 9^{9^{9}}", "####", 0.0),  # a refused number is no answer
    ("#### x^2", "####", 0.0),
    ("#### 2^{10}", "####", 1.0),
    ("#### 5\n#### 6", "####", 1.0),
    ("#### 5\nmore", "####", 0.0),
    ("####", "####", 0.0),
    ("\\boxed{2^{10}}", "boxed", 1.0),
    ("\\boxed{9^{9^{9}}}", "boxed", 0.0),
    ("\\boxed{1e3}", "boxed", 1.0),
    ("\\boxed{1 2}", "boxed", 0.0),
    ("\\boxed{x^2}", "boxed", 0.0),
    ("\\boxed{}", "boxed", 0.0),
    ("\\boxed{5", "boxed", 0.0),
    (f"\\boxed{{{BIG}}}", "boxed", 0.0),
    ("1e3", "number", 1.0),
    ("2^{10}", "number", 1.0),
    ("9^{9^{9}}", "number", 0.0),
    ("5 6", "number", 0.0),
    ("**5**", "number", 0.0),
]


@pytest.mark.parametrize(("reply", "answer_format", "score"), FORMAT_REWARD)
def test_format_reward_table(reply, answer_format, score):
    assert format_reward(["q"], [reply], answer_format=[answer_format]) == [score]


# (reply, numbers, target, score)
COUNTDOWN = [
    ("#### (4 + 17) * 9 - 30", [4, 17, 9, 30], 159, 1.0),
    ("#### (4 + 17) * 9 - 30", [4, 17, 9, 30], 160, 0.0),
    ("#### 159", [4, 17, 9, 30], 159, 0.0),  # the target alone uses a number not given
    ("#### 4 * 4", [4, 17], 16, 0.0),  # 4 used twice
    ("#### 4 * 4", [4, 4], 16, 1.0),
    ("#### 1e2", [1, 2], 100, 0.0),
    ("#### 10^2", [10, 2], 100, 0.0),
    ("#### 10**2", [10, 2], 100, 0.0),
    ("#### 9^{9^{9}}", [9], 9, 0.0),
    ("#### -3 + 10", [3, 10], 7, 0.0),  # no unary minus
    ("#### 10 - 3", [3, 10], 7, 1.0),
    ("#### (5 / 2) * 2", [5, 2, 2], 5, 0.0),  # a division leaving a remainder
    ("#### 6 / 0", [6, 0], 0, 0.0),
    ("#### 6 / (3 - 3)", [6, 3, 3], 0, 0.0),
    ("#### 4.0 * 2", [4, 2], 8, 0.0),
    ("#### 4 2", [4, 2], 42, 0.0),
    ("#### 42", [4, 2], 42, 0.0),  # digits glued into another number
    ("#### 17 + 4 = 21", [17, 4], 21, 0.0),  # '=' is not part of an expression
    ("#### " + "+".join(["1"] * 150), [1] * 150, 150, 0.0),  # longer than MAX_LENGTH
    ("\\boxed{3 * 7}", [3, 7], 21, 1.0),
    ("#### 3 * 7\nsomething else", [3, 7], 21, 1.0),
    ("no answer line 3 * 7 = 21", [3, 7], 21, 0.0),
    ("#### 3 \u00d7 7", [3, 7], 21, 1.0),
    ("#### (3 * 7", [3, 7], 21, 0.0),
    ("#### 3 * 7", np.array([3, 7]), np.int64(21), 1.0),
]


@pytest.mark.parametrize(("reply", "numbers", "target", "score"), COUNTDOWN)
def test_countdown_reward_table(reply, numbers, target, score):
    assert countdown_reward(["q"], [reply], numbers=[numbers], target=[target]) == [score]


# (final turn, answer, reward)
CALCULATOR = [
    ("The result is 84.", "84", 1.0),
    ("1e3", "1000", 1.0),
    ("1e3", "3", 0.0),
    ("2^{10}", "1024", 1.0),
    ("2^{10}", "10", 0.0),
    ("9^{9^{9}}", "9", 0.0),
    ("84.0000001", "84", 0.0),
    ("1,234", "1234", 1.0),
    ("1,234", "234", 0.0),
    ("10-3", "7", 0.0),
    ("so x^2", "2", 0.0),
    ("nothing", "0", 0.0),
    ("-5", "-5", 1.0),
    ("12000012", "12000000", 0.0),
    ("84", np.int64(84), 1.0),
]


@pytest.mark.parametrize(("action", "answer", "reward"), CALCULATOR)
def test_calculator_final_answer_table(action, answer, reward):
    env = CalculatorEnvironment()
    result = env.step(env.reset([{"answer": answer}]), [action])
    assert result.rewards == [reward] and result.done == [True]


def test_calculator_refuses_an_answer_that_is_not_a_number_naming_the_row():
    with pytest.raises(ValueError, match="prompt row 1 has answer='seven'"):
        CalculatorEnvironment().reset([{"answer": "3"}, {"answer": "seven"}])


# (prompt, reply, sort_digits_reward, sorted_exactly)
DIGITS = [
    ("3142>", "1234", 1.0, 1.0),
    ("3142>", " 1234 ", 1.0, 1.0),
    ("3142>", "1234<eos>", 4 / 10, 0.0),
    ("3142>", "12", 2 / 5, 0.0),
    ("3142>", "", 0.0, 0.0),
    ("3142>", "4321", 1 / 5, 0.0),
    ("3142>", "12340000", 4 / 9, 0.0),
    ("3142>", "1e3", 2 / 5, 0.0),  # 1 and 3 in place
    ("112>", "112", 1.0, 1.0),
    ("112>", "121", 2 / 4, 0.0),
]


@pytest.mark.parametrize(("prompt", "reply", "partial", "exact"), DIGITS)
def test_digits_graders_table(prompt, reply, partial, exact):
    assert sort_digits_reward([prompt], [reply]) == [pytest.approx(partial)]
    assert sorted_exactly([prompt], [reply]) == [exact]


# (reply, answer, score); math-verify's own verdicts where it reads the number, refusals where it would compute
MATH_VERIFY = [
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{2^{10}}", "10", 0.0),
    ("\\boxed{9^{9^{9}}}", "9", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "9", 0.0),
    ("#### 2**99999", "2", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("#### 12000012", "12000000", 0.0),
    ("#### 1,234", "1234", 1.0),
    ("nothing", "3", 0.0),
    ("\\boxed{x^2}", "2", 0.0),
]


@pytest.mark.parametrize(("reply", "answer", "score"), MATH_VERIFY)
def test_math_verify_answer_table(reply, answer, score):
    pytest.importorskip("math_verify")
    assert math_verify_answer(["q"], [reply], answer=[answer]) == [score]


@pytest.mark.parametrize(
    ("text", "huge"),
    [("9^{9^{9}}", True), ("2**99999", True), ("2^{10}", False), ("x^2 + 1", False), ("10^{10000}", False)],
)
def test_huge_power(text, huge):
    assert huge_power(text) is huge
