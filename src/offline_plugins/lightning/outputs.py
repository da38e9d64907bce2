"""A run's output folder: what a run writes there and may not read from it (:func:`check_run_inputs`),
whether it holds an earlier run (``--overwrite``), the default folder, and the learning-curve plot.
``offline_plugins.lightning.run`` re-exports :func:`check_run_inputs` and :func:`plot_learning_curve`."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import matplotlib
import matplotlib.pyplot as plt

from offline_plugins.data.files import atomic_path
from offline_plugins.lightning.guards import RunError, RunFolderLock
from offline_plugins.lightning.plan import RunPlan
from offline_plugins.lightning.settings import RunSettings
from offline_plugins.plugins.datakind import LOSS_PANEL, CurvePanel

__all__ = ["check_run_inputs", "plot_learning_curve"]


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


def _readable(column: str) -> str:
    """``"eval/success_rate"`` -> ``"success rate"``: a metrics column as a plot names it."""
    return column.split("/", 1)[-1].replace("_", " ")


def plot_learning_curve(metrics_csv: Union[str, os.PathLike], out_png: Union[str, os.PathLike], *, title: str = "",
                        panels: Optional[Sequence[Any]] = None, marks: Optional[Mapping[str, int]] = None) -> Path:
    """Plot ``metrics.csv`` against gradient steps, one panel per
    :class:`~offline_plugins.plugins.datakind.CurvePanel` (the data kind's ``curve_panels()``;
    default: the environment kinds' score above the losses). ``marks``: a dashed vertical line at
    each ``{label: step}`` (the start of fine-tuning's online phase)."""
    matplotlib.use("Agg")

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
            ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, label=_readable(key))
        if keys and panel.log:
            ax.set_yscale("symlog", linthresh=1e-3)
        for label, at in (marks or {}).items():
            ax.axvline(at, color="grey", linestyle="--", linewidth=1, label=label)
        if keys or marks:
            ax.legend(fontsize="small")
        # a panel that draws the first of its columns present is labelled by the one it drew
        ax.set_ylabel(_readable(keys[0]) if panel.first_only and keys else panel.ylabel)
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
