"""argparse types shared by the sub-commands: whole numbers with a bound, device counts."""

from __future__ import annotations

import argparse
from typing import Union

__all__ = ["positive", "non_negative", "devices", "logger", "add_logger_argument"]


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


def logger(text: str) -> str:
    """``--logger``: one of Lightning's loggers, or several as ``a,b`` (whether its package is
    installed is checked by the command, which names the extra to install).

    >>> logger("tensorboard,mlflow")
    'tensorboard,mlflow'
    """
    from offline_plugins.lightning.loggers import LOGGERS

    for name in text.split(","):
        if name.strip().lower() not in LOGGERS:
            raise argparse.ArgumentTypeError(f"unknown logger {name.strip()!r}; choose from {', '.join(LOGGERS)}")
    return text


def add_logger_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--logger csv|tensorboard|mlflow|wandb`` (repeatable) to ``parser``."""
    parser.add_argument(
        "--logger", type=logger, action="append", default=None, metavar="csv|tensorboard|mlflow|wandb",
        help="log to this Lightning logger too (repeatable, or a,b); CSV (metrics.csv) always logs. tensorboard: "
        "OUT/tensorboard; mlflow: $MLFLOW_TRACKING_URI, else a file store in OUT/mlruns; wandb: project "
        "offline-plugins (WANDB_MODE=offline keeps it local). Optional extras: pip install 'offline-plugins[NAME]'",
    )
