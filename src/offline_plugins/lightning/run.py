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

from offline_plugins.config import RUN_DEFAULTS as _NEW_RUN
from offline_plugins.data.files import WriteError, atomic_path, atomic_write_text
from offline_plugins.errors import UserError
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
from offline_plugins.lightning.guards import (
    GracefulInterrupt,
    RunError,
    RunFolderLock,
    RunInterrupted,
    check_devices,
    check_out_dir,
    check_precision,
    check_resume,
    check_strategy,
    data_fingerprint,
    held_state_mb,
    peak_memory_mb,
    quiet_lightning,
    restored_process_state,
)
from offline_plugins.lightning.plan import RunPlan, plan_run
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


def _resumable(default: Any) -> Any:
    """A run option a resumed run takes from its checkpoint when it is left at None; ``default``
    is a new run's value (:data:`RUN_DEFAULTS`)."""
    return dataclasses.field(default=None, metadata={"new_run": default})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How a plan is trained: the run's options, checked when they are made (before any data loads).

    The first eleven (``steps`` to ``online_steps``) default to None: a new run takes
    :data:`RUN_DEFAULTS`, a resumed run the value its checkpoint recorded, and a value given
    overrides the checkpoint's (the summary's ``resume`` records which were kept and which
    overridden).

    Attributes:
        steps: gradient steps in total (new run: 10,000; a resumed run trains up to this many).
        seed: seeds network initialisation, batches, loss noise and evaluation resets (new run: 0).
        eval_every: evaluate every this many steps (new run: ``steps // 5``; 0: only at the end).
        eval_episodes: episodes per evaluation (new run: 10).
        checkpoint_every: save ``last.ckpt`` every this many steps (new run: at each evaluation).
        log_every: log training metrics every this many steps (new run: 50).
        precision: Lightning's precision: ``32-true`` (new run), ``bf16-mixed``, ``bf16-true``,
            ``64-true``, and on CUDA ``16-mixed``/``16-true`` (or ``32``, ``64``, ``bf16``, ``16``).
            Cached reference log-probs stay as computed at load (fp32) whatever it is.
        accumulate: split each step's batch into this many micro-batches, one backward each,
            one optimiser step (gradient accumulation: the memory of a micro-batch, the
            gradient of the batch). ``batch_size`` stays the elements per optimiser step (new run: 1).
        steps_per_call: gradient steps per Lightning ``training_step`` (the same run bit for bit,
            with Lightning's cost per call spread over them; new run: ``DEFAULT_STEPS_PER_CALL`` of
            :mod:`offline_plugins.lightning.module`, or 1 when one of ``callbacks`` hooks every batch).
        logger: loggers beside the CSV one, which always writes ``metrics.csv``: ``"tensorboard"``,
            ``"mlflow"``, ``"wandb"``, or several (a list or ``"a,b"``); see
            :mod:`offline_plugins.lightning.loggers`. A missing package is refused here.
        online_steps: offline-to-online fine-tuning: after the ``steps`` on the dataset, this many
            more while acting in the dataset's environment (new run: 0, offline only; the algorithms
            whose config has the ``online_*`` fields; :mod:`offline_plugins.lightning.finetune`).
        out_dir: output folder (default ``runs/<algorithm>-<dataset>-s<seed>``); it must not
            hold another run unless resuming.
        resume: ``True`` for ``out_dir/checkpoints/last.ckpt``, a checkpoint path, or a
            :class:`~offline_plugins.lightning.checkpoints.ResumedRun` already read. A resumed
            run finishes the run it resumes; plan it with ``plan_run(..., resumed=settings.resumed_run())``
            so that its config, model, reward function and drop flags are the checkpoint's too.
        overwrite: replace the earlier run in ``out_dir`` (its summary, metrics, plot,
            checkpoints and exported model; nothing else in the folder is touched) instead
            of refusing it. Not with ``resume``.
        keep_checkpoints: also keep ``checkpoints/step=N.ckpt`` each time ``last.ckpt`` is saved
            (every ``checkpoint_every`` steps), to pick among them later (``eval --ope fqe``).
        devices, accelerator, num_nodes, strategy: as Lightning's ``Trainer``; more
            than one device trains with DDP. ``strategy`` may be a Lightning strategy object or
            a name (``ddp``, ``ddp_spawn``, ``deepspeed``, ``fsdp``: shards a transformers
            policy layer by layer; CUDA only).
        progress: show the progress bar.
        threads: CPU threads per process for torch (None: torch's default). Small
            networks on a busy machine train several times faster with 1.
        compile: run the loss through ``torch.compile`` (opt-in: the first steps wait for
            the compilation, about a minute on a CPU; see docs/benchmarks.md for the gain).
        callbacks: extra Lightning callbacks.
        verbose: show Lightning's own info lines (accelerator banner and the like).

    >>> RunSettings(steps=0)
    Traceback (most recent call last):
    ...
    offline_plugins.lightning.guards.RunError: --steps must be at least 1, got 0
    >>> RunSettings(precision="bf16").precision
    'bf16-mixed'
    """

    steps: Optional[int] = _resumable(_NEW_RUN['steps'])
    seed: Optional[int] = _resumable(_NEW_RUN['seed'])
    eval_every: Optional[int] = _resumable(_NEW_RUN['eval_every'])
    eval_episodes: Optional[int] = _resumable(_NEW_RUN['eval_episodes'])
    checkpoint_every: Optional[int] = _resumable(_NEW_RUN['checkpoint_every'])
    log_every: Optional[int] = _resumable(_NEW_RUN['log_every'])
    precision: Optional[str] = _resumable(_NEW_RUN['precision'])
    accumulate: Optional[int] = _resumable(_NEW_RUN['accumulate'])
    steps_per_call: Optional[int] = _resumable(_NEW_RUN['steps_per_call'])
    logger: Union[None, str, Sequence[str]] = _resumable(_NEW_RUN['logger'])
    online_steps: Optional[int] = _resumable(_NEW_RUN['online_steps'])
    out_dir: Union[None, str, os.PathLike] = None
    resume: Union[None, bool, str, os.PathLike, ResumedRun] = None
    overwrite: bool = False
    keep_checkpoints: bool = False
    devices: Union[int, str, Sequence[int]] = 1
    accelerator: str = "auto"
    num_nodes: int = 1
    strategy: Any = None
    progress: bool = True
    threads: Optional[int] = None
    compile: bool = False
    callbacks: Sequence[Any] = ()
    verbose: bool = False
    _resumed: Optional[ResumedRun] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.overwrite and self.resume not in (None, False, ""):
            raise RunError("--overwrite and --resume contradict each other: --resume continues the run in --out, "
                           "--overwrite replaces it; pass one")
        for key in RUN_DEFAULTS:
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, _checked_option(key, value, self.accelerator))
        # what the machine and the file system can refuse, before a dataset is loaded or made
        check_devices(self.devices, self.accelerator, self.num_nodes)
        check_strategy(self.strategy, self.accelerator)
        if self.out_dir is not None:
            check_out_dir(self.out_dir)

    def resumed_run(self) -> Optional[ResumedRun]:
        """The run ``resume`` continues, read and checked once (on the first call); None for a new
        run, or for ``resume=True`` without an ``out_dir`` (the default folder is chosen by ``train``)."""
        if self._resumed is None and self.resume not in (None, False, ""):
            object.__setattr__(self, "_resumed", ResumedRun.find(self.resume, self.out_dir))
        return self._resumed


#: the run options a resumed run takes from its checkpoint, with a new run's defaults
#: (:class:`RunSettings`' fields that default to None)
RUN_DEFAULTS: dict[str, Any] = {f.name: f.metadata["new_run"] for f in dataclasses.fields(RunSettings)
                                if "new_run" in f.metadata}
assert RUN_DEFAULTS == _NEW_RUN, "RunSettings' resumable fields and config.RUN_DEFAULTS must list the same options"


def _checked_option(key: str, value: Any, accelerator: str) -> Any:
    """``value`` of the run option ``key`` (given, or a resumed run's), checked; a ``RunError`` if it is bad."""
    if key == "steps" and value < 1:
        raise RunError(f"--steps must be at least 1, got {value}")
    if key == "seed" and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2 ** 32 - 1):
        raise RunError(f"--seed must be a whole number from 0 to {2 ** 32 - 1} (numpy's seed range), got {value!r}")
    if key == "eval_episodes" and value < 1:
        raise RunError(f"--eval-episodes must be at least 1, got {value}")
    if key == "eval_every" and value < 0:
        raise RunError(f"--eval-every must be 0 (only at the end) or positive, got {value}")
    if key == "precision":
        return check_precision(value, accelerator)
    if key == "online_steps" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise RunError(f"--online-steps must be a whole number >= 0, got {value!r}")
    if key == "accumulate" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise RunError(f"--accumulate must be a whole number >= 1, got {value!r}")
    if key == "steps_per_call":
        from offline_plugins.lightning.module import resolve_steps_per_call

        return resolve_steps_per_call(value)
    if key == "logger":
        from offline_plugins.lightning.loggers import logger_names

        logger_names(value)  # an unknown logger, or one whose package is missing
    return value


def _resolve_run_options(settings: RunSettings, resumed: Optional[ResumedRun]) -> tuple[dict, Optional[dict]]:
    """Each run option: the settings', else the resumed run's (checked here), else the default; and the
    record of which came from where for the summary (None for a new run)."""
    options, record = {}, None
    if resumed is not None:
        record = {"from": str(resumed.path), "kept": {}, "overridden": {}}
    for key, default in RUN_DEFAULTS.items():
        value = getattr(settings, key)
        if value is not None:
            options[key] = value
            if resumed is not None and key in resumed.options and resumed.options[key] != value:
                record["overridden"][key] = {"checkpoint": resumed.options[key], "now": value}
        elif resumed is not None and key in resumed.options:
            options[key] = _checked_option(key, resumed.options[key], settings.accelerator)
            record["kept"][key] = resumed.options[key]
        else:
            options[key] = default
    return options, record


@contextlib.contextmanager
def _process_state(settings: RunSettings) -> Iterator[None]:
    """Set the run's torch threads; give the caller back its threads, environment and RNG states after."""
    with restored_process_state():
        if settings.threads is not None:
            import torch

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
    from offline_plugins.lightning.loggers import logger_names
    from offline_plugins.lightning.module import resolve_steps_per_call

    resumed = settings.resumed_run()
    options, resume_record = _resolve_run_options(settings, resumed)
    steps, seed, accumulate = options["steps"], options["seed"], options["accumulate"]
    online_steps = int(options["online_steps"] or 0)
    if online_steps:
        from offline_plugins.lightning.finetune import check_online

        check_online(plan.spec, plan.config, plan.data, online_steps=online_steps)
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


def _finished_summary(out: Path, ckpt: Mapping[str, Any], total: int) -> Optional[dict]:
    """The summary of the run in ``out`` when it already finished ``total`` steps (its checkpoint is at or
    past them and its ``summary.json`` is a finished run's), with ``"already_complete": True``; else None."""
    done = int(ckpt.get("global_step", 0) or 0)
    path = out / "summary.json"
    if done < total or not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("interrupted") or summary.get("steps") != done:
        return None
    return {**summary, "already_complete": True}


def _scale_device(accelerator: str) -> str:
    """Where the run's batches will live, for the memory check: the GPU when it will use one."""
    import torch

    return "cuda" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


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


def _fit(plan: RunPlan, settings: RunSettings, out: Path, ckpt_path: Optional[Path], ckpt: Optional[dict], *,
         steps: int, seed: int, eval_every: Optional[int], eval_episodes: int, checkpoint_every: Optional[int],
         log_every: int, started: float, steps_per_call: int = 1, precision: str = "32-true", accumulate: int = 1,
         resume_record: Optional[dict] = None, loggers: Sequence[str] = ("csv",),
         online_steps: int = 0) -> dict[str, Any]:
    """Build the module, the data module and the callbacks, fit, and write the run's files.

    ``steps`` on the dataset, then ``online_steps`` more while acting (offline-to-online fine-tuning).

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
    from offline_plugins.lightning.files import RESUME_FIX, RunCheckpointIO
    from offline_plugins.lightning.loggers import close_loggers, make_loggers

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
        from offline_plugins.lightning.fsdp import FSDP_PRECISIONS

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
        from offline_plugins.lightning.fsdp import full_copy

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


#: what a run writes in its folder: what ``overwrite=True`` removes, and nothing else
_RUN_FILES = ("summary.json", "metrics.csv", "metrics.before-resume.csv", "learning_curve.png", "hparams.yaml",
              "checkpoints", "model", "adapter", "reward_model")


def check_run_inputs(settings: RunSettings, inputs: Mapping[str, Any]) -> None:
    """Refuse, before any data or model is loaded, a run with ``settings.out_dir`` one of whose
    ``inputs`` (flag -> path: ``--config``, ``--model``, ``--reward``, ``--dataset``) lies inside what
    the run replaces or ``--overwrite`` removes; :func:`train` checks again with the plan's paths."""
    if settings.out_dir is not None:
        _check_inputs_outside(Path(settings.out_dir), _existing_inputs(inputs), overwrite=settings.overwrite)


def _run_inputs(plan: RunPlan, given: Optional[Mapping[str, Any]]) -> dict[str, Path]:
    """The files and folders the run reads, by flag: ``given`` (the ``--config`` file) and what the plan
    names as a path (``--model`` and ``--reward`` folders, a ``--dataset`` file)."""
    return _existing_inputs({**(given or {}), "--model": plan.options.model, "--reward": plan.options.reward,
                             "--dataset": plan.dataset_id})


def _existing_inputs(candidates: Mapping[str, Any]) -> dict[str, Path]:
    """Those of ``candidates`` (flag -> value) that name an existing file or folder."""
    found: dict[str, Path] = {}
    expanded: dict[str, Any] = {}
    for flag, value in candidates.items():  # several --reward NAME=SPEC: each spec that names a path
        if isinstance(value, (list, tuple)):
            expanded.update({f"{flag} {str(v).partition('=')[0]}": str(v).partition("=")[2] or str(v) for v in value})
        else:
            expanded[flag] = value
    for flag, value in expanded.items():
        if isinstance(value, (str, os.PathLike)) and str(value) and os.path.lexists(value):
            path = Path(value)
            if flag.startswith("--reward") and path.is_dir() and (path / "reward_model").is_dir():
                path = path / "reward_model"  # a reward-model run's OUT names the reward model inside it
            found[flag] = path
    return found


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it, by the path as written and through symlinks."""
    ways = [(os.path.abspath(path), os.path.abspath(folder))]
    if not folder.is_symlink():  # a symlinked run file is unlinked, not followed, by --overwrite
        ways.append((os.path.realpath(path), os.path.realpath(folder)))
    return any(p == f or p.startswith(f.rstrip(os.sep) + os.sep) for p, f in ways)


#: what any run replaces in its folder (the exported folders are swapped in whole)
_RUN_WRITES = ("summary.json", "metrics.csv", "learning_curve.png", "hparams.yaml", "checkpoints/last.ckpt", "model",
               "adapter", "reward_model")


def _check_inputs_outside(out: Path, inputs: Mapping[str, Path], *, overwrite: bool) -> None:
    """Refuse a run one of whose ``inputs`` lies inside a file or folder of ``out`` that the run replaces
    (:data:`_RUN_WRITES`: its exported model, summary, metrics...) or ``--overwrite`` removes (:data:`_RUN_FILES`)."""
    for flag, path in inputs.items():
        for name in (_RUN_FILES if overwrite else _RUN_WRITES):
            target = out / name
            if not _within(path, target):
                continue
            doing = "--overwrite removes with the earlier run" if overwrite else "this run replaces with its own"
            raise RunError(
                f"{flag} {str(path)!r} lies inside {str(target)!r}, which {doing}: the run would destroy its own "
                f"input; copy it elsewhere (cp -r {str(path)!r} OTHER) and pass {flag} OTHER, or choose another --out"
            )


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


def _stop_launched_ranks(trainer) -> None:
    """Rank 0 failed: end the ranks its launcher started. Lightning ends them after a Ctrl-C, and its
    observer ends every rank when a launched one fails, but after an error on rank 0 they would wait
    in their next collective for the process group's timeout (30 minutes)."""
    import signal

    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if trainer.is_global_zero and isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
        launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # SIGTERM does not end a rank inside a collective


def _needs_unused_parameters(parts) -> bool:
    # groups that sit steps out still backpropagate (with weight 0) under DDP, see
    # AlgorithmModule.on_fit_start; parameters no group steps never get a gradient
    grouped = {id(p) for g in parts.optimizers for p in g.params}
    return any(id(p) not in grouped for p in parts.loss.parameters() if p.requires_grad)


def _strategy(devices, num_nodes: int, parts, strategy):
    if strategy == "fsdp":
        # FSDP2 through Lightning's ModelParallelStrategy: the module's configure_model wraps each
        # decoder layer, then the model (offline_plugins.lightning.fsdp)
        from offline_plugins.lightning.fsdp import fsdp_strategy, language_models

        if not language_models(parts.loss):
            raise RunError("--strategy fsdp shards the decoder layers of a transformers model (the classes its "
                           "_no_split_modules names); this algorithm's networks have none: use --strategy ddp")
        return fsdp_strategy(_device_count(devices) * int(num_nodes))
    if strategy is not None and strategy != "auto":
        return strategy
    single = (isinstance(devices, int) and devices == 1) or devices in ("1", [0])
    if single and num_nodes == 1:
        return "auto"
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(find_unused_parameters=_needs_unused_parameters(parts))


def _device_count(devices) -> int:
    """How many devices a node runs ``devices`` (``--devices``) on: a count, a list of ids or ``"auto"``
    (the GPUs here, else 1)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if devices in ("auto", -1, "-1"):
        import torch

        return max(1, torch.cuda.device_count())
    return int(devices)


def plot_learning_curve(metrics_csv: Union[str, os.PathLike], out_png: Union[str, os.PathLike], *, title: str = "",
                        panels: Optional[Sequence[Any]] = None, marks: Optional[Mapping[str, int]] = None) -> Path:
    """Plot ``metrics.csv`` against gradient steps, one panel per
    :class:`~offline_plugins.plugins.datakind.CurvePanel` (the data kind's ``curve_panels()``;
    default: the environment kinds' score above the losses). ``marks``: a dashed vertical line at
    each ``{label: step}`` (the start of fine-tuning's online phase)."""
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
        if keys and panel.log:
            ax.set_yscale("symlog", linthresh=1e-3)
        for label, at in (marks or {}).items():
            ax.axvline(at, color="grey", linestyle="--", linewidth=1, label=label)
        if keys or marks:
            ax.legend(fontsize="small")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("gradient step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out = Path(out_png)
    try:
        with atomic_path(out) as partial:  # a full disk leaves the previous plot
            fig.savefig(partial, dpi=100, format=out.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return out
