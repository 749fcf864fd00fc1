"""Tool-use environments for multi-turn rollouts (docs/multi-turn.md).

`CalculatorEnvironment` (`builtin:calculator`): the policy may end a turn with a tool call `<calc>12*7</calc>`;
the environment evaluates it with a small arithmetic parser (no `eval`) and answers `<result>84</result>`. A turn
without a tool call is the final answer: its last number (`lit_rlhf.rewards.verifiable.final_number`: "1e3" is 1000,
"2^{10}" 1024, a power too large to compute no answer) is compared exactly with the row's answer column (1.0 / 0.0).
Made for `builtin:arithmetic` prompts (column `answer`).

`PeekEnvironment` (`builtin:peek`): for `builtin:digits` prompts and the character-level digits tokenizer. The
episode hides a digit (the sum of the prompt's digits mod 10). A turn containing '>' asks for it (the turn stops
there) and the environment answers with the digit (the first ask earns `ask_bonus`); any other turn is the final
answer, scored 1.0 when it is exactly the hidden digit, 0.5 when it starts with it, else 0. Guessing earns 0.1
on average, asking then copying 1 + ask_bonus.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from lit_rlhf.rewards.verifiable import final_number, parse_number
from lit_rlhf.rollout.environment import Environment, StepResult
from lit_rlhf.tasks.digits import DIGITS, EOS, PAD, SEPARATOR, UNK
from lit_rlhf.tasks.expression import ExpressionError
from lit_rlhf.tasks.expression import evaluate as evaluate_expression

CalculatorError = ExpressionError
"""An expression the calculator cannot evaluate (syntax, division by zero, too long)."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers (decimals too), + - * /, unary minus, parentheses
    (`lit_rlhf.tasks.expression`); `CalculatorError` on anything else."""
    value, _ = evaluate_expression(expression, unary_minus=True, decimals=True)
    return value


def format_number(value: Fraction) -> str:
    """An integer as such, anything else with up to 6 decimals ('7/2' -> '3.5')."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


class CalculatorEnvironment(Environment):
    """A calculator tool for arithmetic prompts; state per episode: the expected answer (a Fraction)."""

    stop_strings = ("</calc>",)

    def __init__(self, answer_column: str = "answer"):
        self.answer_column = answer_column

    def reset(self, rows: list[dict[str, Any]]) -> list[Any]:
        missing = [i for i, row in enumerate(rows) if self.answer_column not in row]
        if missing:
            raise KeyError(
                f"CalculatorEnvironment: prompt rows {missing[:5]} have no {self.answer_column!r} column; set "
                "model.environment.init_args.answer_column to the column holding the answer"
            )
        answers = [parse_number(row[self.answer_column]) for row in rows]
        bad = [i for i, a in enumerate(answers) if a is None]
        if bad:
            raise ValueError(
                f"CalculatorEnvironment: prompt row {bad[0]} has {self.answer_column}="
                f"{rows[bad[0]][self.answer_column]!r}, which is not a number (such as '42', '-1,234.5' or '3/4')"
            )
        return answers

    def step(self, states: list[Any], actions: list[str]) -> StepResult:
        observations, rewards, done = [], [], []
        for answer, action in zip(states, actions, strict=True):
            call = re.search(r"<calc>(.*?)</calc>\s*$", action, flags=re.DOTALL)
            if call is not None:
                try:
                    result = format_number(evaluate(call.group(1)))
                except CalculatorError as err:
                    result = f"error: {err}"
                observations.append(f"<result>{result}</result>")
                rewards.append(0.0)
                done.append(False)
                continue
            found = final_number(action)
            observations.append("")
            rewards.append(float(found is not None and found == answer))
            done.append(True)
        return StepResult(observations, rewards, done, list(states))


def visible(text: str) -> str:
    """`text` without the digits tokenizer's special tokens (whose names contain '>')."""
    for special in (PAD, EOS, UNK):
        text = text.replace(special, "")
    return text


def hidden_digit(prompt: str) -> str:
    """The digit `PeekEnvironment` hides for a digits prompt: the sum of its digits mod 10."""
    return str(sum(int(c) for c in prompt if c in DIGITS) % 10)


class PeekEnvironment(Environment):
    """Ask ('>') to see a hidden digit, then repeat it; state per episode: (hidden digit, asked already).

    ask_bonus: reward for an episode's first ask (shaping: asking alone is worth nothing until the policy
    also copies the digit, so without it the two skills have no gradient to start from)."""

    stop_strings = (SEPARATOR,)

    def __init__(self, ask_bonus: float = 0.1):
        self.ask_bonus = float(ask_bonus)

    def reset(self, rows: list[dict[str, Any]]) -> list[Any]:
        return [(hidden_digit(row["prompt"]), False) for row in rows]

    def step(self, states: list[Any], actions: list[str]) -> StepResult:
        observations, rewards, done, new_states = [], [], [], []
        for (digit, asked_before), action in zip(states, actions, strict=True):
            asks = visible(action).endswith(SEPARATOR)  # the collector stops a turn at '>' outside special tokens
            if asks:
                reward = 0.0 if asked_before else self.ask_bonus
            else:
                reward = 1.0 if action == digit else 0.5 if action.startswith(digit) else 0.0
            observations.append(digit if asks else "")
            rewards.append(reward)
            done.append(not asks)
            new_states.append((digit, asked_before or asks))
        return StepResult(observations, rewards, done, new_states)
