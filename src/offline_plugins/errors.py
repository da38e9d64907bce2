"""The error every bad user input raises, and the error classes shared across layers.

The CLI prints a :class:`UserError` as one line (no traceback) and exits 2. Messages
name the input, what was expected and the fix. The loss errors live here rather than in
:mod:`offline_plugins.objectives` because the networks of :mod:`offline_plugins.modules`
raise them too, and modules sit below objectives (imports point one way).

>>> issubclass(DiscretizationError, UserError) and issubclass(ContextLengthError, ValueError)
True
"""

from __future__ import annotations

__all__ = ["UserError", "OfflineLossError", "SequenceModelError", "ContextLengthError", "DiscretizationError"]


class UserError(Exception):
    """A bad input the user can fix: the message says which, what was expected and how."""

    exit_code = 2


class OfflineLossError(UserError, ValueError):
    """Base class of the input errors the offline-RL losses (and their networks) raise."""


class SequenceModelError(OfflineLossError):
    """Base class of the input errors of Decision Transformer, Trajectory Transformer and Diffuser."""


class ContextLengthError(SequenceModelError):
    """A context or planning window longer than the episodes it must be cut from."""


class DiscretizationError(SequenceModelError):
    """Too few bins to represent the data (Trajectory Transformer)."""
