"""A full disk: every file a run or a dataset build rewrites is replaced whole or not at all.

A full disk is simulated without root in two ways: a writer that raises ``OSError(ENOSPC)``
part-way (unit tests), and a child process whose ``RLIMIT_FSIZE`` makes any write past n bytes
fail with ``EFBIG`` (``SIGXFSZ`` ignored), for the CLI end to end.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offline_plugins.cli import main
from offline_plugins.data.errors import DatasetError
from offline_plugins.data.files import WriteError, atomic_folder, atomic_write, atomic_write_text

pytest.importorskip("minari")

torch.set_num_threads(1)

DATASET = "pendulum/medium-v0"
TRAIN = ["--set", "hidden=[16,16]", "--set", "batch_size=32", "--eval-episodes", "1", "--eval-every", "0",
         "--log-every", "1", "--no-progress", "--threads", "1"]


def _disk_full(after: bytes):
    def write(fh):
        fh.write(after)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".partial-" in p.name or ".old-" in p.name)


# -- the writers -------------------------------------------------------------------
def test_a_write_failing_half_way_leaves_the_previous_file_and_says_so_in_one_line(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_text(target, '{"steps": 3}\n')
    with pytest.raises(WriteError) as err:
        atomic_write(target, _disk_full(b'{"steps": 6, "half'), fix="free some space")
    text = str(err.value)
    assert len(text.splitlines()) == 1
    assert str(target) in text and "no space left on device (ENOSPC)" in text and "intact" in text, text
    assert err.value.path == target and err.value.errno == errno.ENOSPC
    assert target.read_text() == '{"steps": 3}\n'
    assert _leftovers(tmp_path) == []


def test_a_full_disk_reported_only_by_fsync_is_caught_before_the_rename(tmp_path, monkeypatch):
    # delayed allocation: write() succeeds and the file system says ENOSPC at fsync/close
    target = tmp_path / "metrics.csv"
    target.write_text("step\n1\n")

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(WriteError, match="metrics.csv: no space left on device"):
        atomic_write_text(target, "step\n1\n2\n")
    assert target.read_text() == "step\n1\n"
    assert _leftovers(tmp_path) == []


def test_an_exported_folder_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    model = tmp_path / "model"
    with atomic_folder(model) as folder:
        (folder / "weights.bin").write_bytes(b"old weights")
    with pytest.raises(WriteError, match="the previous model folder is intact"):
        with atomic_folder(model) as folder:
            _disk_full(b"new wei")(open(folder / "weights.bin", "wb"))
    assert (model / "weights.bin").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_preference_export_swaps_its_model_folder_in_whole(tmp_path):
    from offline_plugins.kinds.preference import PreferenceText

    class Model:
        def __init__(self, payload: bytes, fail: bool) -> None:
            self.payload, self.fail = payload, fail

        def save_pretrained(self, folder) -> None:
            with open(Path(folder) / "model.safetensors", "wb") as fh:
                fh.write(self.payload[:4])
                fh.flush()
                if self.fail:
                    raise OSError(errno.EDQUOT, "Disk quota exceeded")
                fh.write(self.payload[4:])

    class Tokenizer:
        def save_pretrained(self, folder) -> None:
            (Path(folder) / "tokenizer.json").write_text("{}")

    kind = PreferenceText()
    written = kind.export(SimpleNamespace(model=Model(b"old weights", False), tokenizer=Tokenizer()), tmp_path)
    assert written == {"model_dir": str(tmp_path / "model")}
    with pytest.raises(WriteError, match="could not write .*model: disk quota exceeded"):
        kind.export(SimpleNamespace(model=Model(b"new weights", True), tokenizer=Tokenizer()), tmp_path)
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_metrics_csv_keeps_its_history_when_a_new_column_cannot_be_written(tmp_path, monkeypatch):
    from offline_plugins.lightning.files import RunCSVLogger

    logger = RunCSVLogger(save_dir=str(tmp_path), name="", version="")
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    logger.save()
    before = (tmp_path / "metrics.csv").read_text()
    assert before.count("\n") == 4
    # an evaluation adds columns: Lightning rewrites the whole file, here beside it; the disk is full
    logger.log_metrics({"eval/return_mean": -100.0}, step=3)
    real_write = os.write

    def write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", lambda fd: write(fd, b""))
    with pytest.raises(WriteError, match="metrics.csv: no space left"):
        logger.save()
    assert (tmp_path / "metrics.csv").read_text() == before
    # an append of known columns that fails is cut back off
    monkeypatch.undo()
    logger.experiment.metrics = [{"train/loss": 0.1, "step": 4}]
    logger.experiment.metrics_keys = ["step", "train/loss"]
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])) and write(fd, data))
    with pytest.raises(WriteError, match="the rows already in metrics.csv are intact"):
        logger.save()
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_text() == before
    assert _leftovers(tmp_path) == []


# -- a run on a full disk, end to end ----------------------------------------------
_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from offline_plugins.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _limited_cli(limit: int, *argv: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture()
def store(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    return root


def test_a_resume_on_a_full_disk_stops_in_one_line_and_the_run_resumes_later(tmp_path, store, capsys):
    from offline_plugins.lightning.checkpoints import load_checkpoint

    assert main(["data", "make", DATASET, "--steps", "2000", "--no-progress"]) == 0
    out = tmp_path / "run"
    assert main(["train", "iql", "--dataset", DATASET, "--steps", "3", "--out", str(out), *TRAIN]) == 0
    capsys.readouterr()
    ckpt = out / "checkpoints" / "last.ckpt"
    saved = ckpt.read_bytes()
    rows = (out / "metrics.csv").read_text()
    assert rows.count("\n") >= 4
    summary = (out / "summary.json").read_text()

    # the checkpoint at step 6 cannot be written: files past half its size fail with EFBIG
    done = _limited_cli(len(saved) // 2, "train", "iql", "--dataset", DATASET, "--steps", "6", "--out", str(out),
                        "--resume", *TRAIN)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("offline-plugins: error: could not write"), done.stderr[-3000:]
    assert str(ckpt) in err[0] and "EFBIG" in err[0] and "intact" in err[0] and "--resume" in err[0]
    assert ckpt.read_bytes() == saved and load_checkpoint(ckpt, for_resume=True)["global_step"] == 3
    assert (out / "metrics.csv").read_text().startswith(rows)  # the earlier rows are all there
    assert (out / "summary.json").read_text() == summary
    assert _leftovers(out) == []

    # with room again, --resume continues from step 3
    assert main(["train", "iql", "--dataset", DATASET, "--steps", "6", "--out", str(out), "--resume", *TRAIN]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    steps = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()[1:]]
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    trained = sorted(int(r[header.index("step")]) for r in steps if r[header.index("train/loss_value")])
    assert trained == [1, 2, 3, 4, 5, 6]


def test_data_make_on_a_full_disk_is_one_line_and_leaves_no_partial_dataset(tmp_path, store):
    done = _limited_cli(50_000, "data", "make", DATASET, "--steps", "2000", "--no-progress")
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "ulimit -f" in err[0] and "nothing was written" in err[0], done.stderr[-3000:]
    assert not (store / "offline-plugins" / DATASET).exists()
    assert not any(p.name.endswith(".hdf5") for p in store.rglob("*")) if store.exists() else True


def test_data_make_refuses_before_writing_when_the_disk_has_no_room(store, monkeypatch):
    import shutil

    from offline_plugins.data import store as store_module

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    monkeypatch.setattr(store_module, "build_atomically", lambda *a, **k: pytest.fail("the build started"))
    with pytest.raises(DatasetError, match=r"needs about .* which has 1000 B free; nothing was written"):
        store_module.make_dataset(DATASET, progress=False, steps=2000)


def test_a_build_that_hits_a_full_disk_is_one_line_and_removes_its_partial_folder(store, capfd):
    from offline_plugins.data.store import build_atomically

    class H5Object:  # what h5py's objects do once their file could not be written
        def __del__(self):
            raise RuntimeError("Can't decrement id ref count (file write failed: errno = 28, No space left)")

    def build():
        handle = H5Object()  # noqa: F841 - released with the failed build's frame
        (Path(os.environ["MINARI_DATASETS_PATH"]) / "half.hdf5").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DatasetError) as err:
        build_atomically("offline-plugins/pendulum/medium-v0", build)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and "no space left on device (ENOSPC)" in text
    assert "partial build was removed" in text
    assert not (store / ".building").exists() or not any((store / ".building").iterdir())
    assert not (store / "offline-plugins").exists()
    assert "Exception ignored" not in capfd.readouterr().err  # HDF5's complaints are the one line above


def test_a_learning_curve_that_cannot_be_written_is_a_warning_and_the_summary_is_kept(tmp_path, store, capsys,
                                                                                      monkeypatch):
    import matplotlib.figure

    def refused(self, *args, **kwargs):  # the folder became read-only for this user mid-run
        raise PermissionError(errno.EACCES, "Permission denied")

    assert main(["data", "make", DATASET, "--steps", "2000", "--no-progress"]) == 0
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refused)
    out = tmp_path / "run"
    assert main(["train", "iql", "--dataset", DATASET, "--steps", "2", "--out", str(out), *TRAIN]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "learning_curve.png" in line]
    assert len(err) == 1 and err[0].startswith("offline-plugins: warning: could not write")
    assert "permission denied" in err[0] and "the summary is written without it" in err[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learning_curve"] is None and summary["steps"] == 2 and _leftovers(out) == []
