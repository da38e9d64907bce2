"""The offline pipeline as two functions: :func:`train` and :func:`evaluate_checkpoint`.

``train`` resolves the algorithm and dataset, applies config overrides, loads the
data and builds the algorithm -- every step that can fail on a bad input -- before
it creates the output folder; then it trains with Lightning's ``Trainer`` and writes
``summary.json``, ``metrics.csv``, ``learning_curve.png`` and
``checkpoints/last.ckpt``. The CLI's ``train`` and ``eval`` commands call these.

Everything that depends on the kind of data is asked of the algorithm's data kind
(:mod:`offline_plugins.kinds`): how the dataset id is resolved and loaded, the batch
layout, the evaluation callback, what ``summary.json`` adds and how the policy is
exported. The config fields a kind reads (``batch_size``, ``slice_len``, the loader's
``normalize_observations``...) are listed in its ``config_fields``. ``train``'s own
``drop_nonfinite``/``drop_empty`` arguments (CLI ``--drop-nonfinite``/``--drop-empty``)
apply to Minari datasets for any algorithm.

What a run guarantees (see docs/training.md): checkpoints are read with
``weights_only=True`` only; one run per output folder at a time; SIGINT/SIGTERM stop at
a step boundary with ``last.ckpt`` and a partial ``summary.json`` saved; a resume that
does not fit the checkpoint is refused naming what differs. The guards live in
:mod:`offline_plugins.lightning.guards`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from offline_plugins.errors import UserError
from offline_plugins.lightning.guards import (
    GracefulInterrupt,
    RunError,
    RunFolderLock,
    RunInterrupted,
    algorithm_of_checkpoint,
    check_checkpoint,
    check_devices,
    check_out_dir,
    check_precision,
    check_resume,
    check_strategy,
    peak_memory_mb,
    quiet_lightning,
    read_checkpoint,
    restored_process_state,
)

__all__ = [
    "RunPlan",
    "ResumedRun",
    "RUN_DEFAULTS",
    "plan_run",
    "train",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_trained_run",
    "TrainedRun",
    "plot_learning_curve",
    "RunError",
    "RunInterrupted",
]

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
        kind: the :class:`~offline_plugins.kinds.DataKind` the algorithm reads.
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


def _as_overrides(config: Union[None, str, os.PathLike, Mapping], overrides) -> dict[str, Any]:
    from offline_plugins.config import load_config_file, parse_set_args

    merged: dict[str, Any] = {}
    if config is not None:
        merged.update(load_config_file(config) if isinstance(config, (str, os.PathLike)) else dict(config))
    if overrides:
        merged.update(parse_set_args(list(overrides)) if not isinstance(overrides, Mapping) else dict(overrides))
    return merged


#: run options (``train``'s arguments, the CLI's flags) that a user may try as config keys
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
                f"'offline-plugins train' (train({arg}=...) from Python) instead of --set/--config {key}"
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
) -> RunPlan:
    """Resolve, check and load everything a run needs; raises a ``UserError`` on bad input.

    What depends on the kind of data (resolving the id, loading, the batch layout) is
    asked of the algorithm's :class:`~offline_plugins.kinds.DataKind`.

    Args:
        algorithm: an algorithm name or an ``AlgorithmSpec``.
        dataset: a dataset id, or a loaded dataset object (used as is). Preference
            algorithms take a preference dataset id
            (:mod:`offline_plugins.data.preference_sources`) or a ``PreferenceData``.

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
    """
    from offline_plugins.config import apply_overrides
    from offline_plugins.plugins.datakind import DataOptions
    from offline_plugins.plugins.registry import AlgorithmSpec

    if registry is None:
        from offline_plugins.plugins import shared_registry

        registry = shared_registry()
    spec = algorithm if isinstance(algorithm, AlgorithmSpec) else registry.algorithm(algorithm)
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


#: train()'s run options with their defaults for a new run; a resumed run takes each one it is
#: not given from its checkpoint (eval_every, checkpoint_every and steps_per_call default to None)
RUN_DEFAULTS: dict[str, Any] = {"steps": 10_000, "seed": 0, "eval_every": None, "eval_episodes": 10,
                                "checkpoint_every": None, "log_every": 50, "precision": "32-true", "accumulate": 1,
                                "steps_per_call": None, "logger": None}


@dataclasses.dataclass
class ResumedRun:
    """What a checkpoint says about the run it belongs to: what a bare ``--resume`` continues.

    ``options`` are ``train()``'s run options (:data:`RUN_DEFAULTS`' names) the run was started
    with; ``config`` its whole algorithm config; ``model``, ``reward``, ``drop_nonfinite`` and
    ``drop_empty`` how its data was loaded. Checkpoints written before a setting was recorded
    lack it, and the new run's default applies. ``checkpoint`` is the loaded (and checked)
    checkpoint itself, which the resumed fit starts from: it is read once.
    """

    path: Path
    options: dict[str, Any]
    config: dict[str, Any]
    data_options: dict[str, Any]
    checkpoint: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> "ResumedRun":
        ckpt = read_checkpoint(path)
        info = check_checkpoint(ckpt, path, for_resume=True)
        run = info.get("run") or {}
        options = {k: run[k] for k in RUN_DEFAULTS if k in run}
        if info.get("seed") is not None:
            options["seed"] = int(info["seed"])
        kwargs = run.get("data_kwargs") or {}
        data_options = {k: run[k] for k in ("model", "reward") if run.get(k) is not None}
        data_options.update({k: True for k, flag in (("drop_nonfinite", "drop_nonfinite"),
                                                      ("drop_empty", "drop_empty_episodes")) if kwargs.get(flag)})
        return cls(Path(path), options, dict(info.get("config") or {}), data_options, ckpt)

    @classmethod
    def find(cls, resume, out_dir) -> Optional["ResumedRun"]:
        """The run ``resume`` (``True``: ``out_dir``'s ``last.ckpt``; a path) points at, or None when
        not resuming or when the folder is not known yet (no ``out_dir``: the default folder is
        chosen after the dataset is resolved). A ``ResumedRun`` is returned as it is."""
        if isinstance(resume, cls):
            return resume
        if resume in (None, False, ""):
            return None
        if resume is True and out_dir is None:
            return None
        return cls.read(_resume_path(resume, Path(out_dir) if out_dir is not None else Path(".")))

    def plan_kwargs(self, *, config=None, overrides=None, **given) -> dict[str, Any]:
        """``plan_run``'s config and data arguments: the run's own, then what the caller gave on top
        (a config file or mapping, ``--set`` overrides, a model, a reward function, the drop flags)."""
        merged = dict(self.config)
        if config is not None:
            merged.update(_as_overrides(config, None))
        out = {"config": merged, "overrides": overrides}
        for key, value in given.items():
            out[key] = value if value not in (None, False) else self.data_options.get(key, value)
        return out


def _resolve_run_options(given: dict[str, Any], resumed: Optional[ResumedRun]) -> tuple[dict, Optional[dict]]:
    """Each run option: the caller's, else the resumed run's, else the default; and the record of
    which came from where for the summary (None for a new run)."""
    options, record = {}, None
    if resumed is not None:
        record = {"from": str(resumed.path), "kept": {}, "overridden": {}}
    for key, default in RUN_DEFAULTS.items():
        value = given.get(key)
        if value is not None:
            options[key] = value
            if resumed is not None and key in resumed.options and resumed.options[key] != value:
                record["overridden"][key] = {"checkpoint": resumed.options[key], "now": value}
        elif resumed is not None and key in resumed.options:
            options[key] = resumed.options[key]
            record["kept"][key] = resumed.options[key]
        else:
            options[key] = default
    return options, record


def _build_parts(plan: RunPlan, seed: int):
    import torch

    torch.manual_seed(seed)
    return plan.spec.load_build()(plan.config, plan.data)


def _default_out_dir(algorithm: str, dataset_id: str, seed: int) -> Path:
    """``runs/<algorithm>-<dataset>-s<seed>``, numbered ``-2``, ``-3``... so a rerun never clobbers one."""
    base = Path("runs") / f"{algorithm}-{dataset_id.replace('/', '_')}-s{seed}"
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _is_launched_rank() -> bool:
    # Lightning's DDP launcher re-runs the command in child processes with LOCAL_RANK set
    return int(os.environ.get("LOCAL_RANK", "0") or 0) > 0 or int(os.environ.get("NODE_RANK", "0") or 0) > 0


def _needs_unused_parameters(parts) -> bool:
    # groups that sit steps out still backpropagate (with weight 0) under DDP, see
    # AlgorithmModule.on_fit_start; parameters no group steps never get a gradient
    grouped = {id(p) for g in parts.optimizers for p in g.params}
    return any(id(p) not in grouped for p in parts.loss.parameters() if p.requires_grad)


def decoder_layer_classes(model) -> set:
    """The layer classes of a transformers model that FSDP wraps one by one (its ``_no_split_modules``).

    >>> from offline_plugins.modules.tiny_lm import load_causal_lm
    >>> sorted(c.__name__ for c in decoder_layer_classes(load_causal_lm("tiny", seed=0)[0]))
    ['GPT2Block']
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names} if model is not None else set()


def _strategy(devices, num_nodes: int, parts, strategy):
    if strategy == "fsdp":
        # shard a language model layer by layer; the parameters keep their identity, so the
        # optimiser groups built before wrapping still name them
        from lightning.pytorch.strategies import FSDPStrategy

        layers = decoder_layer_classes(parts.model)
        if not layers:
            raise RunError("--strategy fsdp wraps the decoder layers of a transformers model (its "
                           "_no_split_modules); this algorithm's networks have none: use --strategy ddp")
        return FSDPStrategy(auto_wrap_policy=layers, use_orig_params=True)
    if strategy is not None and strategy != "auto":
        return strategy
    single = (isinstance(devices, int) and devices == 1) or devices in ("1", [0])
    if single and num_nodes == 1:
        return "auto"
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(find_unused_parameters=_needs_unused_parameters(parts))


def train(
    algorithm,
    dataset,
    *,
    steps: Optional[int] = None,
    seed: Optional[int] = None,
    eval_every: Optional[int] = None,
    eval_episodes: Optional[int] = None,
    devices: Union[int, str] = 1,
    accelerator: str = "auto",
    num_nodes: int = 1,
    strategy=None,
    precision: Optional[str] = None,
    config: Union[None, str, os.PathLike, Mapping] = None,
    overrides: Union[None, Sequence[str], Mapping[str, Any]] = None,
    out_dir: Union[None, str, os.PathLike] = None,
    resume: Union[None, bool, str, os.PathLike] = None,
    overwrite: bool = False,
    checkpoint_every: Optional[int] = None,
    log_every: Optional[int] = None,
    progress: bool = True,
    threads: Optional[int] = None,
    compile: bool = False,
    steps_per_call: Optional[int] = None,
    accumulate: Optional[int] = None,
    registry=None,
    callbacks: Sequence[Any] = (),
    logger: Union[None, str, Sequence[str]] = None,
    plan: Optional[RunPlan] = None,
    model: Optional[str] = None,
    drop_nonfinite: bool = False,
    drop_empty: bool = False,
    reward: Optional[str] = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Train ``algorithm`` on ``dataset``, evaluate it, and write the run to ``out_dir``.

    Args:
        algorithm: an algorithm name (``offline-plugins list``) or an ``AlgorithmSpec``.
        dataset: a dataset id (made on the fly from its recipe if missing) or an
            ``OfflineData``-like object.

    Keyword Args:
        steps: gradient steps in total (default 10,000; a resumed run trains up to this many).
        seed: seeds network initialisation, batches, loss noise and evaluation resets (default 0).
        eval_every: evaluate every this many steps (default ``steps // 5``, or the resumed
            run's; 0: only at the end).
        eval_episodes: episodes per evaluation.
        devices, accelerator, num_nodes, strategy: as Lightning's ``Trainer``; more
            than one device trains with DDP. ``strategy`` may be a Lightning strategy object or
            a name (``ddp``, ``ddp_spawn``, ``deepspeed``, ``fsdp``: shards a transformers
            policy layer by layer; CUDA only).
        precision: Lightning's precision: ``32-true`` (default), ``bf16-mixed``,
            ``bf16-true``, ``64-true``, and on CUDA ``16-mixed``/``16-true``. Cached
            reference log-probs stay as computed at load (fp32) whatever it is.
        config: YAML/JSON file (or mapping) of config overrides.
        overrides: ``["key=value", ...]`` applied after ``config``.
        out_dir: output folder (default ``runs/<algorithm>-<dataset>-s<seed>``); it must not
            hold another run unless resuming.
        resume: ``True`` for ``out_dir/checkpoints/last.ckpt``, a checkpoint path, or a
            :class:`ResumedRun` already read (as the CLI passes). A resumed
            run finishes the run it resumes: each run option left at None (``steps``, ``seed``,
            ``eval_every``, ``eval_episodes``, ``checkpoint_every``, ``log_every``,
            ``precision``, ``accumulate``, ``steps_per_call``, ``logger``; :data:`RUN_DEFAULTS`) and the
            config, model, reward function and drop flags are the checkpoint's; what is given
            overrides them, and the summary's ``resume`` records which were kept and which
            overridden.
        overwrite: replace the earlier run in ``out_dir`` (its summary, metrics, plot,
            checkpoints and exported model; nothing else in the folder is touched) instead
            of refusing it.
        checkpoint_every: save ``last.ckpt`` every this many steps (default: at each evaluation).
        log_every: log training metrics every this many steps.
        progress: show the progress bar.
        threads: CPU threads per process for torch (None: torch's default). Small
            networks on a busy machine train several times faster with 1.
        compile: run the loss through ``torch.compile`` (opt-in: the first steps wait for
            the compilation, about a minute on a CPU; see docs/benchmarks.md for the gain).
        accumulate: split each step's batch into this many micro-batches, one backward each,
            one optimiser step (gradient accumulation: the memory of a micro-batch, the
            gradient of the batch). ``batch_size`` stays the elements per optimiser step.
        steps_per_call: gradient steps per Lightning ``training_step`` (the same run bit for bit,
            with Lightning's cost per call spread over them; None: ``DEFAULT_STEPS_PER_CALL`` of
            :mod:`offline_plugins.lightning.module`, or 1 when one of ``callbacks`` hooks every batch).
        registry: plugin registry (default: discover installed plugins).
        callbacks: extra Lightning callbacks.
        logger: loggers beside the CSV one, which always writes ``metrics.csv``: ``"tensorboard"``,
            ``"mlflow"``, ``"wandb"``, or several (a list or ``"a,b"``); see
            :mod:`offline_plugins.lightning.loggers`. A missing package is refused before anything loads.
        plan: an already checked :class:`RunPlan` (skips :func:`plan_run`).
        model: preference algorithms: the model the reference is made from
            (``"tiny"``, a ``save_pretrained`` directory or a hub id).
        drop_nonfinite, drop_empty: drop episodes with NaN/inf values, or of zero length,
            instead of refusing the dataset (counted in the summary's ``dropped``).
        reward: algorithms trained on their own rollouts: a reward function
            ``"module:function"`` instead of the dataset's verifier.
        verbose: show Lightning's own info lines (accelerator banner and the like).

    Raises:
        RunInterrupted: SIGINT or SIGTERM stopped the run at a step boundary, after
            ``last.ckpt`` and a partial ``summary.json`` (``"interrupted": true``) were written;
            the message says how to resume.

    Returns:
        The summary written to ``summary.json``: ``algorithm``, ``dataset``, ``steps``,
        ``seed``, ``return_mean``, ``return_std``, ``normalized_score``,
        ``normalized_score_std``, ``eval_episodes``, ``ms_per_action`` (the policy's time per
        action in the last evaluation: a planner's planning cost), ``eval_s`` (all
        evaluations), ``wall_s``, ``train_s`` (the fit, evaluations included),
        ``steps_per_s``, ``world_size``, ``peak_memory_mb`` (host resident set, CUDA allocated),
        ``tokens_trained``, ``tokens_per_s`` and ``tokens_per_s_all_ranks`` (language-model
        batches: :class:`~offline_plugins.lightning.callbacks.TokenThroughput`), ``losses``, ``eval_history``, ``config``,
        ``checkpoint``, ``metrics_csv``, ``learning_curve``, ``out_dir``, ``dropped``. Preference
        algorithms report ``preference_accuracy``, ``likelihood_accuracy``,
        ``kl_to_reference``, ``exact_match_before`` and ``exact_match_after`` (held out;
        see :mod:`offline_plugins.eval.preference`) instead of returns, and save the
        trained policy with ``save_pretrained`` in ``OUT/model``.
    """
    started = time.perf_counter()
    if overwrite and resume not in (None, False, ""):
        raise RunError("--overwrite and --resume contradict each other: --resume continues the run in --out, "
                       "--overwrite replaces it; pass one")
    resumed = ResumedRun.find(resume, out_dir)
    options, resume_record = _resolve_run_options(
        dict(steps=steps, seed=seed, eval_every=eval_every, eval_episodes=eval_episodes,
             checkpoint_every=checkpoint_every, log_every=log_every, precision=precision, accumulate=accumulate,
             steps_per_call=steps_per_call, logger=logger), resumed)
    steps, seed, eval_every, eval_episodes = options["steps"], options["seed"], options["eval_every"], options["eval_episodes"]
    checkpoint_every, log_every, precision = options["checkpoint_every"], options["log_every"], options["precision"]
    accumulate, steps_per_call, logger = options["accumulate"], options["steps_per_call"], options["logger"]
    if steps < 1:
        raise RunError(f"--steps must be at least 1, got {steps}")
    from offline_plugins.lightning.module import resolve_steps_per_call

    steps_per_call = resolve_steps_per_call(steps_per_call, callbacks)
    if eval_episodes < 1:
        raise RunError(f"--eval-episodes must be at least 1, got {eval_episodes}")
    if eval_every is not None and eval_every < 0:
        raise RunError(f"--eval-every must be 0 (only at the end) or positive, got {eval_every}")
    check_devices(devices, accelerator, num_nodes)
    from offline_plugins.lightning.loggers import logger_names

    loggers = logger_names(logger)
    precision = check_precision(precision, accelerator)
    strategy = check_strategy(strategy, accelerator)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise RunError(f"--accumulate must be a whole number >= 1, got {accumulate!r}")
    if out_dir is not None:
        check_out_dir(out_dir)
    with restored_process_state():
        import torch

        if threads is not None:
            torch.set_num_threads(int(threads))
            # Lightning's DDP launchers reset each rank's threads unless OMP_NUM_THREADS is set
            os.environ["OMP_NUM_THREADS"] = str(int(threads))
        if plan is None:
            data_args = dict(config=config, overrides=overrides, model=model, reward=reward,
                             drop_nonfinite=drop_nonfinite, drop_empty=drop_empty)
            if resumed is not None:
                data_args = resumed.plan_kwargs(**data_args)
            plan = plan_run(algorithm, dataset, registry=registry, progress=progress, **data_args)
        if accumulate > 1 and plan.sampler == "slice" and (plan.batch_size // plan.slice_len) % accumulate:
            windows = plan.batch_size // plan.slice_len
            raise RunError(f"--accumulate {accumulate} must divide the {windows} windows of {plan.slice_len} steps in "
                           f"a batch of {plan.batch_size} (micro-batches hold whole windows); pick a divisor of "
                           f"{windows}, or --set batch_size to a multiple of {accumulate * plan.slice_len}")
        if plan.kind is None:  # a RunPlan made by hand
            from offline_plugins.plugins.datakind import DataOptions
            from offline_plugins.plugins import shared_registry

            plan.kind = (registry or shared_registry()).kind_of(plan.spec)
            plan.options = plan.options or DataOptions(model=model)
        launched = _is_launched_rank()
        if out_dir is not None:
            out = Path(out_dir)
        elif launched and os.environ.get("OFFLINE_PLUGINS_RUN_DIR"):
            out = Path(os.environ["OFFLINE_PLUGINS_RUN_DIR"])  # the folder rank 0 chose
        else:
            out = _default_out_dir(plan.spec.name, plan.dataset_id, seed)
        if resumed is not None:  # read and checked once, above
            ckpt_path, ckpt = resumed.path, resumed.checkpoint
        else:
            ckpt_path, ckpt = _resume_path(resume, out), None
            if ckpt_path is not None:
                ckpt = read_checkpoint(ckpt_path)
                check_checkpoint(ckpt, ckpt_path, for_resume=True)
        default = (plan.spec.name, plan.dataset_id, seed) if out_dir is None and ckpt_path is None else None
        lock = None if launched else _lock_run_folder(out, default=default)
        try:
            out = lock.folder if lock is not None else out
            # DDP's launcher re-runs this command for the other ranks: they must use the same folder
            os.environ["OFFLINE_PLUGINS_RUN_DIR"] = str(out)
            if ckpt_path is None and not launched:
                _check_fresh(out, overwrite=overwrite)
            with quiet_lightning(verbose):
                return _fit(plan, out, ckpt_path, ckpt, steps=steps, seed=seed, eval_every=eval_every,
                            eval_episodes=eval_episodes, devices=devices, accelerator=accelerator, num_nodes=num_nodes,
                            strategy=strategy, checkpoint_every=checkpoint_every, log_every=log_every,
                            progress=progress, compile=compile, callbacks=callbacks, started=started,
                            steps_per_call=steps_per_call, precision=precision, accumulate=accumulate,
                            resume_record=resume_record, loggers=loggers)
        except BaseException as exc:
            if lock is not None:
                # a run refused before it wrote anything leaves no folder behind
                lock.release(remove_if_unused=isinstance(exc, UserError) and not isinstance(exc, RunInterrupted))
            raise
        finally:
            if lock is not None:
                lock.release()


def _lock_run_folder(out: Path, *, default: Optional[tuple]) -> RunFolderLock:
    """Lock ``out``; when ``out`` is the default folder (``default``: its algorithm, dataset, seed)
    and another run holds it, take the next free number instead."""
    for _ in range(100):
        try:
            return RunFolderLock(out).acquire()
        except RunError:
            if default is None:
                raise
            out = _default_out_dir(*default)  # the held folder is not empty (its lock file), so it is skipped
    return RunFolderLock(out).acquire()


def _fit(plan: RunPlan, out: Path, ckpt_path: Optional[Path], ckpt: Optional[dict], *, steps: int, seed: int,
         eval_every: Optional[int], eval_episodes: int, devices, accelerator: str, num_nodes: int, strategy,
         checkpoint_every: Optional[int], log_every: int, progress: bool, compile: bool, callbacks,
         started: float, steps_per_call: int = 1, precision: str = "32-true",
         accumulate: int = 1, resume_record: Optional[dict] = None,
         loggers: Sequence[str] = ("csv",)) -> dict[str, Any]:
    """Build the module, the data module and the callbacks, fit, and write the run's files.

    What depends on the data (its evaluation, the summary's figures, the export) is asked
    of ``plan.kind``."""

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from offline_plugins.config import config_to_dict
    from offline_plugins.lightning.builder import build
    from offline_plugins.lightning.callbacks import (
        FinalCheckpoint,
        InterruptCheckpoint,
        StepProgressBar,
        TokenThroughput,
    )
    from offline_plugins.lightning.loggers import close_loggers, make_loggers

    seed_everything(seed, workers=False, verbose=False)
    if eval_every is None:
        eval_every = max(1, steps // 5)
    # the module, data module and the callbacks the algorithm needs: what build() hands a user's Trainer
    built = build(plan.spec, plan.data, plan=plan, seed=seed, eval_every=eval_every, eval_episodes=eval_episodes,
                  steps_per_call=steps_per_call, accumulate=accumulate, compile=compile,
                  # what a bare --resume continues with (ResumedRun)
                  run={"steps": steps, "checkpoint_every": checkpoint_every, "log_every": log_every,
                       "precision": precision, "logger": [n for n in loggers if n != "csv"] or None})
    module, datamodule, evaluation, parts = built.module, built.datamodule, built.evaluation, built.module.parts
    if ckpt is not None:
        check_resume(ckpt, ckpt_path, algorithm=plan.spec.name, dataset=plan.dataset_id,
                     config=config_to_dict(plan.config), module=module)
    every_ckpt = checkpoint_every or eval_every or steps
    last_ckpt = out / "checkpoints" / "last.ckpt"
    checkpoint = ModelCheckpoint(
        dirpath=out / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=every_ckpt, enable_version_counter=False
    )
    interrupt = GracefulInterrupt()
    out.mkdir(parents=True, exist_ok=True)
    earlier_metrics = None
    start_step = int(ckpt.get("global_step", 0)) if ckpt is not None else 0
    if ckpt_path is not None and (out / "metrics.csv").is_file() and not _is_launched_rank():
        # CSVLogger deletes an existing metrics.csv; keep the earlier rows and merge them back
        earlier_metrics = out / "metrics.before-resume.csv"
        (out / "metrics.csv").replace(earlier_metrics)
    tokens = TokenThroughput()
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=_strategy(devices, num_nodes, parts, strategy),
        precision=precision,
        max_steps=steps,
        max_epochs=-1,
        # CSV always (metrics.csv, the learning curve), then those --logger names
        logger=make_loggers(loggers, out, run_name=out.name),
        callbacks=[
            *([StepProgressBar(refresh_rate=max(1, min(50, steps // 100)))] if progress else []),
            *built.callbacks,
            tokens,
            FinalCheckpoint(last_ckpt),
            InterruptCheckpoint(last_ckpt),
            checkpoint,
            *callbacks,
        ],
        log_every_n_steps=log_every,
        enable_progress_bar=progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=str(out),
    )
    fit_started = time.perf_counter()
    interrupted = None
    with warnings.catch_warnings(), interrupt.installed(trainer):
        # saving the post-step state is what resuming needs; the LeafSpec note is Lightning's own
        warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        # CSVLogger appends to an existing metrics.csv, whatever this warning says
        warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
        # a resumed run rebuilds its ModelCheckpoint; a new --steps changes its default period,
        # which Lightning reports as a missing callback
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
        # TorchRL's stacked critic weights [n, 1, w] get gradients whose size-1 dimension has
        # another stride; both are contiguous, so DDP's copy into its bucket costs the same
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        try:
            # the checkpoint was read with weights_only=True above; Lightning reads it the same way
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None,
                        weights_only=True)
        except SIGTERMException:
            interrupt.note_sigterm()
            interrupted = interrupt.signal
        except SystemExit:
            # Lightning exits 1 after a KeyboardInterrupt it caught (a second Ctrl-C)
            if interrupt.signal is None:
                raise
            interrupted = f"{interrupt.signal} twice"
    train_s = time.perf_counter() - fit_started
    if not trainer.is_global_zero:
        if interrupted:
            raise RunInterrupted(f"rank {trainer.global_rank} interrupted by {interrupted}")
        return {}
    if earlier_metrics is not None:
        _merge_metrics(earlier_metrics, out / "metrics.csv", before_step=start_step)
    summary = {
        "algorithm": plan.spec.name,
        "dataset": plan.dataset_id,
        "data_kind": plan.kind.name,
        "steps": int(trainer.global_step),
        "seed": seed,
        **plan.kind.summary_fields(evaluation, plan.data, eval_episodes=eval_episodes),
        "eval_s": round(sum(r.get("eval_s", 0.0) for r in evaluation.history), 3),
        "wall_s": round(time.perf_counter() - started, 3),
        "train_s": round(train_s, 3),
        "steps_per_s": round((trainer.global_step - start_step) / max(train_s, 1e-9), 2),
        **tokens.run_summary(train_s, trainer.world_size),
        "world_size": trainer.world_size,
        "precision": precision,
        "peak_memory_mb": peak_memory_mb(trainer.strategy.root_device),
        "steps_per_call": steps_per_call,
        "resumed_from": str(ckpt_path) if ckpt_path else None,
        **({"resume": _resume_summary(resume_record, ckpt, plan)} if ckpt is not None else {}),
        "losses": dict(module.last_logged),
        "eval_history": evaluation.history,
        "config": config_to_dict(plan.config),
        "checkpoint": str(last_ckpt),
        "metrics_csv": str(out / "metrics.csv"),
        "loggers": close_loggers(trainer.loggers),
        "learning_curve": str(out / "learning_curve.png"),
        "out_dir": str(out),
    }
    if interrupted:
        summary["interrupted"] = True
        summary["interrupted_by"] = interrupted
        summary["steps_requested"] = steps
        if interrupted.endswith("twice"):  # stopped mid-step: the last checkpoint is the periodic one
            summary["checkpoint"] = str(last_ckpt) if last_ckpt.is_file() else None
    else:
        summary.update(plan.kind.export(parts, out))
    plot_learning_curve(out / "metrics.csv", out / "learning_curve.png", title=f"{plan.spec.name} on {plan.dataset_id}",
                        panels=plan.kind.curve_panels())
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if interrupted:
        raise RunInterrupted(_interrupted_message(summary, plan, out))
    return summary


def _resume_summary(record: Optional[dict], ckpt: dict, plan: RunPlan) -> dict:
    """Which run options and config fields a resumed run kept from its checkpoint, and which the
    caller overrode (``{"checkpoint": old, "now": new}``)."""
    from offline_plugins.config import config_to_dict

    record = dict(record or {"from": None, "kept": {}, "overridden": {}})
    record["overridden"] = dict(record["overridden"])
    saved, now = ckpt["offline_plugins"].get("config") or {}, config_to_dict(plan.config)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            record["overridden"][f"config.{key}"] = {"checkpoint": saved.get(key), "now": now.get(key)}
    return record


def _interrupted_message(summary: dict, plan: RunPlan, out: Path) -> str:
    where = (f"saved {summary['checkpoint']} at step {summary['steps']}" if summary.get("checkpoint")
             else "no checkpoint was saved")
    again = f"offline-plugins train {plan.spec.name} --dataset {plan.dataset_id} --steps {summary['steps_requested']} " \
            f"--out {out} --resume"
    if not summary.get("checkpoint"):
        return (f"interrupted by {summary['interrupted_by']} at step {summary['steps']}; {where}; wrote a partial "
                f"{out / 'summary.json'}; start again without --resume")
    return (f"interrupted by {summary['interrupted_by']} at step {summary['steps']} of {summary['steps_requested']}; "
            f"{where} and a partial {out / 'summary.json'}; continue with: {again} (and the same --config/--set)")


def _merge_metrics(earlier: Path, current: Path, *, before_step: int) -> None:
    """Prepend the rows of ``earlier`` logged before ``before_step`` to ``current``."""
    import csv

    def read(path: Path) -> tuple[list[str], list[dict]]:
        if not path.is_file():
            return [], []
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            return list(reader.fieldnames or []), list(reader)

    old_keys, old_rows = read(earlier)
    new_keys, new_rows = read(current)
    # evaluation rows carry the 0-based index of the last step, training rows (logged after the
    # optimiser step) the 1-based count; rows after the checkpoint's step were redone
    def kept(row: dict) -> bool:
        if not row.get("step"):
            return False
        trained = any(k.startswith("train/") and row.get(k) not in ("", None) for k in row)
        return int(float(row["step"])) < before_step + (1 if trained else 0)

    old_rows = [r for r in old_rows if kept(r)]
    keys = sorted(set(old_keys) | set(new_keys))
    with current.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(old_rows + new_rows)
    earlier.unlink()


def _resume_path(resume, out: Path) -> Optional[Path]:
    if resume in (None, False, ""):
        return None
    path = out / "checkpoints" / "last.ckpt" if resume is True else Path(resume)
    if not path.is_file():
        raise RunError(f"cannot resume: checkpoint {str(path)!r} does not exist; train without --resume first")
    return path


#: what a run writes in its folder: what ``overwrite=True`` removes, and nothing else
_RUN_FILES = ("summary.json", "metrics.csv", "metrics.before-resume.csv", "learning_curve.png", "checkpoints", "model")


def _check_fresh(out: Path, *, overwrite: bool = False) -> None:
    taken = [p.name for p in (out / "summary.json", out / "metrics.csv", out / "checkpoints") if p.exists()]
    if taken and overwrite:
        import logging
        import shutil

        for name in _RUN_FILES:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        logging.getLogger(__name__).warning("--overwrite: removed the earlier run's %s from %s",
                                            ", ".join(taken), out)
        return
    if taken:
        raise RunError(
            f"output folder {str(out)!r} already holds a run ({', '.join(taken)}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )


def load_checkpoint(path: Union[str, os.PathLike], *, for_resume: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`train` (a Lightning checkpoint with our extras).

    Opened with ``torch.load(weights_only=True)``: a file carrying pickled code is refused
    (:class:`RunError`) and nothing in it runs. Its metadata is checked before use.
    """
    ckpt = read_checkpoint(path)
    check_checkpoint(ckpt, path, for_resume=for_resume)
    return ckpt


@dataclasses.dataclass
class TrainedRun:
    """A run rebuilt from its checkpoint: the trained module, its plan (data, config, kind), the checkpoint.

    Attributes:
        module: the :class:`~offline_plugins.lightning.module.AlgorithmModule` with the
            checkpoint's weights, on ``device``.
        plan: the :class:`RunPlan` the run's own config and dataset give.
        checkpoint: the checkpoint as read (``weights_only=True``).
        path: where it was read from.
    """

    module: Any
    plan: RunPlan
    checkpoint: dict
    path: Path

    @property
    def info(self) -> dict:
        return self.checkpoint["offline_plugins"]

    @property
    def step(self) -> int:
        return int(self.checkpoint.get("global_step", 0))


def load_trained_run(
    path: Union[str, os.PathLike],
    *,
    device: str = "cpu",
    registry=None,
    data=None,
    spec=None,
    progress: bool = False,
) -> TrainedRun:
    """Rebuild the run saved in the checkpoint ``path``: its algorithm, dataset and trained weights.

    The algorithm and dataset are reloaded by name (``data``/``spec`` override them), with
    the options its data kind saved (``--model``, dropped episodes); the data's
    normalisation statistics come from the checkpoint. Raises a ``RunError`` naming the
    file when its weights do not fit the networks its config builds.
    """
    from offline_plugins.lightning.module import AlgorithmModule
    from offline_plugins.plugins.registry import AlgorithmSpec

    ckpt = load_checkpoint(path)
    info = ckpt["offline_plugins"]
    run = info.get("run", {})
    seed = int(info.get("seed", 0))
    if registry is None:
        from offline_plugins.plugins import shared_registry

        registry = shared_registry()
    algo = spec if spec is not None else algorithm_of_checkpoint(info, registry, path)
    algo = algo if isinstance(algo, AlgorithmSpec) else registry.algorithm(algo)
    options = registry.kind_of(algo).reload_options(run) if data is None else None
    plan = plan_run(
        algo,
        data if data is not None else info["dataset"],
        overrides=info.get("config", {}),
        registry=registry,
        progress=progress,
        model=options.model if options is not None else None,
        drop_nonfinite=options.drop_nonfinite if options is not None else False,
        drop_empty=options.drop_empty if options is not None else False,
        reward=options.reward if options is not None else None,
    )
    if hasattr(plan.data, "load_state_dict") and info.get("data_state"):
        plan.data.load_state_dict(info["data_state"])
    module = AlgorithmModule(_build_parts(plan, seed), algorithm=plan.spec.name, dataset=plan.dataset_id, seed=seed)
    try:
        module.load_state_dict(ckpt["state_dict"])
    except RuntimeError as exc:  # hand-edited or another version's tensors
        first = str(exc).splitlines()[0][:200]
        raise RunError(f"checkpoint {str(path)!r} ({plan.spec.name} on {plan.dataset_id}) does not fit the networks "
                       f"its own config builds ({first}); the file was edited or written by another version") from None
    module.to(device)
    return TrainedRun(module, plan, ckpt, Path(path))


def evaluate_checkpoint(
    path: Union[str, os.PathLike],
    *,
    episodes: Optional[int] = None,
    seed: Optional[int] = None,
    device: str = "cpu",
    registry=None,
    data=None,
    spec=None,
) -> dict[str, Any]:
    """Rebuild the policy saved in a checkpoint (:func:`load_trained_run`) and evaluate it as
    its data kind evaluates a run (rollouts in the dataset's environment, held-out pairs...).

    Returns:
        ``algorithm``, ``dataset``, ``data_kind``, ``checkpoint``, ``step`` and the kind's
        figures: for environment data ``episodes``, ``return_mean``, ``return_std``,
        ``normalized_score``, ``normalized_score_std``, ``length_mean``, ``returns``.
    """
    trained = load_trained_run(path, device=device, registry=registry, data=data, spec=spec)
    info, plan = trained.info, trained.plan
    episodes = int(episodes if episodes is not None else info.get("run", {}).get("eval_episodes", 10))
    seed = int(seed if seed is not None else info.get("seed", 0))
    result = plan.kind.evaluate(trained.module, plan.data, episodes=episodes, seed=seed, device=device)
    return {
        "algorithm": plan.spec.name,
        "dataset": plan.dataset_id,
        "data_kind": plan.kind.name,
        "checkpoint": str(path),
        "step": trained.step,
        **result,
    }


def plot_learning_curve(metrics_csv: Union[str, os.PathLike], out_png: Union[str, os.PathLike], *, title: str = "",
                        panels: Optional[Sequence[Any]] = None) -> Path:
    """Plot ``metrics.csv`` against gradient steps, one panel per
    :class:`~offline_plugins.plugins.datakind.CurvePanel` (the data kind's ``curve_panels()``;
    default: the environment kinds' score above the losses)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from offline_plugins.plugins.datakind import LOSS_PANEL, CurvePanel

    if panels is None:
        panels = [CurvePanel("normalised score (else return)", ("eval/normalized_score", "eval/return_mean"),
                             first_only=True), LOSS_PANEL]
    columns: dict[str, list[tuple[int, float]]] = {}
    path = Path(metrics_csv)
    if path.is_file():
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                step = row.get("step")
                if not step:
                    continue
                for key, value in row.items():
                    if key == "step" or value in ("", None):
                        continue
                    try:
                        # the CSV's step is the 0-based index of the last step; plot step counts
                        columns.setdefault(key, []).append((int(float(step)) + 1, float(value)))
                    except ValueError:
                        continue
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3 * len(panels)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        keys = panel.select(columns)
        for key in keys:
            xs, ys = zip(*sorted(columns[key]))
            ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, label=key.split("/", 1)[-1].replace("_", " "))
        if keys:
            ax.legend(fontsize="small")
            if panel.log:
                ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("gradient step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
