"""Errors and warnings the sequence-model algorithms raise on bad input.

>>> from offline_plugins.errors import UserError
>>> issubclass(ContextLengthError, UserError) and issubclass(DiscretizationError, UserError)
True
"""

from __future__ import annotations

from offline_plugins.errors import ContextLengthError, DiscretizationError, SequenceModelError

__all__ = ["SequenceModelError", "ContextLengthError", "DiscretizationError", "TargetReturnWarning"]


class TargetReturnWarning(UserWarning):
    """A Decision Transformer target return of the wrong sign or far outside the data's returns."""
