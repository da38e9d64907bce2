"""A run's checkpoints: reading them, resuming from them, rebuilding and evaluating their policy.

:func:`load_checkpoint` (:mod:`offline_plugins.lightning.checkpoint_files`, where every checkpoint
read and check lives) reads a checkpoint written by :func:`~offline_plugins.lightning.run.train`
(``weights_only=True`` only, its metadata checked); :class:`ResumedRun` is what a checkpoint says about the run it belongs to, which
a bare ``--resume`` continues; :func:`load_trained_run` and :func:`evaluate_checkpoint`
rebuild a run's trained policy (``offline-plugins eval``). The metrics of a resumed run
are cut at its checkpoint here too (:func:`trim_metrics`); a checkpoint whose tensors do
not fit the networks its config builds is refused naming the first that differs.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path
from typing import Any, Optional, Union

from offline_plugins.config import RUN_DEFAULTS, config_to_dict
from offline_plugins.data.files import atomic_write
from offline_plugins.eval.fqe import OPEError, fitted_q_evaluation
from offline_plugins.lightning.checkpoint_files import (  # noqa: F401 - load_checkpoint, resume_path: re-exported
    algorithm_of_checkpoint,
    check_checkpoint,
    load_checkpoint,
    read_checkpoint,
    resume_path,
    state_dict_mismatch,
)
from offline_plugins.lightning.files import RESUME_FIX
from offline_plugins.lightning.guards import RunError
from offline_plugins.lightning.module import AlgorithmModule
from offline_plugins.lightning.plan import RunPlan, _as_overrides, build_parts, plan_run
from offline_plugins.plugins import shared_registry
from offline_plugins.plugins.registry import AlgorithmSpec

__all__ = [
    "ResumedRun",
    "TrainedRun",
    "load_checkpoint",
    "load_trained_run",
    "evaluate_checkpoint",
    "estimate_checkpoint",
    "resume_path",
    "resume_summary",
    "merge_metrics",
    "trim_metrics",
]


@dataclasses.dataclass
class ResumedRun:
    """What a checkpoint says about the run it belongs to: what a bare ``--resume`` continues.

    ``options`` are the run options (:data:`~offline_plugins.lightning.run.RUN_DEFAULTS`' names,
    fields of :class:`~offline_plugins.lightning.run.RunSettings`) the run was started with;
    ``config`` its whole algorithm config; ``model``, ``reward``, ``drop_nonfinite`` and
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
        ckpt = read_checkpoint(path, tensors=False)
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
        return cls.read(resume_path(resume, Path(out_dir) if out_dir is not None else Path(".")))

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


def resume_summary(record: Optional[dict], ckpt: dict, plan: RunPlan) -> dict:
    """Which run options and config fields a resumed run kept from its checkpoint, and which the
    caller overrode (``{"checkpoint": old, "now": new}``)."""
    record = dict(record or {"from": None, "kept": {}, "overridden": {}})
    record["overridden"] = dict(record["overridden"])
    saved, now = ckpt["offline_plugins"].get("config") or {}, config_to_dict(plan.config)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            record["overridden"][f"config.{key}"] = {"checkpoint": saved.get(key), "now": now.get(key)}
    return record


def _read_metrics(path: Path) -> tuple[list[str], list[dict]]:
    if not path.is_file():
        return [], []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def _logged_before(row: dict, step: int) -> bool:
    # evaluation rows carry the 0-based index of the last step, training rows (logged after the
    # optimiser step) the 1-based count; rows after the checkpoint's step are redone by the resumed run
    if not row.get("step"):
        return False
    trained = any(k.startswith("train/") and row.get(k) not in ("", None) for k in row)
    return int(float(row["step"])) < step + (1 if trained else 0)


def _write_metrics(path: Path, keys: list[str], rows: list[dict]) -> None:
    def write(fh) -> None:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    atomic_write(path, write, fix=RESUME_FIX, mode="w")


def trim_metrics(path: Path, *, before_step: int, earlier: Optional[Path] = None) -> None:
    """Keep in ``path`` (a run's ``metrics.csv``) the rows logged before ``before_step``, the step a
    resumed run starts from, which then appends its own; ``earlier`` (the ``metrics.before-resume.csv``
    an older version left when a resume failed) is merged in first and removed. The file is rewritten
    beside itself and renamed over, so a full disk leaves it as it was."""
    path, earlier = Path(path), Path(earlier) if earlier is not None else None
    old_keys, old_rows = _read_metrics(earlier) if earlier is not None else ([], [])
    keys, rows = _read_metrics(path)
    if not old_rows and not rows and not path.is_file():
        return
    kept = [r for r in old_rows + rows if _logged_before(r, before_step)]
    _write_metrics(path, sorted(set(old_keys) | set(keys)), kept)
    if earlier is not None and earlier.is_file():
        earlier.unlink()


def merge_metrics(earlier: Path, current: Path, *, before_step: int) -> None:
    """Prepend the rows of ``earlier`` logged before ``before_step`` to ``current`` (written beside it and
    renamed over), then remove ``earlier``."""
    old_keys, old_rows = _read_metrics(earlier)
    new_keys, new_rows = _read_metrics(current)
    old_rows = [r for r in old_rows if _logged_before(r, before_step)]
    _write_metrics(current, sorted(set(old_keys) | set(new_keys)), old_rows + new_rows)
    earlier.unlink()


@dataclasses.dataclass
class TrainedRun:
    """A run rebuilt from its checkpoint: the trained module, its plan (data, config, kind), the checkpoint.

    Attributes:
        module: the :class:`~offline_plugins.lightning.module.AlgorithmModule` with the
            checkpoint's weights, on ``device``.
        plan: the :class:`~offline_plugins.lightning.plan.RunPlan` the run's own config and dataset give.
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
    ckpt = load_checkpoint(path)
    info = ckpt["offline_plugins"]
    run = info.get("run", {})
    seed = int(info.get("seed", 0))
    if registry is None:
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
    module = AlgorithmModule(build_parts(plan, seed), algorithm=plan.spec.name, dataset=plan.dataset_id, seed=seed)
    # compared before loading: a shape that differs fails deep in TorchRL's functional parameters
    # (a ValueError printing every tensor), not in load_state_dict's own check
    first = state_dict_mismatch(ckpt["state_dict"], module.state_dict())
    if first is None:
        try:
            module.load_state_dict(ckpt["state_dict"])
        except (RuntimeError, ValueError) as exc:  # what the comparison did not foresee
            first = " ".join(str(exc).split())[:200]
    if first is not None:
        raise RunError(f"checkpoint {str(path)!r} ({plan.spec.name} on {plan.dataset_id}) does not fit the networks "
                       f"its own config builds: {first}; the file was edited or written by another version: "
                       "evaluate the run's own OUT/checkpoints/last.ckpt, or train the run again") from None
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


def estimate_checkpoint(path, *, method: str = "fqe", device: str = "cpu", registry=None, seed: Optional[int] = None,
                        progress: bool = False, **options: Any) -> dict[str, Any]:
    """Rebuild the policy saved in the checkpoint ``path`` and estimate its value by ``method``
    (``"fqe"``: :func:`fitted_q_evaluation`, ``options`` its keyword arguments) on the run's dataset,
    loaded as the run loaded it; no environment is made."""
    if method != "fqe":
        raise OPEError(f"unknown --ope method {method!r}; the one there is: fqe")
    trained = load_trained_run(path, device=device, registry=registry)
    data = trained.plan.data
    if not hasattr(data, "td") or not hasattr(data, "stats"):
        raise OPEError(f"--ope fqe estimates a policy's return from a dataset of environment steps, and run "
                       f"{trained.info['dataset']!r} trained on {trained.plan.kind.name} data; evaluate it "
                       "without --ope")
    seed = int(seed if seed is not None else trained.info.get("seed", 0))
    result = fitted_q_evaluation(trained.module.parts.policy, data, seed=seed, device=device, progress=progress,
                                 **options)
    return {"algorithm": trained.plan.spec.name, "dataset": trained.plan.dataset_id, "checkpoint": str(path),
            "step": trained.step, **result}
