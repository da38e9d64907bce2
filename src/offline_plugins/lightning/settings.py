"""A run's options: :class:`RunSettings` (checked when made, before any data loads) and
:data:`RUN_DEFAULTS`, the options a resumed run takes from its checkpoint, with a new run's defaults.
:func:`~offline_plugins.lightning.run.train` reads them; ``offline_plugins.lightning.run`` re-exports
both."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence, Union

from offline_plugins.config import RUN_DEFAULTS as _NEW_RUN
from offline_plugins.lightning.checkpoints import ResumedRun
from offline_plugins.lightning.guards import RunError, check_devices, check_out_dir, check_precision, check_strategy
from offline_plugins.lightning.loggers import logger_names
from offline_plugins.lightning.module import resolve_steps_per_call

__all__ = ["RunSettings", "RUN_DEFAULTS"]


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
            whose config has the ``online_*`` fields, on a kind with an online phase: ``DataKind.online_datamodule``).
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
        return resolve_steps_per_call(value)
    if key == "logger":
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
