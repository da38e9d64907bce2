"""Errors and warnings the sequence-model algorithms raise on bad input.

>>> from offline_plugins.errors import UserError
>>> issubclass(ContextLengthError, UserError) and issubclass(DiscretizationError, UserError)
True
"""

from __future__ import annotations

from offline_plugins.objectives.common import OfflineLossError

__all__ = ["SequenceModelError", "ContextLengthError", "DiscretizationError", "TargetReturnWarning"]


class SequenceModelError(OfflineLossError):
    """Base class of the input errors of Decision Transformer, Trajectory Transformer and Diffuser."""


class ContextLengthError(SequenceModelError):
    """A context or planning window longer than the episodes it must be cut from."""


class DiscretizationError(SequenceModelError):
    """Too few bins to represent the data (Trajectory Transformer)."""


class TargetReturnWarning(UserWarning):
    """A Decision Transformer target return of the wrong sign or far outside the data's returns."""
