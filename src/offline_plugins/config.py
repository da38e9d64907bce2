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
import os
import reprlib
import typing
from pathlib import Path
from typing import Any, Mapping, Optional

from offline_plugins.errors import UserError

__all__ = [
    "ConfigError",
    "config_field",
    "FIELD_BOUNDS",
    "check_bounds",
    "describe_config",
    "apply_overrides",
    "parse_set_args",
    "load_config_file",
    "config_to_dict",
    "ROLLOUT_DEFAULTS",
    "RUN_DEFAULTS",
    "FineTuneConfig",
    "TransitionConfig",
    "TDConfig",
]

#: The rollout settings' defaults, in one place: the online algorithms' config fields
#: (``algorithms/online.py``, ``online_dpo.py``), the text-rollouts kind's fallbacks for a
#: third-party config that lacks a field, and the keyword defaults of
#: ``RolloutCollector``/``load_rollout_data`` (``tests/test_online_train.py`` checks they agree).
ROLLOUT_DEFAULTS: dict[str, Any] = {
    "group_size": 8, "prompts_per_round": 16, "max_new_tokens": None, "temperature": 1.0, "top_p": 1.0,
    "batch_size": 32, "ppo_epochs": 1, "reference_sft_steps": None, "eval_prompts": 200, "max_attempts": 4,
    "reward_timeout": 60.0, "reward_on_failure": 0.0, "reward_workers": "thread",
    # multi-turn tasks (tool-arithmetic): None is the task's own setting
    "max_turns": None, "tools": None, "tool_timeout": 5.0, "tool_reward": 0.0, "tool_sandbox": None,
    # several rewards (--reward NAME=SPEC twice or more): their weights, None for all 1
    "reward_weights": None,
}


#: A new run's options, in one place: the defaults of ``lightning.run.RunSettings`` (a resumed run
#: takes its checkpoint's instead) and what ``offline-plugins train --help`` says they are. None:
#: chosen by the run (``eval_every``: steps / 5; ``steps_per_call``: the shell's measured default).
RUN_DEFAULTS: dict[str, Any] = {
    "steps": 10_000, "seed": 0, "eval_every": None, "eval_episodes": 10, "checkpoint_every": None, "log_every": 50,
    "precision": "32-true", "accumulate": 1, "steps_per_call": None, "logger": None, "online_steps": 0,
}


def cache_root() -> Path:
    """Where the package caches what it makes (built-in models, references, log-probs):
    ``$OFFLINE_PLUGINS_CACHE`` or ``~/.cache/offline-plugins``."""
    return Path(os.environ.get("OFFLINE_PLUGINS_CACHE") or Path.home() / ".cache" / "offline-plugins")


class ConfigError(UserError, ValueError):
    """A config key or value that does not fit the algorithm's config dataclass."""


#: The range of a numeric field, by name, in every config (a field's own ``bounds=`` wins):
#: ``">0"``, ``">=1"``, or an interval such as ``"[0,1]"``, ``"(0,1]"``, ``"[0,0.5)"``. A value
#: outside is refused before anything is built (``beta=-5`` used to train quietly). Fields whose
#: name ends in ``_lr`` are ``">0"``. None (an unset optional field) is never checked.
FIELD_BOUNDS: dict[str, str] = {
    "lr": ">0", "batch_size": ">=1", "gamma": "[0,1]", "tau": ">0", "beta": ">=0", "temperature": ">=0",
    "expectile": "(0,1)", "top_p": "(0,1]", "group_size": ">=1", "prompts_per_round": ">=1", "max_new_tokens": ">=1",
    "ppo_epochs": ">=1", "epochs_per_round": ">=1", "max_attempts": ">=1", "eval_prompts": ">=1",
    "reference_sft_steps": ">=0", "lora_r": ">=0", "lora_alpha": ">0", "lora_dropout": "[0,1)", "dropout": "[0,1)",
    "label_smoothing": "[0,0.5)", "logprob_chunk": ">=0", "max_grad_norm": ">=0", "weight_decay": ">=0",
    "warmup_steps": ">=0", "reward_timeout": ">=0", "clip_epsilon": ">0", "clip_low": ">=0", "clip_high": ">=0", "clip_value": ">0",
    "kl_coef": ">=0", "vf_coef": ">=0", "rollout_correction": ">=1", "embed_dim": ">=1", "num_layers": ">=1",
    "num_heads": ">=1", "context_len": ">=1", "slice_len": ">=1", "horizon": ">=1", "beam_width": ">=1",
    "bins": ">=2", "plan_every": ">=1", "n_diffusion_steps": ">=1", "n_samples": ">=1", "ema_tau": "(0,1]",
    "num_samples": ">=1", "num_random": ">=1", "policy_freq": ">=1", "num_qvalue_nets": ">=1",
    "max_length": ">=1", "max_weight": ">0", "policy_noise": ">=0", "noise_clip": ">=0", "lmbda": "[0,1]",
    "min_q_weight": ">=0", "desirable_weight": ">0", "undesirable_weight": ">0", "uncertainty_coef": ">=0",
}


def _parse_bounds(text: str) -> tuple:
    """``(low, low_open, high, high_open)`` of a bounds string.

    >>> _parse_bounds(">0"), _parse_bounds("[0,0.5)")
    ((0.0, True, None, False), (0.0, False, 0.5, True))
    """
    text = text.replace(" ", "")
    if text.startswith(">="):
        return float(text[2:]), False, None, False
    if text.startswith(">"):
        return float(text[1:]), True, None, False
    lo, hi = text[1:-1].split(",")
    return float(lo), text[0] == "(", float(hi), text[-1] == ")"


def _describe_bounds(text: str) -> str:
    lo, lo_open, hi, hi_open = _parse_bounds(text)
    num = lambda v: f"{v:g}"  # noqa: E731
    if hi is None:
        return f"{'>' if lo_open else '>='} {num(lo)}"
    return f"in {'(' if lo_open else '['}{num(lo)}, {num(hi)}{')' if hi_open else ']'}"


def _bounds_of(f: dataclasses.Field) -> str | None:
    return f.metadata.get("bounds") or FIELD_BOUNDS.get(f.name) or (">0" if f.name.endswith("_lr") else None)


def check_bounds(config: Any) -> None:
    """Refuse a numeric field outside its range (:data:`FIELD_BOUNDS`, or the field's ``bounds=``).

    >>> @dataclasses.dataclass
    ... class C:
    ...     beta: float = config_field(0.1, "implicit-reward scale", bounds=">0")
    >>> check_bounds(C(beta=-5))
    Traceback (most recent call last):
    ...
    offline_plugins.config.ConfigError: config key 'beta' of C must be > 0 (implicit-reward scale), got -5; e.g. --set beta=0.1
    """
    for f in dataclasses.fields(config):
        bounds = _bounds_of(f)
        value = getattr(config, f.name)
        if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, lo_open, hi, hi_open = _parse_bounds(bounds)
        bad = value != value or (value <= lo if lo_open else value < lo)
        if hi is not None:
            bad = bad or (value >= hi if hi_open else value > hi)
        if bad:
            default = _default_of(f)
            example = f"; e.g. --set {f.name}={default}" if default is not None else ""
            raise ConfigError(f"config key '{f.name}' of {type(config).__name__} must be {_describe_bounds(bounds)} "
                              f"({f.metadata.get('help', '')}), got {value!r}{example}")


def config_field(default: Any, help: str, *, bounds: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field with a default and one line of help.

    ``bounds`` (``">0"``, ``"[0,1]"``...) is the field's range, checked by :func:`check_bounds`
    (default: :data:`FIELD_BOUNDS` by the field's name). Mutable defaults (lists, dicts) are
    wrapped in a ``default_factory``.
    """
    metadata = {"help": help, **kwargs.pop("metadata", {})}
    if bounds is not None:
        _parse_bounds(bounds)  # a malformed range fails where it is declared
        metadata["bounds"] = bounds
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
            raise ConfigError(f"config key '{key}' of {owner} expects true/false, got {excerpt(raw)}")
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
                f"config key '{key}' of {owner} expects {type(current).__name__}, got {excerpt(raw)}"
            ) from None
    else:
        value = raw
    if current is None:
        return value
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' of {owner} expects true/false, got {excerpt(raw)}")
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
        f"config key '{key}' of {owner} expects {type(current).__name__} (default {excerpt(current)}), "
        f"got {excerpt(raw)}"
    )


def _is_optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with ``overrides`` applied, each checked against the field's type.

    Raises:
        ConfigError: an unknown key (close matches suggested), a value of the wrong type, or a
            number outside its field's range (:func:`check_bounds`).
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
    out = dataclasses.replace(config, **changes)
    check_bounds(out)
    return out


def parse_set_args(items: list[str] | None) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; a malformed item raises ConfigError."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value
    return out


#: what a config file may hold: its size on disk, and what it expands to once YAML's aliases are
#: followed (each node counts 1, each scalar also its length); a file of overrides is a few lines,
#: and "billion laughs" (nested anchors/aliases) is refused before it is built in memory
MAX_CONFIG_FILE_BYTES = 1 << 20
MAX_CONFIG_EXPANDED = 100_000


def excerpt(value: Any, limit: int = 200) -> str:
    """The ``repr`` of ``value`` for an error message: at most ``limit`` characters, saying how much was cut.

    Containers are shortened before they are printed (``reprlib``), so a huge or self-sharing value
    costs no more than its excerpt.

    >>> excerpt("x" * 1000, 20)
    "'xxxxxxx...xxxxxxxx'"
    >>> excerpt([[1, 2, 3, 4, 5, 6, 7]] * 100, 40)
    '[[1, 2, 3, 4, 5, 6, ...], [1, 2... (cut)'
    """
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 3, 6, 6, 6, 6
    short.maxstring = short.maxother = max(12, limit)
    text = short.repr(value)
    return text if len(text) <= limit else text[: max(1, limit - 9)] + "... (cut)"


def _expanded_size(root: Any, limit: int) -> int:
    """What the composed YAML ``root`` expands to (nodes, plus each scalar's length), counting a node
    an alias reuses once per use; stops counting past ``limit``. -1 when a node contains itself."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[key] = 1 + len(node.value)
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        if key in open_nodes:
            return -1
        open_nodes.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_nodes:
                return -1
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]


def _duplicate_key(root: Any) -> Optional[tuple[str, int, int]]:
    """``(key, first line, second line)`` of the first key a YAML mapping of ``root`` holds twice, or None."""
    import yaml

    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in lines:
                        return key.value, lines[key.value], key.start_mark.line + 1
                    lines[key.value] = key.start_mark.line + 1
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += list(node.value)
    return None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) mapping of config overrides.

    The file is composed first and refused when it expands (aliases followed) past
    :data:`MAX_CONFIG_EXPANDED`, or is larger than :data:`MAX_CONFIG_FILE_BYTES`, before any
    value is built; error messages quote at most an excerpt of the file.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    size = p.stat().st_size
    if size > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"config file {str(p)!r} is {size} bytes; a file of config overrides holds at most "
                          f"{MAX_CONFIG_FILE_BYTES} (a few key: value lines): pass the keys to override only")
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        loader = loader_class(p.read_text())
        try:
            node = loader.get_single_node()
            if node is None:
                return {}
            expanded = _expanded_size(node, MAX_CONFIG_EXPANDED)
            if expanded < 0:
                raise ConfigError(f"config file {str(p)!r} holds a value that contains itself (a YAML alias inside "
                                  "the anchor it names); write the values out plainly")
            if expanded > MAX_CONFIG_EXPANDED:
                raise ConfigError(
                    f"config file {str(p)!r} expands to more than {MAX_CONFIG_EXPANDED:,} values and characters once "
                    "its YAML aliases (*name) are followed (nested anchors and aliases multiply); it was not loaded. "
                    "Write the overrides out plainly, without aliases of aliases"
                )
            twice = _duplicate_key(node)
            if twice is not None:
                key, first, second = twice
                raise ConfigError(f"config file {str(p)!r} sets {key[:60]!r} twice (lines {first} and {second}); YAML "
                                  "keeps the last silently, so which value was meant is unclear: keep one")
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {problem[:200]}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not text (UTF-8): {exc.reason} at byte {exc.start}; pass a "
                          "YAML file of key: value lines") from None
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
class FineTuneConfig:
    """The online phase of offline-to-online fine-tuning (``train --online-steps N``), in the configs of
    the algorithms that have one (``iql``, ``awac``, ``cal-ql``, ``rebrac``); see
    :mod:`offline_plugins.kinds.environment.finetune`. Mixed in before :class:`TDConfig`."""

    online_ratio: float = config_field(
        0.5, "online phase: fraction of each batch drawn from the transitions collected online, the rest from "
        "the dataset (Cal-QL's mixing ratio and RLPD's symmetric sampling: 0.5)", bounds="[0,1]")
    online_frames_per_round: int = config_field(
        1000, "online phase: environment steps a round collects with the policy as it is at the round's start "
        "(the TorchRL collector's frames_per_batch)", bounds=">=1")
    online_updates_per_round: int = config_field(
        1000, "online phase: gradient steps per round (updates per environment step: this / "
        "online_frames_per_round)", bounds=">=1")
    exploration_noise: float = config_field(
        0.1, "online phase, deterministic actors: std of the Gaussian action noise in units of half the action "
        "range (TD3's 0.1); stochastic actors sample their own distribution", bounds=">=0")


@dataclasses.dataclass
class TDConfig(TransitionConfig):
    """:class:`TransitionConfig` plus what a TD(0) learner with Polyak-averaged targets needs."""

    gamma: float = config_field(0.99, "discount factor")
    tau: float = config_field(0.005, "Polyak rate of the target networks")
