"""``arith``: a judge that checks the final number of each response against the prompt's chain.

A function judge (``f(prompt, first, second) -> P(first shown is better)``) for prompts such as
``"7+5*3-2="`` (operations on whole numbers, evaluated left to right, as the built-in arithmetic
tasks write them): a response is right when the last whole number it writes is the chain's value.
It prefers a right response to a wrong one and says 0.5 (no preference) when both are right, both
wrong, or the prompt is no such chain. Pure Python: listing the judges imports nothing heavy.

>>> arithmetic_judge("7+5*3-2=", "7+5=12\\n12*3=36\\n36-2=34", "7+5=12\\n12*3=36\\n36-2=35")
1.0
>>> arithmetic_judge("2*3=", "5", "the answer is 6"), arithmetic_judge("hello", "1", "2")
(0.0, 0.5)
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["chain_value", "arithmetic_judge"]

_CHAIN = re.compile(r"\s*\d+(\s*[-+*]\s*\d+)*\s*=?\s*")
_OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}


def chain_value(prompt: str) -> Optional[int]:
    """The value of ``prompt`` read as a chain ``a op b op c ...=`` evaluated left to right; None if it is none.

    >>> chain_value("7+5*3-2="), chain_value("7+x=")
    (34, None)
    """
    if not _CHAIN.fullmatch(prompt):
        return None
    numbers, ops = re.findall(r"\d+", prompt), re.findall(r"[-+*]", prompt)
    value = int(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        value = _OPS[op](value, int(n))
    return value


def _answer(response: str) -> Optional[int]:
    found = re.findall(r"-?\d+", response)
    return int(found[-1]) if found else None


def arithmetic_judge(prompt: str, first: str, second: str) -> float:
    """P(``first`` is better): 1.0 if only ``first``'s last number is the chain's value, 0.0 if only
    ``second``'s is, else 0.5."""
    value = chain_value(prompt)
    if value is None:
        return 0.5
    right_first, right_second = _answer(first) == value, _answer(second) == value
    return 0.5 if right_first == right_second else float(right_first)
