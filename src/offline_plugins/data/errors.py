"""Errors about datasets: each names the dataset, the problem and the fix."""

from __future__ import annotations

from offline_plugins.errors import UserError

__all__ = ["DatasetError"]


class DatasetError(UserError):
    """A dataset that cannot be found, read or used as it is."""
