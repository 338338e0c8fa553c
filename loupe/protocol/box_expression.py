"""The number arithmetic of a box written as a Python expression, evaluated without `eval`.

Mini-o3 reads the box of a `<grounding>` call with `eval(bbox)` (`AsyncvLLMEngine.process_tool_call`,
verl/workers/rollout/vllm_rollout/vllm_async_engine.py:523-526), so `[0.1, 0.2, 0.5, 0.6]`, `[0.1,0.2,0.5,0.6,]`,
`[1/4, 0.2, 0.5, 0.6]` and `[.1, 2e-1, 0.5, 0.6]` all crop there, while JSON refuses some of them. A model's text
must never run as code, so Loupe evaluates only what a box can be made of: number literals, lists and tuples of
them, unary +/- and the arithmetic operators, walked over Python's own parse tree (`ast`). Anything else (a name,
a call, an attribute, a string, a comprehension) is refused, as are results past `MAX_MAGNITUDE` and operands
that would make a power or a product explode. `ast.literal_eval` alone is too strict (it refuses `1/4`), and a
general sandbox such as simpleeval also evaluates names and function calls, which a box never needs; hence these
thirty lines.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

MAX_MAGNITUDE = 1e12
"""Larger intermediate results are refused: no box coordinate needs them, and `9**9**9` must not run."""
MAX_ITEMS = 16
"""A list or tuple longer than this is refused (a box has four numbers)."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class BoxExpressionError(ValueError):
    """The text is not number arithmetic Loupe evaluates; the message says what was found."""


def evaluate_box_expression(text: str) -> Any:
    """The value of `text` as Python would compute it, when it is numbers, lists or tuples and arithmetic."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise BoxExpressionError(f"invalid syntax ({type(err).__name__})") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise BoxExpressionError("the expression is nested too deeply") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, (ast.List, ast.Tuple)):
        if len(node.elts) > MAX_ITEMS:
            raise BoxExpressionError(f"a list of {len(node.elts)} items")
        items = [_value(item) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_number(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise BoxExpressionError("a power past 64")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as err:
            raise BoxExpressionError(type(err).__name__) from None
    raise BoxExpressionError(f"{type(node).__name__} is not number arithmetic")


def _number(node: ast.AST) -> int | float:
    value = _value(node)
    if isinstance(value, (list, tuple)):
        raise BoxExpressionError("arithmetic on a list")
    return value


def _bounded(value: Any) -> int | float:
    try:
        if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise BoxExpressionError("a number out of range")
    except OverflowError:  # an integer literal past a float's range
        raise BoxExpressionError("a number out of range") from None
    return value
