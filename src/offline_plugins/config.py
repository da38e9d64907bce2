"""Algorithm configs: dataclasses whose fields carry a line of help each.

A config is a plain :func:`dataclasses.dataclass`; every field is declared with
:func:`config_field` so ``offline-plugins info`` can print its default and help, and
``--set key=value`` / ``--config FILE.yaml`` overrides are type-checked against it.
This module imports neither torch nor yaml at import time.

>>> from dataclasses import dataclass
>>> @dataclass
... class DemoConfig:
...     lr: float = config_field(3e-4, "learning rate of every optimiser")
...     hidden: tuple = config_field((256, 256), "hidden layer widths")
>>> cfg = apply_overrides(DemoConfig(), {"lr": "1e-3", "hidden": "[64, 64]"})
>>> cfg.lr, cfg.hidden
(0.001, (64, 64))
>>> apply_overrides(DemoConfig(), {"lrr": "1"})
Traceback (most recent call last):
...
offline_plugins.config.ConfigError: unknown config key 'lrr' for DemoConfig; did you mean 'lr'? Known keys: hidden, lr
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from pathlib import Path
from typing import Any, Mapping

from offline_plugins.errors import UserError

__all__ = [
    "ConfigError",
    "config_field",
    "describe_config",
    "apply_overrides",
    "parse_set_args",
    "load_config_file",
    "config_to_dict",
    "ROLLOUT_DEFAULTS",
    "RUN_DEFAULTS",
    "TransitionConfig",
    "TDConfig",
]

#: The rollout settings' defaults, in one place: the online algorithms' config fields
#: (``algorithms/online.py``, ``online_dpo.py``), the text-rollouts kind's fallbacks for a
#: third-party config that lacks a field, and the keyword defaults of
#: ``RolloutCollector``/``load_rollout_data`` (``tests/test_online_train.py`` checks they agree).
ROLLOUT_DEFAULTS: dict[str, Any] = {
    "group_size": 8, "prompts_per_round": 16, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0,
    "batch_size": 32, "ppo_epochs": 1, "reference_sft_steps": 2000, "eval_prompts": 200, "max_attempts": 4,
}


#: A new run's options, in one place: the defaults of ``lightning.run.RunSettings`` (a resumed run
#: takes its checkpoint's instead) and what ``offline-plugins train --help`` says they are. None:
#: chosen by the run (``eval_every``: steps / 5; ``steps_per_call``: the shell's measured default).
RUN_DEFAULTS: dict[str, Any] = {
    "steps": 10_000, "seed": 0, "eval_every": None, "eval_episodes": 10, "checkpoint_every": None, "log_every": 50,
    "precision": "32-true", "accumulate": 1, "steps_per_call": None, "logger": None,
}


class ConfigError(UserError, ValueError):
    """A config key or value that does not fit the algorithm's config dataclass."""


def config_field(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a default and one line of help.

    Mutable defaults (lists, dicts) are wrapped in a ``default_factory``.
    """
    metadata = {"help": help, **kwargs.pop("metadata", {})}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    return getattr(tp, "__name__", str(tp))


def describe_config(config_cls: type) -> list[dict]:
    """One dict per field: ``name``, ``type``, ``default``, ``help``."""
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} is not a dataclass; algorithm configs must be dataclasses")
    out = []
    for f in dataclasses.fields(config_cls):
        default = _default_of(f)
        out.append(
            {
                "name": f.name,
                "type": _type_name(f.type),
                "default": list(default) if isinstance(default, tuple) else default,
                "help": f.metadata.get("help", ""),
            }
        )
    return out


def _resolved_types(config_cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(config_cls)
    except Exception:  # forward references a plugin did not import: fall back to defaults
        return {f.name: f.type for f in dataclasses.fields(config_cls)}


def _coerce(key: str, raw: Any, current: Any, annotation: Any, owner: str) -> Any:
    """Turn ``raw`` (a string from the command line, or a YAML value) into the field's type."""
    if isinstance(raw, str):
        text = raw.strip()
        if isinstance(current, bool) or annotation is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"config key '{key}' of {owner} expects true/false, got {raw!r}")
        if isinstance(current, str) or annotation is str:
            return text
        if text.lower() in ("none", "null") and (current is None or _is_optional(annotation)):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if current is None:
                return text
            raise ConfigError(
                f"config key '{key}' of {owner} expects {type(current).__name__}, got {raw!r}"
            ) from None
    else:
        value = raw
    if current is None:
        return value
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' of {owner} expects true/false, got {raw!r}")
    if isinstance(current, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, int) and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(current, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(current, list) and isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, type(current)):
        return value
    raise ConfigError(
        f"config key '{key}' of {owner} expects {type(current).__name__} (default {current!r}), got {raw!r}"
    )


def _is_optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with ``overrides`` applied, each checked against the field's type.

    Raises:
        ConfigError: an unknown key (close matches suggested) or a value of the wrong type.
    """
    cls = type(config)
    owner = cls.__name__
    names = [f.name for f in dataclasses.fields(cls)]
    types = _resolved_types(cls)
    changes = {}
    for key, raw in overrides.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "."
            raise ConfigError(
                f"unknown config key '{key}' for {owner}{hint} Known keys: {', '.join(sorted(names))}"
            )
        changes[key] = _coerce(key, raw, getattr(config, key), types.get(key), owner)
    return dataclasses.replace(config, **changes)


def parse_set_args(items: list[str] | None) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; a malformed item raises ConfigError."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) mapping of config overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    import yaml

    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a mapping of key: value, got {type(data).__name__}"
        )
    return data


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON-friendly dict of a config dataclass (tuples become lists)."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


@dataclasses.dataclass
class TransitionConfig:
    """The fields every offline-RL config on transition batches has (``bc``, and through
    :class:`TDConfig` the others); a subclass re-declares one only where its default or
    help differs (IQL standardises observations, BCQ has wider networks)."""

    batch_size: int = config_field(256, "transitions per gradient step")
    hidden: tuple = config_field((256, 256), "hidden layer widths of every network")
    normalize_observations: bool = config_field(False, "standardise observations with dataset statistics (data layer)")


@dataclasses.dataclass
class TDConfig(TransitionConfig):
    """:class:`TransitionConfig` plus what a TD(0) learner with Polyak-averaged targets needs."""

    gamma: float = config_field(0.99, "discount factor")
    tau: float = config_field(0.005, "Polyak rate of the target networks")
