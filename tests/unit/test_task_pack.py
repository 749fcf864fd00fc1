"""The verifiable tasks: arithmetic, word problems and countdown (generators, answers, the countdown checker, the
safe expression parser, and their `builtin:<name>` registration)."""

from __future__ import annotations

import ast
import itertools
import operator
import random
import re
from fractions import Fraction

import pytest

from lit_rlhf.registry import get_task
from lit_rlhf.tasks.arithmetic import Expression, _combine, arithmetic_prompts
from lit_rlhf.tasks.countdown import (
    check_countdown,
    countdown_expression,
    countdown_instance,
    countdown_prompts,
    countdown_reward,
)
from lit_rlhf.tasks.expression import ExpressionError, evaluate
from lit_rlhf.tasks.text import CHAT_TEMPLATE, text_policy, text_tokenizer
from lit_rlhf.tasks.word_problems import TEMPLATES, word_problem_prompts

GENERATORS = {
    "arithmetic": lambda seed, **kw: arithmetic_prompts(seed, **kw),
    "word_problems": lambda seed, **kw: word_problem_prompts(seed, **kw),
    "countdown": lambda seed, **kw: countdown_prompts(seed, **kw),
}


def take(stream, n=40):
    return list(itertools.islice(stream, n))


def python_value(text: str) -> Fraction:
    """An independent evaluation: Python's own parser, numbers as exact fractions."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
        return Fraction(node.value)

    return walk(ast.parse(text, mode="eval").body)


def expression_of(prompt: str) -> str:
    return re.fullmatch(r"Calculate (.+)\. (Give|Put|Answer with) .*", prompt).group(1)


# ----------------------------------------------------------------------------- all generators


@pytest.mark.parametrize("name", list(GENERATORS))
def test_generators_are_reproducible_and_seeded(name):
    make = GENERATORS[name]
    assert take(make(3)) == take(make(3))
    assert take(make(3)) != take(make(4))
    assert len({str(row) for row in take(make(0), 40)}) > 30  # not one row repeated


@pytest.mark.parametrize("name", list(GENERATORS))
def test_chat_rows_hold_the_same_text_as_one_user_message(name):
    plain, chat = take(GENERATORS[name](5), 10), take(GENERATORS[name](5, chat=True), 10)
    for p, c in zip(plain, chat):
        assert c["messages"] == [{"role": "user", "content": p["prompt"]}]
        assert {k: v for k, v in c.items() if k != "messages"} == {k: v for k, v in p.items() if k != "prompt"}


@pytest.mark.parametrize("name", ["arithmetic", "word_problems"])
def test_answer_format_sets_the_instruction_and_column(name):
    boxed = take(GENERATORS[name](1, answer_format="boxed"), 5)
    hashes = take(GENERATORS[name](1), 5)
    assert all(r["prompt"].endswith("Put the final answer in \\boxed{}.") for r in boxed)
    assert all(r["prompt"].endswith("'#### <number>'.") for r in hashes)
    assert {r["answer_format"] for r in boxed} == {"boxed"} and {r["answer_format"] for r in hashes} == {"####"}
    with pytest.raises(ValueError, match="answer_format must be one of"):
        GENERATORS[name](1, answer_format="latex")


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "digits, ops, steps",
    [(1, "+", 1), (2, "+-", 2), (3, "+-*", 3), ((2, 3), "*/", 2), (2, "+-*/", 4), ((4, 4), "-", 1)],
)
def test_arithmetic_knobs_and_answers(digits, ops, steps):
    low, high = (1, digits) if isinstance(digits, int) else digits
    for row in take(arithmetic_prompts(7, digits=digits, ops=ops, steps=steps), 60):
        expression = expression_of(row["prompt"])
        numbers = re.findall(r"\d+", expression)
        assert all(low <= len(n) <= high for n in numbers), expression
        assert all(n == "0" or not n.startswith("0") for n in numbers), expression
        operators = re.findall(r"[-+*/]", expression)
        assert len(operators) == steps and set(operators) <= set(ops), expression
        value = python_value(expression)
        assert value.denominator == 1, expression  # every division is exact
        assert row["answer"] == str(value.numerator)


def test_max_operand_draws_every_operand_from_one_to_it_and_asks_for_the_bare_number():
    rows = take(arithmetic_prompts(3, ops="+-*", max_operand=12, answer_format="number"), 2000)
    operands = [int(n) for row in rows for n in re.findall(r"\d+", expression_of(row["prompt"]))]
    assert set(operands) == set(range(1, 13))  # all of 1..12 and nothing else, in 4000 draws
    assert all(row["prompt"].endswith("Answer with just the number.") for row in rows)
    assert all(row["answer"] == str(python_value(expression_of(row["prompt"])).numerator) for row in rows)
    with pytest.raises(ValueError, match="max_operand must be a positive int"):
        arithmetic_prompts(0, max_operand=0)


def test_combine_parenthesises_only_where_the_order_needs_it():
    two_times_four = Expression("2 * 4", Fraction(8), 2)
    one_minus_two = Expression("1 - 2", Fraction(-1), 1)
    sixteen = Expression("16", Fraction(16))
    cases = [
        (sixteen, "/", two_times_four, "16 / (2 * 4)", 2),
        (two_times_four, "/", sixteen, "2 * 4 / 16", Fraction(1, 2)),
        (sixteen, "-", one_minus_two, "16 - (1 - 2)", 17),
        (one_minus_two, "-", sixteen, "1 - 2 - 16", -17),
        (sixteen, "+", one_minus_two, "16 + 1 - 2", 15),
        (one_minus_two, "*", sixteen, "(1 - 2) * 16", -16),
        (sixteen, "*", two_times_four, "16 * 2 * 4", 128),
    ]
    for left, op, right, text, value in cases:
        combined = _combine(left, op, right)
        assert (combined.text, combined.value) == (text, value)
        assert python_value(combined.text) == value


def test_arithmetic_uses_division_and_parentheses():
    rows = take(arithmetic_prompts(0, digits=2, ops="+-*/", steps=3), 100)
    assert sum("/" in r["prompt"] for r in rows) > 20
    assert sum("(" in r["prompt"] for r in rows) > 20
    assert any(r["answer"].startswith("-") for r in rows)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ops="+%"), "ops must be a non-empty string"),
        (dict(ops=""), "ops must be a non-empty string"),
        (dict(ops="/"), "ops='/' alone"),
        (dict(steps=0), "steps must be at least 1"),
        (dict(digits=(3, 2)), "digits must be"),
        (dict(digits=0), "digits must be"),
    ],
)
def test_arithmetic_bad_knobs_fail_when_the_stream_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arithmetic_prompts(0, **kwargs)


# ----------------------------------------------------------------------------- word problems

# each template's answer from its stated quantities, written out independently of the generator
FORMULAS = {
    "shopping": lambda v: v["bill"] - v["count"] * v["price"],
    "sharing": lambda v: v["total"] // v["friends"] - v["given"],
    "rates": lambda v: v["speed1"] * v["hours1"] + v["speed2"] * v["hours2"],
    "ages": lambda v: (v["future"] - v["years"]) + v["gap"],
    "savings": lambda v: v["weekly"] * v["weeks"] - v["spent"],
    "recipe": lambda v: Fraction(v["cups"] * v["wanted"], v["batch"]),
    "discount": lambda v: Fraction(v["price"] * (100 - v["percent"]), 100),
}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_word_problem_answers_match_an_independent_computation(template):
    assert set(FORMULAS) == set(TEMPLATES)
    rng = random.Random(11)
    for _ in range(100):
        problem = TEMPLATES[template](rng)
        expected = Fraction(FORMULAS[template](problem.values))
        assert expected.denominator == 1 and expected >= 0, problem
        assert problem.answer == expected
        stated = [int(n) for n in re.findall(r"\d+", problem.text)]
        assert all(v in stated for v in problem.values.values()), problem  # the quantities are in the text


def test_word_problem_rows_draw_every_template_or_the_chosen_ones():
    rows = take(word_problem_prompts(2), 300)
    assert {r["template"] for r in rows} == set(TEMPLATES)
    assert {r["template"] for r in take(word_problem_prompts(2, templates=["ages", "rates"]), 50)} == {"ages", "rates"}
    with pytest.raises(ValueError, match="templates must be a non-empty list"):
        word_problem_prompts(0, templates=["weather"])


# ----------------------------------------------------------------------------- the expression parser


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("2 + 3 * 4", 14, [2, 3, 4]),
        ("(2 + 3) * 4", 20, [2, 3, 4]),
        ("8 / 4 / 2", 1, [8, 4, 2]),
        ("10 - 3 - 2", 5, [10, 3, 2]),
        ("((7))", 7, [7]),
        ("6 x 7", 42, [6, 7]),
        ("6 \u00d7 7 \u00f7 2 \u2212 1", 20, [6, 7, 2, 1]),
        ("3 - 5", -2, [3, 5]),
        ("7 / 2", Fraction(7, 2), [7, 2]),
    ],
)
def test_evaluate(text, value, numbers):
    assert evaluate(text) == (value, numbers)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty expression"),
        ("2 +", "ends too early"),
        ("(2 + 3", "is not closed"),
        ("2 + 3)", "unexpected '\\)'"),
        ("2 3", "unexpected '3'"),
        ("-3 + 5", "expected a number or '\\(', got '-'"),
        ("2 ** 3", "expected a number"),
        ("__import__('os')", "unexpected character '_'"),
        ("2.5 * 2", "unexpected character '.'"),
        ("4 / (2 - 2)", "division by zero"),
        ("1+" * 101 + "1", "longer than 200"),
    ],
)
def test_evaluate_refuses_what_is_not_an_expression(text, message):
    with pytest.raises(ExpressionError, match=message):
        evaluate(text)


def test_integer_steps_refuses_a_division_with_a_remainder():
    assert evaluate("7 / 2 * 2") == (7, [7, 2, 2])
    with pytest.raises(ExpressionError, match="7 / 2 is not a whole number"):
        evaluate("7 / 2 * 2", integer_steps=True)
    assert evaluate("(3 - 9) / 2", integer_steps=True) == (-3, [3, 9, 2])  # negative, whole: allowed


# ----------------------------------------------------------------------------- countdown


@pytest.mark.parametrize(
    "expression, numbers, target, ok",
    [
        ("(25 - 5) * 3", [3, 5, 25, 50], 60, True),
        ("50 + 25", [3, 5, 25, 50], 75, True),  # a subset of the numbers
        ("(3 - 5) * 25 + 50 * 3", [3, 3, 5, 25, 50], 100, True),  # 3 given twice, used twice
        ("(25 - 5) * 3", [3, 5, 25, 50], 61, False),  # wrong value
        ("25 + 25", [3, 5, 25, 50], 50, False),  # 25 used twice
        ("7 * 3", [3, 5, 25, 50], 21, False),  # 7 not given
        ("50 / (5 - 5)", [5, 5, 50], 0, False),  # division by zero
        ("(5 / 2) * 2", [2, 2, 5], 5, False),  # 5 / 2 leaves a remainder
        ("-5 + 10", [5, 10], 5, False),  # no unary minus
        ("5 +", [5], 5, False),
        ("five", [5], 5, False),
    ],
)
def test_check_countdown(expression, numbers, target, ok):
    assert (check_countdown(expression, numbers, target) is None) is ok


def test_check_countdown_says_why():
    assert "uses [25] beyond" in check_countdown("25 + 25", [3, 25], 50)
    assert "equals 61, not 60" in check_countdown("(25 - 5) * 3 + 1", [1, 3, 5, 25], 60)
    assert "division by zero" in check_countdown("50 / (5 - 5)", [5, 5, 50], 0)


def test_countdown_instances_are_solvable_by_their_construction():
    rng = random.Random(5)
    for _ in range(200):
        numbers, target, solution = countdown_instance(rng, count=4, max_number=30, max_target=150)
        assert len(numbers) == 4 and all(1 <= n <= 30 for n in numbers)
        assert 1 <= target <= 150
        assert python_value(solution) == target  # independent evaluation
        assert sorted(int(n) for n in re.findall(r"\d+", solution)) == sorted(numbers)  # all numbers, once each
        assert check_countdown(solution, numbers, target) is None


def test_countdown_rows_and_reward():
    rows = take(countdown_prompts(0, count=3, max_number=20, max_target=100), 30)
    assert all(len(r["numbers"]) == 3 and 1 <= r["target"] <= 100 for r in rows)
    assert all(f"equals {r['target']}." in r["prompt"] and str(r["numbers"]) in r["prompt"] for r in rows)
    responses = ["I try.\n#### (25 - 5) * 3", "\\boxed{(25 - 5) * 3}", "#### 25 + 25 + 10", "60", "#### 60"]
    n = len(responses)
    numbers, target = [[3, 5, 25, 50]] * n, [60] * n
    assert countdown_reward(["q"] * n, responses, numbers=numbers, target=target) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert countdown_expression("#### 1 + 2.\nmore") == "1 + 2"
    assert countdown_expression("no marker") is None


# ----------------------------------------------------------------------------- builtin:<name>


@pytest.mark.parametrize("name", list(GENERATORS))
def test_builtin_tasks_are_registered_with_their_default_stream(name):
    task = get_task(f"builtin:{name}", "data.prompts")
    assert task.name == name
    assert take(task.prompts(9), 10) == take(GENERATORS[name](9), 10)
    chat_task = get_task(f"builtin:{name}_chat", "data.prompts")
    assert chat_task.name == f"{name}_chat"
    assert take(chat_task.prompts(9), 10) == take(GENERATORS[name](9, chat=True), 10)


def test_text_tokenizer_round_trips_every_prompt_and_has_a_chat_template():
    tokenizer = text_tokenizer()
    rows = [row for make in GENERATORS.values() for row in take(make(0), 20)]
    for row in rows:
        ids = tokenizer(row["prompt"])["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == row["prompt"]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert CHAT_TEMPLATE and tokenizer.apply_chat_template(messages, tokenize=False) == "What is 2 + 2?\n"
    longest = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    assert text_policy().config.n_positions >= longest + 64
    assert text_policy().config.vocab_size == len(tokenizer)
