"""What a run trains, checked: :func:`plan_run` and the :class:`RunPlan` it returns.

Every check of the algorithm, the dataset and the config is made here, once, before a
run folder exists: the algorithm is resolved, the dataset id is resolved by the
algorithm's data kind and refused when another kind claims it, its action space must
fit the algorithm, the config overrides must name config fields (a run option such as
``steps`` is refused naming its flag), and the data is loaded. The CLI's ``train``, the
Python entries of :mod:`offline_plugins.lightning.run` and
:func:`~offline_plugins.lightning.builder.build` all plan through :func:`plan_run`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

from offline_plugins.config import apply_overrides, load_config_file, parse_set_args
from offline_plugins.errors import UserError
from offline_plugins.plugins import shared_registry
from offline_plugins.plugins.datakind import DataOptions
from offline_plugins.plugins.registry import AlgorithmSpec
from offline_plugins.presets import preset

if TYPE_CHECKING:  # pragma: no cover
    from offline_plugins.lightning.checkpoints import ResumedRun

__all__ = ["RunPlan", "plan_run", "build_parts"]


@dataclasses.dataclass
class RunPlan:
    """An algorithm, its config and the data it trains on, all checked.

    Attributes:
        spec: the algorithm's registry record.
        config: the algorithm config with overrides applied.
        data: the loaded dataset (``OfflineData``, ``PreferenceData``...).
        dataset_id: the dataset's id.
        data_kwargs: what was passed to the loader (saved to reload it).
        batch_size: elements per step.
        sampler: ``"random"`` or ``"slice"``.
        slice_len: window length for ``"slice"``.
        kind: the :class:`~offline_plugins.kinds.DataKind` the algorithm reads (None in a plan
            made by hand: the installed plugins' kind of ``spec``).
        options: the data options of the run (``--model``, ``--drop-nonfinite``, ``--drop-empty``).
    """

    spec: Any
    config: Any
    data: Any
    dataset_id: str
    data_kwargs: dict
    batch_size: int
    sampler: str = "random"
    slice_len: Optional[int] = None
    kind: Any = None
    options: Any = None

    def __post_init__(self) -> None:
        if self.kind is None:  # a RunPlan made by hand

            self.kind = shared_registry().kind_of(self.spec)
        if self.options is None:
            self.options = DataOptions()


def build_parts(plan: RunPlan, seed: int):
    """The algorithm's ``AlgorithmParts`` for ``plan``, its networks initialised from ``seed``."""
    torch.manual_seed(seed)
    return plan.spec.load_build()(plan.config, plan.data)


def _as_overrides(config: Union[None, str, os.PathLike, Mapping], overrides) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if config is not None:
        merged.update(load_config_file(config) if isinstance(config, (str, os.PathLike)) else dict(config))
    if overrides:
        merged.update(parse_set_args(list(overrides)) if not isinstance(overrides, Mapping) else dict(overrides))
    return merged


#: run options (``RunSettings``' fields, the CLI's flags) that a user may try as config keys
_RUN_OPTIONS: dict[str, str] = {
    "steps": "--steps", "max_steps": "--steps", "seed": "--seed", "eval_every": "--eval-every",
    "eval_episodes": "--eval-episodes", "devices": "--devices", "accelerator": "--accelerator",
    "num_nodes": "--num-nodes", "strategy": "--strategy", "precision": "--precision", "out": "--out", "out_dir": "--out",
    "resume": "--resume", "checkpoint_every": "--checkpoint-every", "log_every": "--log-every",
    "threads": "--threads", "compile": "--compile", "model": "--model", "dataset": "--dataset",
    "drop_nonfinite": "--drop-nonfinite", "drop_empty": "--drop-empty", "overwrite": "--overwrite",
    "reward": "--reward", "accumulate": "--accumulate", "gradient_accumulation_steps": "--accumulate",
}


def _refuse_run_options(spec, overrides: Mapping[str, Any]) -> None:
    """A run option given as a config key (``--set steps=5``) is refused naming its flag."""
    fields = {f.name for f in dataclasses.fields(spec.config)}
    for key, value in overrides.items():
        flag = _RUN_OPTIONS.get(key)
        if flag is not None and key not in fields:
            arg = key if key != "max_steps" else "steps"
            raise UserError(
                f"{key!r} is not a config key of {spec.name!r} but an option of the run: pass {flag} {value} to "
                f"'offline-plugins train' (RunSettings({arg}=...) from Python) instead of --set/--config {key}"
            )


def _check_action_space(spec, dataset_id: str, action_space: Optional[str]) -> None:
    if action_space and spec.action_spaces and action_space not in spec.action_spaces:
        raise UserError(
            f"algorithm {spec.name!r} needs {' or '.join(spec.action_spaces)} actions, but dataset {dataset_id!r} "
            f"has {action_space} actions; pick an algorithm for {action_space} actions ('offline-plugins list') "
            "or another dataset"
        )


def _refuse_foreign(spec, kind, dataset: str, registry) -> None:
    """Refuse a dataset id that another data kind claims, saying what to train on it."""
    if kind.claims(dataset):
        return
    for other in registry.data_kinds.values():
        if other.name != kind.name and other.claims(dataset):
            raise UserError(
                f"algorithm {spec.name!r} reads {spec.data} data ({kind.description}), but {dataset!r} is "
                f"{other.description}; {other.train_hint}, or pick a dataset of {spec.data} "
                "('offline-plugins data list')"
            )


def plan_run(
    algorithm,
    dataset,
    *,
    config: Union[None, str, os.PathLike, Mapping] = None,
    overrides: Union[None, Sequence[str], Mapping[str, Any]] = None,
    registry=None,
    device: str = "cpu",
    progress: bool = True,
    model: Optional[str] = None,
    drop_nonfinite: bool = False,
    drop_empty: bool = False,
    reward: Optional[str] = None,
    resumed: Optional["ResumedRun"] = None,
) -> RunPlan:
    """Resolve, check and load everything a run needs; raises a ``UserError`` on bad input.

    What depends on the kind of data (resolving the id, loading, the batch layout) is
    asked of the algorithm's :class:`~offline_plugins.kinds.DataKind`.

    Args:
        algorithm: an algorithm name or an ``AlgorithmSpec``.
        dataset: a dataset id, or a loaded dataset object (used as is). Preference
            algorithms take a preference dataset id
            (:mod:`offline_plugins.text.data.preference_sources`) or a ``PreferenceData``.

    Keyword Args:
        config: a YAML/JSON file of config overrides, or a mapping.
        overrides: ``["key=value", ...]`` (``--set``) or a mapping, applied after ``config``.
        registry: the plugin registry (default: discover installed plugins).
        device: where the data layer puts the dataset.
        progress: show a progress bar when a dataset is made.
        model: preference algorithms: ``"tiny"`` (default), a ``save_pretrained``
            directory or a hub id, the model the reference is made from.
        drop_nonfinite: Minari datasets: drop episodes with NaN/inf values instead of
            refusing the dataset (``OfflineData.dropped`` counts them).
        drop_empty: Minari datasets: drop zero-length episodes instead of refusing.
        reward: data scored while training (text rollouts): a reward function
            ``"module:function"`` instead of the dataset's verifier.
        resumed: the run a resume continues
            (:class:`~offline_plugins.lightning.checkpoints.ResumedRun`): its config, model,
            reward function and drop flags come first, and what is given above goes on top.
    """
    if resumed is not None:  # a bare resume continues with the run's own config and data options
        given = resumed.plan_kwargs(config=config, overrides=overrides, model=model, reward=reward,
                                    drop_nonfinite=drop_nonfinite, drop_empty=drop_empty)
        config, overrides, model, reward = given["config"], given["overrides"], given["model"], given["reward"]
        drop_nonfinite, drop_empty = given["drop_nonfinite"], given["drop_empty"]
    if registry is None:
        registry = shared_registry()
    spec = algorithm if isinstance(algorithm, AlgorithmSpec) else registry.algorithm(algorithm)
    if spec.experimental:
        logging.getLogger(__name__).warning("%s is experimental: %s", spec.name, spec.experimental)
    kind = registry.kind_of(spec)
    options = DataOptions(model=model, drop_nonfinite=drop_nonfinite, drop_empty=drop_empty, reward=reward)
    kind.check_options(spec, options)
    if isinstance(dataset, str):
        _refuse_foreign(spec, kind, dataset, registry)
        dataset_id, action_space = kind.resolve(dataset, spec=spec, registry=registry)
    else:
        dataset_id, action_space = getattr(dataset, "dataset_id", "custom"), getattr(dataset, "action_space", None)
    _check_action_space(spec, dataset_id, action_space)
    merged = _as_overrides(config, overrides)
    if "preset" in merged and "preset" not in {f.name for f in dataclasses.fields(spec.config)}:
        merged = {**preset(str(merged.pop("preset")), spec.name), **merged}  # the user's keys win
    _refuse_run_options(spec, merged)
    cfg = apply_overrides(spec.default_config(), merged)
    layout = kind.batch_layout(cfg)
    if isinstance(dataset, str):
        loaded = kind.load(dataset_id, spec=spec, config=cfg, registry=registry, device=device, progress=progress,
                           options=options)
        data, data_kwargs = loaded.data, loaded.data_kwargs
    else:
        data, data_kwargs = dataset, {}
    _check_action_space(spec, dataset_id, getattr(data, "action_space", None))
    return RunPlan(spec, cfg, data, dataset_id, data_kwargs, layout.batch_size, layout.sampler, layout.slice_len,
                   kind=kind, options=options)
