"""argparse types shared by the sub-commands: whole numbers with a bound, device counts."""

from __future__ import annotations

import argparse
from typing import Union

__all__ = ["positive", "non_negative", "seed", "devices", "logger", "add_logger_argument"]


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


#: the largest seed: numpy's generators take 0 .. 2**32 - 1 (torch takes more; a run seeds both)
MAX_SEED = 2 ** 32 - 1


def seed(text: str) -> int:
    """A seed: a whole number from 0 to 2**32 - 1 (numpy's range, which a run's seeding must fit).

    >>> seed("7")
    7
    >>> seed("-3")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a seed from 0 to 4294967295, got -3
    """
    value = _whole(text, -(10 ** 100))
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {value}")
    return value


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
