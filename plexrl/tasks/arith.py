"""Exact arithmetic on untrusted expression text: the calculator tool and the countdown verifier.

Only integer literals, + - * /, unary minus and parentheses are accepted; the text is parsed
with `ast`, never `eval`ed. Values are `Fraction`s so `6/4*2 == 3` holds exactly.
Invariant: `evaluate` either returns a Fraction or raises `ArithError` with a readable message;
no input makes it run long (length and magnitude are bounded).
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**12

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ArithError(ValueError):
    pass


def parse(expression: str) -> ast.expr:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArithError(f"expression of {len(expression)} chars (expected at most {MAX_EXPRESSION_CHARS})")
    try:
        return ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ArithError(f"{expression!r} is not an arithmetic expression") from None


def evaluate(expression: str) -> Fraction:
    return _value(parse(expression))


def literals(expression: str) -> list[int]:
    """The integer literals of a valid expression, in order (countdown checks them)."""
    tree = parse(expression)
    _value(tree)
    constants = [node for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    return [node.value for node in sorted(constants, key=lambda node: node.col_offset)]


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ArithError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    raise ArithError(f"unsupported syntax {ast.dump(node)[:40]!r} (expected integers, + - * / and parentheses)")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise ArithError(f"value {value} exceeds {MAX_MAGNITUDE}")
    return value


def format_value(value: Fraction) -> str:
    """How the calculator prints a result: an integer, or a reduced fraction 'p/q'."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
