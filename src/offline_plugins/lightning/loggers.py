"""The loggers of a ``train`` run (``--logger``): Lightning's own, the optional ones as extras.

Lightning's ``CSVLogger`` always logs (the run folder's ``metrics.csv`` and
``learning_curve.png`` are made from it), as
:class:`~offline_plugins.lightning.files.RunCSVLogger`, whose file survives a full disk and
a resume; ``--logger`` adds others beside it:

=============  ======================================  ==========================================
``--logger``   Lightning logger, where it writes       needs
=============  ======================================  ==========================================
csv            ``CSVLogger``: ``OUT/metrics.csv``       nothing (always on)
tensorboard    ``TensorBoardLogger``: ``OUT/tensorboard`` ``pip install 'offline-plugins[tensorboard]'``
mlflow         ``MLFlowLogger``: ``$MLFLOW_TRACKING_URI``, ``pip install 'offline-plugins[mlflow]'``
               else a file store in ``OUT/mlruns``
wandb          ``WandbLogger``: project ``offline-plugins``, ``pip install 'offline-plugins[wandb]'``
               files in ``OUT/wandb`` (``WANDB_MODE=offline``:
               nothing leaves the machine)
=============  ======================================  ==========================================

What each does on a full disk and on ``--resume``:

- A write that fails (full disk, quota, a folder made read-only) stops the run with the same
  one-line :class:`~offline_plugins.data.files.WriteError` as ``metrics.csv`` and the
  checkpoints, naming the logger's folder; ``metrics.csv`` and ``last.ckpt`` are intact and
  ``--resume`` continues.
- A resumed run continues the run its loggers started, recorded in ``OUT/loggers.json``:
  TensorBoard writes a new event file whose ``purge_step`` hides what the interrupted run
  logged after its checkpoint (TensorBoard's own mechanism for a restart), so the curves are an
  uninterrupted run's; MLflow logs into the same run (``run_id``), where the points logged
  after the checkpoint stay beside the resumed run's (MLflow has no call that deletes metric
  points; the run carries the tag ``offline_plugins.resumed_at_steps``); W&B resumes the same
  run id (``resume="allow"``).

>>> logger_names(None), logger_names("tensorboard,csv"), logger_names(["csv"])
(('csv',), ('csv', 'tensorboard'), ('csv',))
>>> logger_names("neptune")
Traceback (most recent call last):
...
offline_plugins.errors.UserError: unknown --logger 'neptune'; choose from csv, tensorboard, mlflow, wandb
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from offline_plugins.data.files import atomic_write_text, is_write_error, write_error
from offline_plugins.errors import UserError
from offline_plugins.lightning.files import RESUME_FIX, RunCSVLogger

__all__ = ["LOGGERS", "RECORD", "logger_names", "make_loggers", "close_loggers"]

#: ``--logger`` names -> the packages any one of which the Lightning logger needs
LOGGERS: dict[str, tuple[str, ...]] = {
    "csv": (),
    "tensorboard": ("tensorboard", "tensorboardX"),
    "mlflow": ("mlflow",),
    "wandb": ("wandb",),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def logger_names(logger: Union[None, str, Sequence[str]]) -> tuple[str, ...]:
    """``("csv", ...)``: the loggers ``logger`` names (a name, ``"a,b"``, or a list), CSV first and
    always; raises a ``UserError`` naming an unknown one, or the extra to install for a missing package."""
    if logger is None:
        given: list[str] = []
    elif isinstance(logger, str):
        given = [logger]
    else:
        given = list(logger)
    names = ["csv"]
    for item in given:
        for name in str(item).split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in LOGGERS:
                raise UserError(f"unknown --logger {name!r}; choose from {', '.join(LOGGERS)}")
            if name not in names:
                names.append(name)
    for name in names:
        packages = LOGGERS[name]
        if packages and not any(_installed(p) for p in packages):
            raise UserError(f"--logger {name} needs the {packages[0]} package, which is not installed: "
                            f"pip install 'offline-plugins[{name}]' (or drop --logger {name})")
    return tuple(names)


#: where a run records the runs its loggers started, for a resume to continue them
RECORD = "loggers.json"


@contextlib.contextmanager
def _writes(where: str) -> Iterator[None]:
    # a logger's failed write (full disk, quota, read-only folder) is the run's one-line WriteError

    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # Lightning's TensorBoard logger re-raises the writer's OSError as a ValueError
        if is_write_error(exc):
            raise write_error(where, exc, fix=RESUME_FIX,
                              what="metrics.csv and the last checkpoint are intact") from None
        raise


def _guarded(base: type) -> type:
    """``base`` (a Lightning logger class) whose writes fail as :func:`_writes` says; on a run that
    failed already, its closing write error is dropped (the run's own error is the one reported)."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        def _where(self) -> str:
            return str(getattr(self, "log_dir", None) or getattr(self, "save_dir", None) or self.name)

        def log_metrics(self, *args: Any, **kwargs: Any) -> None:
            with _writes(self._where()):
                return super().log_metrics(*args, **kwargs)

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            with _writes(self._where()):
                return super().log_hyperparams(*args, **kwargs)

        def save(self) -> None:
            with _writes(self._where()):
                return super().save()

        def finalize(self, status: str) -> None:
            try:
                with _writes(self._where()):
                    return super().finalize(status)
            except UserError:
                if status != "failed":
                    raise

    Guarded.__name__ = Guarded.__qualname__ = f"Run{base.__name__}"
    return Guarded


def _record(out: Path) -> dict[str, Any]:
    try:
        found = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def make_loggers(logger: Union[None, str, Sequence[str]], out: Union[str, os.PathLike], *, run_name: str,
                 resume_step: Optional[int] = None) -> list:
    """The Lightning loggers of a run writing to ``out``: ``CSVLogger`` first (``out/metrics.csv``),
    then the others ``logger`` names (see the module's table), each run named ``run_name``.
    ``resume_step``: the step of the checkpoint a resumed run starts from; the loggers continue
    the runs recorded in ``out/loggers.json``."""
    out = Path(out)
    earlier = _record(out) if resume_step is not None else {}
    record: dict[str, Any] = {}
    loggers: list[Any] = []
    for name in logger_names(logger):
        if name == "csv":
            loggers.append(RunCSVLogger(save_dir=str(out), name="", version=""))
        elif name == "tensorboard":
            # on a resume, the events the interrupted run logged after its checkpoint (training rows
            # from step+1, as metrics.csv is cut) are hidden by the new event file's purge_step
            kwargs = {"purge_step": int(resume_step) + 1} if resume_step is not None else {}
            loggers.append(_guarded(TensorBoardLogger)(save_dir=str(out), name="tensorboard", version="",
                                                       default_hp_metric=False, **kwargs))
        elif name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:
                # a file store in the run folder: no server, readable with MlflowClient(uri) or the
                # MLflow UI pointed at OUT/mlruns; MLflow 3 keeps file stores behind this switch
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                uri = (out / "mlruns").resolve().as_uri()
            given = os.environ.get("MLFLOW_TRACKING_URI")
            run_id = (earlier.get("mlflow") or {}).get("run_id")
            if (earlier.get("mlflow") or {}).get("tracking_uri") != uri:
                run_id = None  # another store now: a run of its own there
            mlflow_logger = _guarded(MLFlowLogger)(experiment_name="offline-plugins", run_name=run_name,
                                                   tracking_uri=uri, run_id=run_id)
            # starting its run, Lightning's logger sets MLflow's process-wide tracking URI (and
            # MLFLOW_TRACKING_URI) to its own; the run is started now and the URI put back, so a later
            # run in this process writes to its own store (the logger keeps a client of its own)
            with _writes(str(out / "mlruns") if not given else uri):
                client = mlflow_logger.experiment
                if run_id is not None and rank_zero_only.rank == 0:
                    steps = [*(earlier["mlflow"].get("resumed_at_steps") or []), int(resume_step or 0)]
                    client.set_tag(run_id, "offline_plugins.resumed_at_steps", ",".join(map(str, steps)))
                    record["mlflow"] = {"tracking_uri": uri, "run_id": run_id, "resumed_at_steps": steps}
                else:
                    record["mlflow"] = {"tracking_uri": uri, "run_id": mlflow_logger.run_id}
            import mlflow

            mlflow.set_tracking_uri(given)
            loggers.append(mlflow_logger)
        elif name == "wandb":
            run_id = (earlier.get("wandb") or {}).get("id")
            if run_id is None:
                run_id = secrets.token_hex(4)  # a W&B run id (lower-case letters and digits)
            record["wandb"] = {"id": run_id}
            loggers.append(_guarded(WandbLogger)(project=os.environ.get("WANDB_PROJECT", "offline-plugins"),
                                                 name=run_name, save_dir=str(out), id=run_id, resume="allow"))
    if record and rank_zero_only.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / RECORD, json.dumps(record, indent=1) + "\n", fix=RESUME_FIX)
    return loggers


def close_loggers(loggers: Sequence[Any]) -> dict[str, str]:
    """Finish the runs the loggers started and say where each wrote, for ``summary.json``
    (``{"csv": ".../metrics.csv", "tensorboard": dir, ...}``).

    Lightning leaves a W&B run open in the process when training ends, and the next run's
    ``WandbLogger`` would log into it; it is finished here. (Lightning finishes MLflow runs itself.)
    """
    found: dict[str, str] = {}
    for lg in loggers:
        if isinstance(lg, CSVLogger):
            found["csv"] = str(Path(lg.log_dir) / "metrics.csv")
        elif isinstance(lg, TensorBoardLogger):
            found["tensorboard"] = str(lg.log_dir)
        elif isinstance(lg, MLFlowLogger):
            found["mlflow"] = f"{lg.experiment.tracking_uri} (experiment offline-plugins, run {lg.run_id})"
        elif isinstance(lg, WandbLogger):
            run = lg.experiment
            found["wandb"] = str(Path(run.dir).parent)  # the run's folder (`wandb sync` takes it)
            run.finish()
    return found
