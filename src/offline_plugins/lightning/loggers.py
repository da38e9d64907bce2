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

>>> logger_names(None), logger_names("tensorboard,csv"), logger_names(["csv"])
(('csv',), ('csv', 'tensorboard'), ('csv',))
>>> logger_names("neptune")
Traceback (most recent call last):
...
offline_plugins.errors.UserError: unknown --logger 'neptune'; choose from csv, tensorboard, mlflow, wandb
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Sequence, Union

from offline_plugins.errors import UserError

__all__ = ["LOGGERS", "logger_names", "make_loggers", "close_loggers"]

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


def make_loggers(logger: Union[None, str, Sequence[str]], out: Union[str, os.PathLike], *, run_name: str) -> list:
    """The Lightning loggers of a run writing to ``out``: ``CSVLogger`` first (``out/metrics.csv``),
    then the others ``logger`` names (see the module's table), each run named ``run_name``."""
    from offline_plugins.lightning.files import RunCSVLogger

    out = Path(out)
    loggers: list[Any] = []
    for name in logger_names(logger):
        if name == "csv":
            loggers.append(RunCSVLogger(save_dir=str(out), name="", version=""))
        elif name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=str(out), name="tensorboard", version="",
                                             default_hp_metric=False))
        elif name == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:
                # a file store in the run folder: no server, readable with MlflowClient(uri) or the
                # MLflow UI pointed at OUT/mlruns; MLflow 3 keeps file stores behind this switch
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                uri = (out / "mlruns").resolve().as_uri()
            given = os.environ.get("MLFLOW_TRACKING_URI")
            mlflow_logger = MLFlowLogger(experiment_name="offline-plugins", run_name=run_name, tracking_uri=uri)
            # starting its run, Lightning's logger sets MLflow's process-wide tracking URI (and
            # MLFLOW_TRACKING_URI) to its own; the run is started now and the URI put back, so a later
            # run in this process writes to its own store (the logger keeps a client of its own)
            mlflow_logger.experiment
            import mlflow

            mlflow.set_tracking_uri(given)
            loggers.append(mlflow_logger)
        elif name == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(WandbLogger(project=os.environ.get("WANDB_PROJECT", "offline-plugins"), name=run_name,
                                       save_dir=str(out)))
    return loggers


def close_loggers(loggers: Sequence[Any]) -> dict[str, str]:
    """Finish the runs the loggers started and say where each wrote, for ``summary.json``
    (``{"csv": ".../metrics.csv", "tensorboard": dir, ...}``).

    Lightning leaves a W&B run open in the process when training ends, and the next run's
    ``WandbLogger`` would log into it; it is finished here. (Lightning finishes MLflow runs itself.)
    """
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

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
