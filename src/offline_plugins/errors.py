"""The error every bad user input raises.

The CLI prints a :class:`UserError` as one line (no traceback) and exits 2. Messages
name the input, what was expected and the fix.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """A bad input the user can fix: the message says which, what was expected and how."""

    exit_code = 2
