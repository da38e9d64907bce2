"""The contract between the training shell and one kind of data.

The shell (:mod:`offline_plugins.lightning.run`) trains any algorithm the same way:
check, load, sample batches from a TorchRL replay buffer, step the optimisers,
evaluate, write the run. What differs between transitions of an environment, windows
of trajectories, preference pairs and unpaired feedback is asked of a :class:`DataKind`,
the one object per data kind that an algorithm's ``AlgorithmSpec.data`` names:

============================  ==========================================================
``claims`` / ``resolve``      whether a dataset id is of this kind; its canonical id
``check_options``             refuse run options that do not apply (``--model``...)
``load``                      the loaded dataset (it makes the TorchRL replay buffer)
``batch_layout``              batch size, sampler (``random``/``slice``), window length
``check_scale``               refuse a batch that cannot fit in memory, before it is made
``datamodule``                the kind's own ``LightningDataModule`` (default: the shell's)
``run_settings``              what a checkpoint must remember to rebuild the data
``reload_options``            the options to reload the data from those settings
``evaluation``                the Lightning callback that scores the run
``callbacks``                 further callbacks the data needs
``summary_fields``            what ``summary.json`` adds (the last evaluation's figures)
``curve_panels``              the panels of ``learning_curve.png`` (:class:`CurvePanel`)
``export``                    the trained policy in a form other tools load
``evaluate``                  ``offline-plugins eval`` of a checkpoint
``describe``                  the CLI's one-line result
============================  ==========================================================

A plugin registers a new kind through the ``offline_plugins_register_data_kinds``
hook (docs/plugins.md); algorithms name it in ``AlgorithmSpec.data``. The shell never
tests a family or an algorithm name. The contract lives here, beside the other records
plugins register; the built-in kinds are in :mod:`offline_plugins.kinds`, which
re-exports these names.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Optional

from offline_plugins.errors import UserError

__all__ = ["DataKind", "DataOptions", "LoadedData", "BatchLayout", "CurvePanel", "LOSS_PANEL", "config_value",
           "result_line", "figures", "pct", "ScaleError", "available_memory_bytes", "check_memory", "check_rows"]


class ScaleError(UserError, ValueError):
    """A batch, a round or a response budget too large for the data or for this machine's memory."""


def available_memory_bytes(device: Any = None) -> Optional[int]:
    """Memory a run can still take: a CUDA device's free memory, else the host's ``MemAvailable``
    (Linux ``/proc/meminfo``), else None (unknown: nothing is refused)."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: float) -> str:
    """``1.5 GB``, ``320 MB``.

    >>> _size(1.5e9), _size(3.2e8)
    ('1.5 GB', '320 MB')
    """
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_memory(need: int, *, what: str, fix: str, device: Any = None, available: Optional[int] = None) -> None:
    """Refuse with a :class:`ScaleError` when ``need`` bytes exceed what is free on ``device``.

    >>> check_memory(10**12, what="batch_size=100000 (rows of 32 tokens)", fix="lower --set batch_size",
    ...              available=10**9)
    Traceback (most recent call last):
    ...
    offline_plugins.plugins.datakind.ScaleError: batch_size=100000 (rows of 32 tokens) needs about 1000.0 GB, but 1.0 GB of memory is free on cpu; lower --set batch_size
    """
    free = available if available is not None else available_memory_bytes(device)
    if free is not None and need > free:
        raise ScaleError(f"{what} needs about {_size(need)}, but {_size(free)} of memory is free on "
                         f"{device or 'cpu'}; {fix}")


def check_rows(batch_size: int, rows: int, *, what: str) -> None:
    """Refuse a batch of more ``what`` than the data holds (each step would repeat rows to fill it).

    >>> check_rows(100000, 300, what="training pairs")
    Traceback (most recent call last):
    ...
    offline_plugins.plugins.datakind.ScaleError: batch_size=100000 is larger than the 300 training pairs of the dataset; use at most --set batch_size=300
    """
    if batch_size > rows:
        raise ScaleError(f"batch_size={batch_size} is larger than the {rows} {what} of the dataset; use at most "
                         f"--set batch_size={rows}")


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The run options about data that are not algorithm config (CLI flags of ``train``).

    Attributes:
        model: a language model to build the data and the networks from (``--model``):
            ``"tiny"``, a ``save_pretrained`` folder or a hub id; None: not given.
        drop_nonfinite: drop episodes with NaN/inf values instead of refusing them.
        drop_empty: drop zero-length episodes instead of refusing them.
        reward: a reward function ``"module:function"`` (``--reward``) for data scored
            while training (text rollouts); None: the dataset's own verifier.
    """

    model: Optional[str] = None
    drop_nonfinite: bool = False
    drop_empty: bool = False
    reward: Optional[str] = None


@dataclasses.dataclass
class LoadedData:
    """What :meth:`DataKind.load` returns.

    Attributes:
        data: the dataset object handed to the algorithm's ``build(config, data)``; it
            has ``replay_buffer(batch_size, *, sampler, slice_len, seed, device)``.
        data_kwargs: the loader arguments, saved with the run so it reloads the same data.
    """

    data: Any
    data_kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a training batch is drawn from the replay buffer.

    Attributes:
        batch_size: elements per batch (for ``slice``: windows times ``slice_len``).
        sampler: ``"random"`` (independent elements) or ``"slice"`` (contiguous windows
            of one episode, TorchRL's ``SliceSampler``).
        slice_len: the window length for ``"slice"``.
    """

    batch_size: int
    sampler: str = "random"
    slice_len: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class CurvePanel:
    """One panel of a run's ``learning_curve.png``: which ``metrics.csv`` columns it draws.

    Attributes:
        ylabel: the panel's axis label.
        columns: columns drawn where present, in this order.
        prefixes: also every column starting with one of these (sorted).
        first_only: draw only the first of ``columns`` present (a score, else its fallback).
        log: a symmetric-log y axis (losses spanning decades).

    >>> CurvePanel("loss", ("train/loss",), prefixes=("train/loss_",)).select(
    ...     ["step", "train/loss_qvalue", "train/loss_actor", "eval/return_mean"])
    ['train/loss_actor', 'train/loss_qvalue']
    """

    ylabel: str
    columns: tuple = ()
    prefixes: tuple = ()
    first_only: bool = False
    log: bool = False

    def select(self, available) -> list:
        """The columns of ``available`` this panel draws, in drawing order."""
        have = set(available)
        named = [c for c in self.columns if c in have]
        if self.first_only:
            return named[:1]
        named += sorted(c for c in have if c not in named and any(c.startswith(p) for p in self.prefixes))
        return named


#: the training losses: every ``train/loss_*`` term, and TorchRL's single ``train/loss``
LOSS_PANEL = CurvePanel("loss", ("train/loss",), prefixes=("train/loss_",), log=True)


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """The value of the config field ``name``, or ``default`` when the config has no such field.

    A data kind documents the config fields it reads (``batch_size``, ``slice_len``...);
    an algorithm that wants another value declares the field in its config dataclass.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class C:
    ...     batch_size: int = 64
    >>> config_value(C(), "batch_size", 256), config_value(C(), "slice_len", 20)
    (64, 20)
    """
    if dataclasses.is_dataclass(config) and name in {f.name for f in dataclasses.fields(config)}:
        return getattr(config, name)
    if isinstance(config, dict) and name in config:
        return config[name]
    return default


def pct(x) -> str:
    """A share as a percentage with one decimal, ``n/a`` for None.

    >>> pct(0.875), pct(None)
    ('87.5%', 'n/a')
    """
    return "n/a" if x is None else f"{100 * x:.1f}%"


def figures(result: dict, label: str, key: str, fmt=pct) -> list:
    """The CLI's figure ``label before -> after`` (or ``label after``) of ``result[key]``: a training
    summary's ``key_before``/``key_after`` or an evaluation's ``key``; empty when it has neither.

    >>> figures({"exact_match_before": 0.5, "exact_match_after": 0.75}, "exact match", "exact_match")
    ['exact match 50.0% -> 75.0%']
    >>> figures({"kl_to_reference": 0.1234}, "KL to reference", "kl_to_reference", fmt="{:.3f}".format)
    ['KL to reference 0.123']
    """
    after = result.get(f"{key}_after", result.get(key))
    if after is None:
        return []
    before = result.get(f"{key}_before")
    return [f"{label} {fmt(before)} -> {fmt(after)}" if before is not None else f"{label} {fmt(after)}"]


def result_line(result: dict, figures: list) -> str:
    """``ALGO on DATASET[, N steps, seed S]: figure, figure[ in W s; wrote OUT]``: the CLI's line
    for a training summary (which has ``steps`` and ``wall_s``) or an evaluation result.

    >>> result_line({"algorithm": "dpo", "dataset": "d", "step": 5}, ["accuracy 90%"])
    'dpo on d: accuracy 90%'
    """
    head = f"{result['algorithm']} on {result['dataset']}"
    if "steps" in result:
        head += f", {result['steps']} steps, seed {result['seed']}"
    tail = f" in {result['wall_s']:.0f} s; wrote {result['out_dir']}" if "wall_s" in result else ""
    return f"{head}: {', '.join(figures)}{tail}"


class DataKind(abc.ABC):
    """One kind of training data. Subclass it and implement its abstract methods (``resolve``,
    ``load``, ``evaluation``, ``evaluate``); a subclass missing one cannot be instantiated.

    Class attributes:
        name: the kind's name, as ``AlgorithmSpec.data`` writes it (``"transitions"``).
        summary: one line for ``offline-plugins list --kinds``.
        description: what a dataset of this kind is, as a phrase for error messages
            (``"a preference dataset (prompts and responses)"``).
        train_hint: what to do with a dataset of this kind, for an algorithm that reads
            another (``"train a preference algorithm on it (dpo, ...)"``).
        config_fields: the config fields it reads, with what for (shown in docs and
            ``info``); an algorithm declares the ones it wants to set.

    ``provider``, ``version`` and ``plugin`` are filled in by the plugin host.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    description: ClassVar[str] = ""
    train_hint: ClassVar[str] = ""
    config_fields: ClassVar[dict[str, str]] = {"batch_size": "elements per gradient step (default 256)"}

    def __init__(self) -> None:
        self.provider = ""
        self.version = ""
        self.plugin = ""

    # -- the dataset id ----------------------------------------------------------
    def claims(self, dataset: str) -> bool:
        """Whether the id ``dataset`` is recognisably of this kind by its form alone (a ``.jsonl``
        path, an ``hf:`` prefix), without reading a store or the network. The shell asks the
        other kinds before resolving an id, to refuse one meant for another kind's algorithms."""
        return False

    @abc.abstractmethod
    def resolve(self, dataset: str, *, spec, registry) -> tuple[str, Optional[str]]:
        """``(canonical id, action space or None)`` of ``dataset``; raises a ``UserError`` if unknown."""

    def check_options(self, spec, options: DataOptions) -> None:
        """Refuse options that do not apply to this kind (default: refuse all of them)."""
        if options.model is not None:
            raise UserError(f"--model does not apply to {spec.name!r}, which reads {self.name} data: drop --model")
        for flag, on in (("--drop-nonfinite", options.drop_nonfinite), ("--drop-empty", options.drop_empty),
                         ("--reward", options.reward is not None)):
            if on:
                raise UserError(f"{flag} does not apply to {spec.name!r}, which reads {self.name} data: drop {flag}")

    @abc.abstractmethod
    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        """Load (or make) the dataset ``dataset_id`` for ``spec`` with its ``config``."""

    def batch_layout(self, config) -> BatchLayout:
        """The batch size and sampler: ``batch_size`` from the config (default 256), random elements."""
        batch_size = int(config_value(config, "batch_size", 256))
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}; fix it with --set batch_size=256")
        return BatchLayout(batch_size)

    def check_scale(self, config, data, layout: BatchLayout, *, accumulate: int = 1, device: Any = None) -> None:
        """Refuse a run whose batches cannot fit (:class:`ScaleError`, one line with the fix), before
        any is made. Default: a micro-batch (``layout.batch_size / accumulate`` elements of the
        data's rows, with room for the networks' activations) against the free memory."""
        td = getattr(data, "td", None)
        if td is None or not hasattr(td, "numel") or td.numel() == 0:
            return
        row = sum(v[0].numel() * v.element_size() for v in td.values(include_nested=True, leaves_only=True))
        micro = -(-layout.batch_size // max(1, accumulate))
        # a batch is copied a few times on its way (sample, device, normalise) and each network
        # keeps its activations for the backward: a few kB per element at the usual widths
        check_memory(micro * (3 * row + 16_384), device=device,
                     what=f"batch_size={layout.batch_size} ({micro} elements of {row} bytes per step)",
                     fix="lower --set batch_size")

    # -- what a checkpoint remembers ---------------------------------------------
    def run_settings(self, data, options: DataOptions) -> dict[str, Any]:
        """Settings saved in the checkpoint's ``run`` record to rebuild the data later."""
        return {}

    def reload_options(self, run: dict) -> DataOptions:
        """The options :meth:`load` needs to rebuild a checkpoint's data from its ``run`` record."""
        return DataOptions()

    # -- evaluation, summary, export ---------------------------------------------
    @abc.abstractmethod
    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        """The Lightning callback that scores the run every ``every`` steps and at the end.

        It keeps its records in ``history`` (a list of dicts with ``step`` and
        ``eval_s``), as :class:`~offline_plugins.kinds.environment.evaluation.PolicyEvaluation` does.
        """

    def datamodule(self, data, parts, *, batch_size: int, seed: int):
        """The kind's own ``LightningDataModule`` streaming the run's batches, or None (default):
        the shell's :class:`~offline_plugins.lightning.data.ReplayDataModule` over
        ``data.replay_buffer(...)``. A kind whose data is made while training (text rollouts:
        :class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`) owns its stream here; the
        module then refuses a ``fit`` without it."""
        return None

    def check_online(self, spec, config, data, *, online_steps: int) -> None:
        """Refuse ``--online-steps`` where the run cannot act online after its offline steps (checked
        before anything is built). Default: this kind has no online phase."""
        if online_steps:
            raise UserError(f"--online-steps: {spec.name!r} trains on {self.name} data, which has no online phase "
                            "(offline-to-online fine-tuning acts in a dataset's environment); drop --online-steps")

    def online_datamodule(self, data, parts, *, batch_size: int, seed: int, offline_steps: int, online_steps: int,
                          config: Any):
        """The data module of an offline-to-online run: ``offline_steps`` on the data, then ``online_steps``
        while acting (:meth:`check_online` passed). Default: none (never asked, as ``check_online`` refuses)."""
        return None

    def callbacks(self, data, parts, *, seed: int) -> list:
        """Further Lightning callbacks the run needs for this data (default none)."""
        return []

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        """The fields this kind adds to ``summary.json`` (the last evaluation's figures)."""
        return {}

    def curve_panels(self) -> list:
        """The panels of the run's ``learning_curve.png``, top to bottom (:class:`CurvePanel`):
        by default what the evaluation logs under ``eval/`` above the training losses."""
        return [CurvePanel("held-out evaluation", prefixes=("eval/",)), LOSS_PANEL]

    def export(self, parts, out: Path) -> dict[str, Any]:
        """Write the trained policy for other tools under ``out``; returns the summary fields
        naming what was written (default: nothing beyond the checkpoint)."""
        return {}

    @abc.abstractmethod
    def evaluate(self, module, data, *, episodes: int, seed: int, device: str) -> dict[str, Any]:
        """Score a trained module (rebuilt from a checkpoint) as the run's evaluation did."""

    def describe(self, result: dict) -> str:
        """The CLI's one line for a training summary or an evaluation result."""
        return f"{result.get('algorithm')} on {result.get('dataset')}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.summary, "class": f"{type(self).__module__}:{type(self).__name__}",
                "config_fields": dict(self.config_fields), "provider": self.provider, "version": self.version,
                "plugin": self.plugin}
