"""argparse types shared by the sub-commands: whole numbers with a bound, device counts."""

from __future__ import annotations

import argparse
from typing import Union

__all__ = ["positive", "non_negative", "devices"]


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number >= {least}, got {value}")
    return value


def positive(text: str) -> int:
    """A whole number >= 1.

    >>> positive("3")
    3
    """
    return _whole(text, 1)


def non_negative(text: str) -> int:
    """A whole number >= 0."""
    return _whole(text, 0)


def devices(text: str) -> Union[int, str]:
    """``auto`` or a whole number >= 1."""
    return "auto" if text == "auto" else positive(text)
