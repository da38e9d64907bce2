"""``train_algorithm(logger=...)`` / ``--logger``: Lightning's TensorBoard, MLflow and W&B loggers beside the
CSV one (which always writes metrics.csv and the learning curve), read back from what they
wrote; a logger whose package is missing is one line naming the extra to install."""

from __future__ import annotations

import csv
import errno
import json
import os
import sys

import pytest
import torch

from _cli_checks import fails_cleanly
from _lightning_fixtures import TINY_SPEC, FakeOfflineData

from offline_plugins.errors import UserError
from offline_plugins.lightning import train_algorithm

torch.set_num_threads(1)

_TERMS = ("train/loss_qvalue", "train/loss_actor")


def _run(tmp_path, logger, name="run"):
    out = tmp_path / name
    summary = train_algorithm(TINY_SPEC, FakeOfflineData(), steps=4, eval_every=2, eval_episodes=1, log_every=1,
                    out_dir=out, progress=False, logger=logger)
    return out, summary


def _csv_steps(out, key):
    with (out / "metrics.csv").open(newline="") as fh:
        return [int(r["step"]) for r in csv.DictReader(fh) if r.get(key)]


def _check_csv_kept(out, summary):
    # whatever else logs, metrics.csv and the learning curve are the CSV logger's, as before
    assert _csv_steps(out, "train/loss_qvalue") == [1, 2, 3, 4]
    assert _csv_steps(out, "eval/return_mean") == [1, 3]
    assert (out / "learning_curve.png").stat().st_size > 0
    assert summary["loggers"]["csv"] == str(out / "metrics.csv")


def test_tensorboard_event_file_holds_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, summary = _run(tmp_path, "tensorboard")
    _check_csv_kept(out, summary)
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and summary["loggers"]["tensorboard"].rstrip("/") == str(out / "tensorboard")
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert set(_TERMS) <= set(tags) and "eval/return_mean" in tags
    assert [e.step for e in acc.Scalars("train/loss_qvalue")] == [1, 2, 3, 4]
    with (out / "metrics.csv").open(newline="") as fh:
        csv_values = [float(r["train/loss_qvalue"]) for r in csv.DictReader(fh) if r.get("train/loss_qvalue")]
    assert [e.value for e in acc.Scalars("train/loss_qvalue")] == pytest.approx(csv_values, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/return_mean")] == [1, 3]


def test_mlflow_file_store_holds_the_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out, summary = _run(tmp_path, "mlflow")
    _check_csv_kept(out, summary)
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("offline-plugins")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.info.run_id in summary["loggers"]["mlflow"]
    # the module's hyperparameters, flattened by Lightning
    assert run.data.params["algorithm"] == "tiny-td3bc" and run.data.params["config/hidden"] == "16"
    history = client.get_metric_history(run.info.run_id, "train/loss_qvalue")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert len(client.get_metric_history(run.info.run_id, "eval/return_mean")) == 2


@pytest.mark.slow
def test_wandb_offline_writes_the_run_locally_and_reaches_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    # a closed local port: any attempt to reach a server would fail rather than leave the machine
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    out, summary = _run(tmp_path, "wandb")
    _check_csv_kept(out, summary)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    assert list(runs[0].glob("run-*.wandb")) and str(runs[0]) in summary["loggers"]["wandb"]
    # the W&B run was finished: a second run in this process gets a run of its own
    again, _ = _run(tmp_path, "wandb", name="again")
    assert len(list((again / "wandb").glob("offline-run-*"))) == 1


def test_several_loggers_at_once_and_each_run_its_own_mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(tmp_path, "mlflow", name="first")
    import os

    # Lightning's logger sets MLflow's process-wide URI; the run puts it back for the next one
    assert "MLFLOW_TRACKING_URI" not in os.environ
    out, summary = _run(tmp_path, "tensorboard,mlflow")
    assert set(summary["loggers"]) == {"csv", "tensorboard", "mlflow"}
    assert list((out / "tensorboard").glob("events.out.tfevents.*")) and (out / "mlruns").is_dir()


@pytest.fixture
def no_tensorboard(monkeypatch):
    # as if neither package were installed: importing them fails
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)


def test_a_missing_logger_package_is_one_line_naming_the_extra(tmp_path, no_tensorboard):
    with pytest.raises(UserError) as err:
        _run(tmp_path, "tensorboard")
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "pip install 'offline-plugins[tensorboard]'" in message and "--logger tensorboard" in message
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_a_missing_logger_package_before_loading_data(capsys, tmp_path, monkeypatch,
                                                                       no_tensorboard):
    import offline_plugins.lightning.plan as plan

    def no_loading(*args, **kwargs):  # the refusal comes before any dataset is loaded or made
        raise AssertionError("plan_run was called")

    monkeypatch.setattr(plan, "plan_run", no_loading)
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", "pendulum/medium-replay-v0", "--logger", "tensorboard",
                  match="pip install 'offline-plugins[tensorboard]'")


def test_the_cli_refuses_an_unknown_logger(capsys, tmp_path):
    from offline_plugins.cli import main

    with pytest.raises(SystemExit) as exit_:  # argparse's usage line and error
        main(["train", "iql", "--dataset", "pendulum/medium-replay-v0", "--logger", "neptune",
              "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unknown logger 'neptune'; choose from csv, tensorboard, mlflow, wandb" in err
    assert not (tmp_path / "run").exists()


def _tb_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_a_resumed_run_continues_the_runs_its_loggers_started(tmp_path, monkeypatch):
    """A run resumed from the checkpoint at step 2 of 4 (the interrupted run had logged steps 3 and
    4 already): TensorBoard's curves are the uninterrupted run's, MLflow keeps one run."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kwargs = dict(steps=4, eval_every=2, eval_episodes=1, log_every=1, progress=False, logger="tensorboard,mlflow",
                  checkpoint_every=2, keep_checkpoints=True)
    straight = tmp_path / "straight"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=straight, **kwargs)
    out = tmp_path / "run"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, **kwargs)
    first = json.loads((out / "loggers.json").read_text())
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, resume=out / "checkpoints" / "step=2.ckpt", **kwargs)

    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    for tag in ("train/loss_qvalue", "eval/return_mean"):
        assert _tb_scalars(out / "tensorboard", tag) == _tb_scalars(straight / "tensorboard", tag), tag
    record = json.loads((out / "loggers.json").read_text())
    run_id = first["mlflow"]["run_id"]
    assert record["mlflow"] == {**first["mlflow"], "resumed_at_steps": [2]}
    client = MlflowClient(record["mlflow"]["tracking_uri"])
    runs = client.search_runs([client.get_experiment_by_name("offline-plugins").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].data.tags["offline_plugins.resumed_at_steps"] == "2"
    # the points logged after the checkpoint stay, the resumed run's come later at the same steps
    history = client.get_metric_history(run_id, "train/loss_qvalue")
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert sorted(last.items()) == _tb_scalars(straight / "tensorboard", "train/loss_qvalue")


def _failing_after(n: int):
    calls = {"n": 0}

    def check() -> None:
        calls["n"] += 1
        if calls["n"] > n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return check


@pytest.mark.parametrize("logger", ["tensorboard", "mlflow"])
def test_a_logger_that_cannot_write_stops_the_run_in_one_line(tmp_path, monkeypatch, logger):
    pytest.importorskip(logger)
    from offline_plugins.data.files import WriteError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    check = _failing_after(6)
    if logger == "tensorboard":
        from tensorboard.summary.writer import record_writer

        write = record_writer.RecordWriter.write
        monkeypatch.setattr(record_writer.RecordWriter, "write", lambda self, data: (check(), write(self, data)))
        where = tmp_path / "run" / "tensorboard"
    else:
        from mlflow.store.tracking import file_store

        log_batch = file_store.FileStore.log_batch
        monkeypatch.setattr(file_store.FileStore, "log_batch", lambda self, *a, **k: (check(), log_batch(self, *a, **k)))
        where = tmp_path / "run" / "mlruns"
    with pytest.raises(WriteError) as err:
        _run(tmp_path, logger)
    text = str(err.value)
    assert "\n" not in text and str(where) in text and "ENOSPC" in text, text
    assert "metrics.csv and the last checkpoint are intact" in text and "--resume" in text
    assert _csv_steps(tmp_path / "run", "train/loss_qvalue")[:1] == [1]  # the rows logged before are kept
