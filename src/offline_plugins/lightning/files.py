"""A run's files survive a full disk: the checkpoint plugin and the CSV logger of
:func:`~offline_plugins.lightning.run.train`.

- :class:`RunCheckpointIO` (Lightning ``CheckpointIO``, passed in ``Trainer(plugins=[...])``)
  writes each checkpoint beside its target, syncs it and renames it over; a full disk, a
  quota or a file-size limit stops the run with one line
  (:class:`~offline_plugins.data.files.WriteError`) and the previous ``last.ckpt`` loads.
- :class:`RunCSVLogger` is Lightning's ``CSVLogger`` whose ``metrics.csv`` keeps its rows:
  new rows are appended and cut back off when the append fails, a new column rewrites the
  file beside it and renames it over (Lightning's own truncates it first, so a full disk
  emptied the history), ``hparams.yaml`` is renamed into place too, and an existing
  ``metrics.csv`` (a resumed run's, trimmed to the rows before its checkpoint) is continued
  rather than deleted.

The other files of a run (``summary.json``, ``learning_curve.png``, the exported model
folder) are written with :mod:`offline_plugins.data.files` by ``train`` and the data kinds.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any, Optional

import torch
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.plugins.io import TorchCheckpointIO

from offline_plugins.data.files import WriteError, atomic_path, atomic_write, is_write_error, write_error

__all__ = ["RESUME_FIX", "RunCheckpointIO", "RunCSVLogger"]

#: what a run's write error tells the user to do
RESUME_FIX = ("free some space (or raise the quota) and continue the run with --resume: it restarts from the last "
              "checkpoint saved, and metrics.csv keeps the rows logged before it")


class RunCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing whole files: the checkpoint is serialised in memory,
    written beside ``path``, synced and renamed over it, so a failed save leaves the previous one
    readable; a full disk (:data:`~offline_plugins.data.files.WRITE_ERRNOS`) is a one-line
    :class:`~offline_plugins.data.files.WriteError`. Remote (``fsspec`` URL) paths are Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)  # serialised before the file is touched
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as exc:
            if is_write_error(exc):
                raise write_error(path, exc, fix=RESUME_FIX) from None
            raise
        atomic_write(path, lambda fh: fh.write(buffer.getbuffer()), fix=RESUME_FIX)


class _RunMetricsWriter(ExperimentWriter):
    """Lightning's CSV ``ExperimentWriter`` with the writes of :class:`RunCSVLogger`."""

    def _check_log_dir_exists(self) -> None:
        # Lightning deletes an existing metrics.csv here; a resumed run's holds the rows logged before its
        # checkpoint (train() trimmed it), which this run continues
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="", encoding="utf-8") as fh:
                self.metrics_keys = sorted(next(csv.reader(fh), []))

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        with atomic_path(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), fix=RESUME_FIX) as partial:
            save_hparams_to_yaml(partial, self.hparams)

    def save(self) -> None:
        if not self.metrics:
            return
        keys_before = list(self.metrics_keys)
        path = self.metrics_file_path
        try:
            new_keys = self._record_new_keys()
            if new_keys or not os.path.isfile(path):
                self._rewrite(path)
            else:
                self._append(path)
        except BaseException:
            self.metrics_keys = keys_before  # the file kept its header; the rows wait for the next save
            raise
        self.metrics = []

    def _rewrite(self, path: str) -> None:
        earlier: list[dict] = []
        if os.path.isfile(path):
            with open(path, newline="", encoding="utf-8") as fh:
                earlier = list(csv.DictReader(fh))

        def write(fh) -> None:
            writer = csv.DictWriter(fh, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(earlier)
            writer.writerows(self.metrics)

        atomic_write(path, write, fix=RESUME_FIX, mode="w")

    def _append(self, path: str) -> None:
        # rows of known columns only: appended in place (no rewrite of the history per flush), and cut back
        # off when the append fails, so the file is as it was
        text = io.StringIO(newline="")
        csv.DictWriter(text, fieldnames=self.metrics_keys).writerows(self.metrics)
        data = memoryview(text.getvalue().encode("utf-8"))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except BaseException as exc:
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass
                if is_write_error(exc):
                    intact = "the rows already in metrics.csv are intact"
                    raise write_error(path, exc, fix=RESUME_FIX, what=intact) from None
                raise
        finally:
            os.close(fd)


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` (``OUT/metrics.csv``, ``OUT/hparams.yaml``) whose files survive a full
    disk and are continued by a resumed run; see :mod:`offline_plugins.lightning.files`."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _RunMetricsWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _RunMetricsWriter(log_dir=self.log_dir)
        return self._experiment

    def finalize(self, status: str) -> None:
        if status != "failed":
            return super().finalize(status)
        try:  # the run is failing already, maybe on this full disk: its own error is the one reported
            super().finalize(status)
        except WriteError:
            pass
