"""Answer extraction and the verifiable rewards (`lit_rlhf.rewards.verifiable`) on tricky replies."""

from __future__ import annotations

import builtins
import concurrent.futures
from fractions import Fraction

import pytest

from lit_rlhf.rewards import verifiable
from lit_rlhf.rewards.verifiable import (
    exact_answer,
    extract_answer,
    follows_format,
    format_reward,
    last_boxed,
    math_verify_answer,
    parse_number,
)

F = Fraction

# (reply, the final answer a careful reader takes from it); expectations written by hand
EXTRACTION = [
    # '####' wins over everything else, spaces or not, first number after it
    ("#### 72", F(72)),
    ("####72", F(72)),
    ("Work: 3 + 4 = 7\n####   -5.", F(-5)),
    ("x = 3\n#### 1,234 apples", F(1234)),
    ("#### 12 and then 99", F(12)),
    ("I think \\boxed{4}.\n#### 5", F(5)),
    ("#### none\nso 8", F(8)),  # nothing after '####': fall back to the last number
    # \boxed{}: the last box, nested braces, LaTeX fractions, \text and {,}
    ("\\boxed{3} or rather \\boxed{7}", F(7)),
    ("The answer is \\boxed{\\frac{3}{4}}", F(3, 4)),
    ("\\boxed{\\dfrac{10}{4}}", F(5, 2)),
    ("\\boxed{{2} + {3} = {5}} then 9", F(5)),
    ("\\boxed{\\text{\\$}1{,}234}", F(1234)),
    ("\\boxed{5 \\text{ apples}}", F(5)),
    ("\\boxed{5", F(5)),  # unclosed box: the last number
    # 'the answer is' / 'answer:'
    ("The answer is 42.", F(42)),
    ("The answer is 42, not 43", F(42)),
    ("Answer: \u22127", F(-7)),
    ("answer = 12 because 3 * 4 = 12 and 1", F(12)),
    ("The answer is 1/2.", F(1, 2)),
    # the last number otherwise
    ("I got 3 then 5 and finally 8", F(8)),
    ("costs $1,234.50 in total", F(246_900, 200)),
    ("It is 12,345,678.", F(12_345_678)),
    ("+5", F(5)),
    ("(-3)", F(-3)),
    ("x=-0.5.", F(-1, 2)),
    ("-.5", F(-1, 2)),
    ("50%", F(50)),
    ("10-3", F(3)),  # a '-' right after a digit is subtraction, not a sign
    ("COVID-19", F(19)),
    ("a 1,23 b", F(23)),  # '1,23' is not a thousands group: two numbers
    ("1234,567", F(567)),
    ("1.5/2", F(3, 4)),
    ("so 12/5/2024", F(2024)),
    ("about 3.14 metres", F(314, 100)),
    # no number at all
    ("no number here", None),
    ("", None),
    ("answer is 3/0", None),
]


@pytest.mark.parametrize(("reply", "expected"), EXTRACTION)
def test_extract_answer(reply, expected):
    assert extract_answer(reply) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", F(42)),
        ("-1,234.5", F(-2469, 2)),
        ("$3", F(3)),
        ("3/4", F(3, 4)),
        ("\u22122", F(-2)),
        ("+7", F(7)),
        ("7.", F(7)),
        (" 8 ", F(8)),
        ("\\frac{1}{4}", F(1, 4)),
        (3, F(3)),
        (2.5, F(5, 2)),
        ("abc", None),
        ("1 2", None),
        ("", None),
        (True, None),
        (None, None),
        (float("nan"), None),
    ],
)
def test_parse_number_takes_exactly_one_number(text, expected):
    assert parse_number(text) == expected


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{a{b}c} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{x{y}}") == "x{y}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{open") is None


def test_exact_answer_scores_each_row_against_its_answer():
    responses = [
        "#### 1,234",
        "the answer is 7",
        "nothing",
        "\\boxed{0.5}",
        "#### \u22123",
        "-3",
        "#### 2.0000000001",
        "#### 2.01",
        "12",
        "#### 0.3333333",
    ]
    answers = ["1234", 7, "3", "1/2", "-3", -3, 2, "2", "12", "1/3"]
    assert exact_answer([""] * 10, responses, answer=answers) == [1, 1, 0, 1, 1, 1, 0, 0, 1, 1]


def test_exact_answer_compares_integers_exactly_and_others_within_tolerance():
    assert exact_answer(["q"], ["#### 1000000.5"], answer=[1_000_000]) == [0.0]  # an integer answer: exact
    assert exact_answer(["q"], ["#### 12000012"], answer=[12_000_000]) == [0.0]
    assert exact_answer(["q"], ["#### 1000000.0"], answer=[1_000_000]) == [1.0]
    assert exact_answer(["q"], ["#### 1000000.5000001"], answer=["1000000.5"]) == [1.0]  # within 1e-6 * 1e6
    assert exact_answer(["q"], ["#### 1000002.5"], answer=["1000000.5"]) == [0.0]


def test_exact_answer_refuses_an_answer_that_is_not_a_number():
    with pytest.raises(ValueError, match="row 1 of the batch has answer 'seven'"):
        exact_answer(["a", "b"], ["7", "7"], answer=["7", "seven"])
    with pytest.raises(ValueError, match="'answer' column"):
        exact_answer(["a"], ["7"], answer=None)
    with pytest.raises(ValueError, match="2 answers for 1 responses"):
        exact_answer(["a"], ["7"], answer=["7", "8"])


@pytest.mark.parametrize(
    ("reply", "answer_format", "ok"),
    [
        ("work\n#### 5", "####", True),
        ("#### 5.", "####", True),
        ("#### 5 apples", "####", True),
        ("#### 5\nand more text", "####", False),
        ("#### five", "####", False),
        ("5", "####", False),
        ("\\boxed{5}", "####", False),
        ("so \\boxed{5}", "boxed", True),
        ("\\boxed{\\frac{1}{2}}", "boxed", True),
        ("\\boxed{5 apples}", "boxed", False),
        ("\\boxed{}", "boxed", False),
        ("#### 5", "boxed", False),
        ("5", "number", True),
        (" -12.\n", "number", True),
        ("5 apples", "number", False),
        ("The answer is 5", "number", False),
        ("5 + 3 = 8", "number", False),
        ("", "number", False),
    ],
)
def test_follows_format(reply, answer_format, ok):
    assert follows_format(reply, answer_format) is ok


def test_format_reward_reads_each_rows_format_and_refuses_unknown_ones():
    replies = ["#### 5", "#### 5", "\\boxed{5}"]
    assert format_reward(["q"] * 3, replies, answer_format=["####", "boxed", "boxed"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="'latex' is not one of"):
        format_reward(["q"], ["#### 5"], answer_format=["latex"])


def test_math_verify_answer_finds_symbolic_equivalence():
    pytest.importorskip("math_verify")
    responses = ["#### 1,234", "the answer is 7", "nothing", "\\boxed{\\frac{1}{2}}", "#### 0.75"]
    answers = ["1234", 7, "3", "0.5", "3/4"]
    assert math_verify_answer([""] * 5, responses, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_math_verify_answer_works_off_the_main_thread():
    pytest.importorskip("math_verify")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scores = pool.submit(math_verify_answer, ["q", "q"], ["\\boxed{\\frac{1}{2}}", "#### 3"], answer=["0.5", 4])
        assert scores.result() == [1.0, 0.0]


def test_math_verify_answer_without_the_package_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    verifiable._math_verify.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    try:
        with pytest.raises(ImportError, match=r"lit_rlhf\[math\]"):
            math_verify_answer(["q"], ["1"], answer=["1"])
    finally:
        verifiable._math_verify.cache_clear()
