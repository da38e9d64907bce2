"""A run: :class:`RunSettings` and :func:`train`, which trains a checked :class:`RunPlan`.

``train(plan, settings)`` trains what :func:`~offline_plugins.lightning.plan.plan_run`
resolved, checked and loaded (the algorithm, its config, the data), with the run options
of ``settings``; everything that can fail on a bad input is refused before the output
folder is created. It trains with Lightning's ``Trainer`` and writes ``summary.json``,
``metrics.csv``, ``learning_curve.png`` and ``checkpoints/last.ckpt``. The CLI's ``train``
command builds a plan and settings from its arguments and calls it;
:func:`train_algorithm` is the same from Python, by name:

.. code-block:: python

    from offline_plugins.lightning import train_algorithm

    summary = train_algorithm("iql", "pendulum/medium-replay-v0", steps=5000, out_dir="runs/iql")

Everything that depends on the kind of data is asked of the algorithm's data kind
(:mod:`offline_plugins.kinds`): how the dataset id is resolved and loaded, the batch
layout, the evaluation callback, what ``summary.json`` adds and how the policy is
exported. Checkpoints (reading, resuming, evaluating) live in
:mod:`offline_plugins.lightning.checkpoints`.

What a run guarantees (see docs/training.md): checkpoints are read with
``weights_only=True`` only; one run per output folder at a time; SIGINT/SIGTERM stop at
a step boundary with ``last.ckpt`` and a partial ``summary.json`` saved; a resume that
does not fit the checkpoint (or whose data file changed) is refused naming what differs; a
run's inputs (``--model``, ``--dataset``, ``--config``...) may not lie where it writes. Every
file a run rewrites is written beside its target and renamed over it, so a full disk stops
the run with one line and leaves the previous files intact (:mod:`offline_plugins.data.files`,
:mod:`offline_plugins.lightning.files`). The guards live in
:mod:`offline_plugins.lightning.guards`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from offline_plugins.config import config_to_dict
from offline_plugins.data.files import WriteError, atomic_write_text
from offline_plugins.errors import UserError
from offline_plugins.lightning.builder import build
from offline_plugins.lightning.callbacks import FinalCheckpoint, InterruptCheckpoint, StepProgressBar, TokenThroughput
from offline_plugins.lightning.checkpoint_files import check_resume, data_fingerprint
from offline_plugins.lightning.checkpoints import (
    ResumedRun,
    TrainedRun,
    evaluate_checkpoint,
    load_checkpoint,
    load_trained_run,
    resume_path,
    resume_summary,
    trim_metrics,
)
from offline_plugins.lightning.files import RESUME_FIX, RunCheckpointIO
from offline_plugins.lightning.fsdp import FSDP_PRECISIONS, full_copy
from offline_plugins.lightning.guards import (
    GracefulInterrupt,
    RunError,
    RunInterrupted,
    held_state_mb,
    peak_memory_mb,
    quiet_lightning,
    restored_process_state,
)
from offline_plugins.lightning.launch import _is_launched_rank, _scale_device, _stop_launched_ranks, _strategy
from offline_plugins.lightning.loggers import close_loggers, logger_names, make_loggers
from offline_plugins.lightning.module import resolve_steps_per_call
from offline_plugins.lightning.outputs import (
    _check_fresh,
    _check_inputs_outside,
    _default_out_dir,
    _finished_summary,
    _interrupted_message,
    _lock_run_folder,
    _run_inputs,
    check_run_inputs,
    plot_learning_curve,
)
from offline_plugins.lightning.plan import RunPlan, plan_run
from offline_plugins.lightning.settings import RUN_DEFAULTS, RunSettings, _resolve_run_options
from offline_plugins.plugins.datakind import BatchLayout

__all__ = [
    "RunSettings",
    "RUN_DEFAULTS",
    "train",
    "check_run_inputs",
    "train_algorithm",
    "plot_learning_curve",
    # planned in lightning.plan, checkpoints in lightning.checkpoints; importable here as before
    "RunPlan",
    "plan_run",
    "ResumedRun",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_trained_run",
    "TrainedRun",
    "RunError",
    "RunInterrupted",
    "WriteError",
]


@contextlib.contextmanager
def _process_state(settings: RunSettings) -> Iterator[None]:
    """Set the run's torch threads; give the caller back its threads, environment and RNG states after."""
    with restored_process_state():
        if settings.threads is not None:
            torch.set_num_threads(int(settings.threads))
            # Lightning's DDP launchers reset each rank's threads unless OMP_NUM_THREADS is set
            os.environ["OMP_NUM_THREADS"] = str(int(settings.threads))
        yield


def train_algorithm(
    algorithm,
    dataset,
    *,
    config: Union[None, str, os.PathLike, Mapping] = None,
    overrides: Union[None, Sequence[str], Mapping[str, Any]] = None,
    model: Optional[str] = None,
    reward: Optional[str] = None,
    drop_nonfinite: bool = False,
    drop_empty: bool = False,
    registry=None,
    **settings: Any,
) -> dict[str, Any]:
    """Train ``algorithm`` on ``dataset`` by name: ``train(plan_run(algorithm, dataset, ...), RunSettings(**settings))``.

    The run options (``settings``) are checked first, then the plan is made (with the
    resumed run's config and data options when ``resume`` is given), with ``threads`` set
    while the data loads as while it trains; what the CLI's ``train`` does.

    >>> train_algorithm("iql", "pendulum/medium-replay-v0", steps=0)
    Traceback (most recent call last):
    ...
    offline_plugins.lightning.guards.RunError: --steps must be at least 1, got 0

    Args:
        algorithm: an algorithm name (``offline-plugins list``) or an ``AlgorithmSpec``.
        dataset: a dataset id (made on the fly from its recipe if missing) or a loaded
            dataset object (``OfflineData``, ``PreferenceData``...).

    Keyword Args:
        config, overrides, model, reward, drop_nonfinite, drop_empty, registry: as
            :func:`~offline_plugins.lightning.plan.plan_run`.
        settings: :class:`RunSettings`' fields (``steps``, ``seed``, ``out_dir``, ``resume``...).

    Returns:
        The summary :func:`train` writes to ``summary.json``.
    """
    run_settings = RunSettings(**settings)
    check_run_inputs(run_settings, {"--config": config, "--model": model, "--reward": reward, "--dataset": dataset})
    with _process_state(run_settings):
        plan = plan_run(algorithm, dataset, config=config, overrides=overrides, registry=registry,
                        progress=run_settings.progress, model=model, reward=reward, drop_nonfinite=drop_nonfinite,
                        drop_empty=drop_empty, resumed=run_settings.resumed_run())
        inputs = {"--config": config} if isinstance(config, (str, os.PathLike)) else None
        return train(plan, run_settings, inputs=inputs)


def train(plan: RunPlan, settings: Optional[RunSettings] = None, *,
          inputs: Optional[Mapping[str, Union[None, str, os.PathLike]]] = None) -> dict[str, Any]:
    """Train ``plan`` (:func:`~offline_plugins.lightning.plan.plan_run`) as ``settings`` say, evaluate it,
    and write the run to ``settings.out_dir``.

    ``plan_run`` made every check of the algorithm, the dataset and the config, and
    ``RunSettings`` those of the run options; here the two are fitted together (a
    gradient-accumulation split must fit the batch; a resume must fit the checkpoint) and
    the output folder is locked and checked to be free before anything is written. A run
    resuming ``settings.resume`` is planned from it: ``plan_run(...,
    resumed=settings.resumed_run())`` (what :func:`train_algorithm` and the CLI do).

    Args:
        plan: the checked :class:`~offline_plugins.lightning.plan.RunPlan`.
        settings: the run's :class:`RunSettings` (default: ``RunSettings()``).

    Keyword Args:
        inputs: files the run read that the plan does not record, by flag (``{"--config": path}``);
            like the plan's model, reward folder and dataset file they may not lie inside what the
            run writes or ``--overwrite`` removes (:data:`_RUN_FILES`).

    Raises:
        WriteError: a file could not be written (disk full, quota, file size limit); the previous
            files are intact and the message says how to go on (:mod:`offline_plugins.data.files`).
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
        ``checkpoint``, ``metrics_csv``, ``learning_curve``, ``out_dir``, ``dropped``; a resumed
        run's ``resume`` (which options and config fields it kept and which it overrode).
        Preference algorithms report ``preference_accuracy``, ``likelihood_accuracy``,
        ``kl_to_reference``, ``exact_match_before`` and ``exact_match_after`` (held out;
        see :mod:`offline_plugins.eval.preference`) instead of returns, and save the
        trained policy with ``save_pretrained`` in ``OUT/model``. A DDP rank other than 0
        returns ``{}``.
    """
    if not isinstance(plan, RunPlan):
        raise TypeError(f"train(plan, settings) takes a RunPlan (from plan_run), got {type(plan).__name__}; "
                        "train_algorithm(algorithm, dataset, **settings) trains an algorithm on a dataset by name")
    settings = RunSettings() if settings is None else settings
    started = time.perf_counter()

    resumed = settings.resumed_run()
    options, resume_record = _resolve_run_options(settings, resumed)
    steps, seed, accumulate = options["steps"], options["seed"], options["accumulate"]
    online_steps = int(options["online_steps"] or 0)
    if online_steps:  # the data's kind says whether the run can act online after its offline steps
        plan.kind.check_online(plan.spec, plan.config, plan.data, online_steps=online_steps)
    steps_per_call = resolve_steps_per_call(options["steps_per_call"], settings.callbacks)
    loggers = logger_names(options["logger"])
    if accumulate > 1 and plan.sampler == "slice" and (plan.batch_size // plan.slice_len) % accumulate:
        windows = plan.batch_size // plan.slice_len
        raise RunError(f"--accumulate {accumulate} must divide the {windows} windows of {plan.slice_len} steps in "
                       f"a batch of {plan.batch_size} (micro-batches hold whole windows); pick a divisor of "
                       f"{windows}, or --set batch_size to a multiple of {accumulate * plan.slice_len}")
    # a batch, round or budget that cannot fit is refused here, before a byte of it is allocated
    plan.kind.check_scale(plan.config, plan.data, BatchLayout(plan.batch_size, plan.sampler, plan.slice_len),
                          accumulate=accumulate, device=_scale_device(settings.accelerator))
    with _process_state(settings):
        launched = _is_launched_rank()
        if settings.out_dir is not None:
            out = Path(settings.out_dir)
        elif launched and os.environ.get("OFFLINE_PLUGINS_RUN_DIR"):
            out = Path(os.environ["OFFLINE_PLUGINS_RUN_DIR"])  # the folder rank 0 chose
        else:
            out = _default_out_dir(plan.spec.name, plan.dataset_id, seed)
        if resumed is not None:  # read and checked once, by settings.resumed_run()
            ckpt_path, ckpt = resumed.path, resumed.checkpoint
        else:  # resume=True into the default folder, chosen just now
            ckpt_path = resume_path(settings.resume, out)
            ckpt = load_checkpoint(ckpt_path, for_resume=True) if ckpt_path is not None else None
        default = (plan.spec.name, plan.dataset_id, seed) if settings.out_dir is None and ckpt_path is None else None
        lock = None if launched else _lock_run_folder(out, default=default)
        try:
            out = lock.folder if lock is not None else out
            # DDP's launcher re-runs this command for the other ranks: they must use the same folder
            os.environ["OFFLINE_PLUGINS_RUN_DIR"] = str(out)
            if not launched:
                _check_inputs_outside(out, _run_inputs(plan, inputs), overwrite=settings.overwrite)
            if ckpt_path is None and not launched:
                _check_fresh(out, overwrite=settings.overwrite)
            if ckpt is not None and not launched:
                finished = _finished_summary(out, ckpt, steps + online_steps)
                if finished is not None:  # nothing to train: the finished run's files are kept as they are
                    return finished
            with quiet_lightning(settings.verbose):
                return _fit(plan, settings, out, ckpt_path, ckpt, steps=steps, seed=seed,
                            eval_every=options["eval_every"], eval_episodes=options["eval_episodes"],
                            checkpoint_every=options["checkpoint_every"], log_every=options["log_every"],
                            started=started, steps_per_call=steps_per_call, precision=options["precision"],
                            accumulate=accumulate, resume_record=resume_record, loggers=loggers,
                            online_steps=online_steps)
        except BaseException as exc:
            if lock is not None:
                # a run refused before it wrote anything leaves no folder behind
                lock.release(remove_if_unused=isinstance(exc, UserError) and not isinstance(exc, RunInterrupted))
            raise
        finally:
            if lock is not None:
                lock.release()


def _fit(plan: RunPlan, settings: RunSettings, out: Path, ckpt_path: Optional[Path], ckpt: Optional[dict], *,
         steps: int, seed: int, eval_every: Optional[int], eval_episodes: int, checkpoint_every: Optional[int],
         log_every: int, started: float, steps_per_call: int = 1, precision: str = "32-true", accumulate: int = 1,
         resume_record: Optional[dict] = None, loggers: Sequence[str] = ("csv",),
         online_steps: int = 0) -> dict[str, Any]:
    """Build the module, the data module and the callbacks, fit, and write the run's files.

    ``steps`` on the dataset, then ``online_steps`` more while acting (offline-to-online fine-tuning).

    What depends on the data (its evaluation, the summary's figures, the export) is asked
    of ``plan.kind``."""

    seed_everything(seed, workers=False, verbose=False)
    total = steps + online_steps
    if eval_every is None:
        eval_every = max(1, total // 5)
    # what --resume checks the data against (a file or folder dataset; None for a built-in id)
    fingerprint = data_fingerprint(plan.dataset_id) if not _is_launched_rank() else None
    # the module, data module and the callbacks the algorithm needs: what build() hands a user's Trainer
    built = build(plan.spec, plan.data, plan=plan, seed=seed, eval_every=eval_every, eval_episodes=eval_episodes,
                  steps_per_call=steps_per_call, accumulate=accumulate, compile=settings.compile,
                  online_steps=online_steps, offline_steps=steps,
                  # what a bare --resume continues with (ResumedRun)
                  run={"steps": steps, "online_steps": online_steps, "checkpoint_every": checkpoint_every,
                       "log_every": log_every,
                       "precision": precision, "logger": [n for n in loggers if n != "csv"] or None,
                       **({"data_fingerprint": fingerprint} if fingerprint is not None else {})})
    module, datamodule, evaluation, parts = built.module, built.datamodule, built.evaluation, built.module.parts
    if ckpt is not None:
        check_resume(ckpt, ckpt_path, algorithm=plan.spec.name, dataset=plan.dataset_id,
                     config=config_to_dict(plan.config), module=module,
                     data_fingerprint=fingerprint, check_data=not _is_launched_rank())
    every_ckpt = checkpoint_every or eval_every or total
    last_ckpt = out / "checkpoints" / "last.ckpt"
    # --keep-checkpoints: also checkpoints/step=N.ckpt at every period, for model selection (eval --ope fqe)
    checkpoint = ModelCheckpoint(
        dirpath=out / "checkpoints", save_last=True, save_top_k=-1 if settings.keep_checkpoints else 0,
        filename="{step}", every_n_train_steps=every_ckpt, enable_version_counter=False
    )
    interrupt = GracefulInterrupt()
    out.mkdir(parents=True, exist_ok=True)
    start_step = int(ckpt.get("global_step", 0)) if ckpt is not None else 0
    if ckpt_path is not None and not _is_launched_rank():
        # the rows logged up to the checkpoint stay; this run appends its own (RunCSVLogger continues the file)
        trim_metrics(out / "metrics.csv", before_step=start_step, earlier=out / "metrics.before-resume.csv")
    tokens = TokenThroughput()
    devices, num_nodes, progress = settings.devices, settings.num_nodes, settings.progress
    strategy = _strategy(devices, num_nodes, parts, settings.strategy)
    sharded = settings.strategy == "fsdp"
    trainer_precision = precision
    if sharded:
        if precision not in FSDP_PRECISIONS:
            raise RunError(f"--strategy fsdp takes --precision {', '.join(FSDP_PRECISIONS)}, not {precision!r} "
                           "(FSDP2 computes bf16-mixed from float32 parameters by its MixedPrecisionPolicy)")
        # bf16-mixed is FSDP2's MixedPrecisionPolicy (module.configure_model), not Lightning's autocast
        module.fsdp_precision = precision
        trainer_precision = "32-true" if precision == "bf16-mixed" else precision
    trainer = Trainer(
        accelerator=settings.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=trainer_precision,
        # checkpoints written beside last.ckpt and renamed over it: a full disk leaves the previous one
        # (a strategy object that brings its own CheckpointIO keeps it: Lightning refuses two)
        plugins=[] if getattr(strategy, "_checkpoint_io", None) is not None else [RunCheckpointIO()],
        max_steps=total,
        max_epochs=-1,
        # CSV always (metrics.csv, the learning curve), then those --logger names
        logger=make_loggers(loggers, out, run_name=out.name,
                            resume_step=start_step if ckpt_path is not None else None),
        callbacks=[
            *([StepProgressBar(refresh_rate=max(1, min(50, total // 100)))] if progress else []),
            *built.callbacks,
            tokens,
            FinalCheckpoint(last_ckpt),
            InterruptCheckpoint(last_ckpt),
            checkpoint,
            *settings.callbacks,
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
                _stop_launched_ranks(trainer)
                raise
            interrupted = f"{interrupt.signal} twice"
        except BaseException:
            _stop_launched_ranks(trainer)
            raise
    train_s = time.perf_counter() - fit_started
    exported = parts
    if sharded and not interrupted:
        # every rank takes part in gathering the sharded weights; rank 0 exports a plain copy

        plain = full_copy(module)
        if plain is not None:
            exported = dataclasses.replace(parts, model=plain)
    if not trainer.is_global_zero:
        if interrupted:
            raise RunInterrupted(f"rank {trainer.global_rank} interrupted by {interrupted}")
        return {}
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
        # what rank 0 holds of the model and Adam's state (its shard under --strategy fsdp)
        "held_state_mb": held_state_mb(module, trainer.optimizers),
        "steps_per_call": steps_per_call,
        "resumed_from": str(ckpt_path) if ckpt_path else None,
        **({"offline_steps": steps, "online_steps": online_steps, "online_history": datamodule.history}
           if online_steps else {}),
        **({"resume": resume_summary(resume_record, ckpt, plan)} if ckpt is not None else {}),
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
        summary["steps_requested"] = total
        if interrupted.endswith("twice"):  # stopped mid-step: the last checkpoint is the periodic one
            summary["checkpoint"] = str(last_ckpt) if last_ckpt.exists() else None
    else:
        summary.update(plan.kind.export(exported, out))
    try:
        plot_learning_curve(out / "metrics.csv", out / "learning_curve.png",
                            title=f"{plan.spec.name} on {plan.dataset_id}", panels=plan.kind.curve_panels(),
                            marks={"online phase": steps} if online_steps else None)
    except WriteError as exc:  # the picture is not worth the run: say so, and keep the summary
        warnings.warn(f"{exc}; the summary is written without it", RuntimeWarning, stacklevel=2)
        summary["learning_curve"] = None
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n", fix=RESUME_FIX)
    if interrupted:
        raise RunInterrupted(_interrupted_message(summary, plan, out))
    return summary
