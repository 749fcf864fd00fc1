"""A small, safe parser for arithmetic: + - * / and parentheses over non-negative integers (no eval()).

Grammar (usual precedence, left to right):

    expression := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := NUMBER | "(" expression ")"        | "-" factor  (with unary_minus)

"x" and U+00D7 read as "*", U+00F7 as "/", the unicode minus U+2212 as "-". By default numbers are integers and
there is no unary minus ("-3" is refused: countdown's rule); the calculator tool allows both (`unary_minus`,
`decimals`).
Values are exact fractions; `evaluate` returns the value and the integers in the order written, and raises
`ExpressionError` for anything else (a stray character, an unbalanced parenthesis, division by zero, or, with
`integer_steps=True`, a division that leaves a remainder).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_LENGTH = 200
"""Longer expressions are refused (bounds the recursion depth and the work)."""

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_TOKEN_DECIMALS = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")
_ALIASES = {"x": "*", "\u00d7": "*", "\u00f7": "/", "\u2212": "-"}


class ExpressionError(ValueError):
    """The text is not a well-formed expression, or evaluating it breaks a rule."""


def tokenize(text: str, decimals: bool = False) -> list[str]:
    """Numbers (integers, or also decimals) and the characters + - * / ( ), aliases mapped; anything else is an
    `ExpressionError`."""
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    tokens = []
    for match in (_TOKEN_DECIMALS if decimals else _TOKEN).finditer(text.rstrip()):
        number, char = match.groups()
        if number is not None:
            tokens.append(number)
            continue
        char = _ALIASES.get(char, char)
        if char not in tuple("+-*/()"):
            raise ExpressionError(f"unexpected character {char!r} in {text!r}")
        tokens.append(char)
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], integer_steps: bool, unary_minus: bool):
        self.tokens, self.pos, self.integer_steps, self.unary_minus = tokens, 0, integer_steps, unary_minus
        self.numbers: list[Fraction] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("the expression ends too early")
        self.pos += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value *= self.factor()
                continue
            divisor = self.factor()
            if divisor == 0:
                raise ExpressionError("division by zero")
            if self.integer_steps and value % divisor != 0:
                raise ExpressionError(f"{value} / {divisor} is not a whole number")
            value /= divisor
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "-" and self.unary_minus:
            return -self.factor()
        if token == "(":
            value = self.expression()
            if self.peek() != ")":
                raise ExpressionError("a '(' is not closed")
            self.take()
            return value
        if not token[0].isdigit():
            raise ExpressionError(f"expected a number or '(', got {token!r}")
        self.numbers.append(Fraction(token))
        return Fraction(token)


def evaluate(
    text: str, integer_steps: bool = False, unary_minus: bool = False, decimals: bool = False
) -> tuple[Fraction, list[Fraction]]:
    """(value, the numbers used in order) of the expression `text`; `ExpressionError` when it is not one."""
    parser = _Parser(tokenize(text, decimals), integer_steps, unary_minus)
    value = parser.expression()
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return value, parser.numbers
