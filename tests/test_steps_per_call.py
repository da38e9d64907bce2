"""Several gradient steps per Lightning ``training_step`` (``steps_per_call``): the run is
the one of one step per call, bit for bit -- parameters, optimiser state, logged metrics,
evaluation and checkpoint steps -- also when ``--steps`` is not a multiple of K, across a
resume and under DDP; bad values are refused.

Run as a script (``python tests/test_steps_per_call.py OUT K``) it is the DDP run of the
slow test: Lightning's launcher re-runs it for the second rank.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_fixtures import TINY_SPEC, FakeOfflineData  # noqa: E402
from _ranks import SaveRankState, ranks_in_sync  # noqa: E402

from offline_plugins.lightning.run import load_checkpoint, train_algorithm  # noqa: E402

torch.set_num_threads(1)

QUIET = dict(progress=False, eval_episodes=1, seed=0)
SMALL = {"iql": ["hidden=[16,16]", "batch_size=32"], "td3-bc": ["hidden=[16,16]", "batch_size=32"]}


def _spec(name):
    from offline_plugins.plugins import load_registry

    return load_registry().algorithm(name)


class RecordCalls(Callback):
    """What each ``training_step`` was handed, and the step of every checkpoint saved."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.saved_at: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from offline_plugins.lightning.data import StepBatches

        self.calls.append((batch.start, len(batch)) if isinstance(batch, StepBatches) else (trainer.global_step, 1))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved_at.append(int(trainer.global_step))


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _run(tmp_path, name, k, *, algorithm="td3-bc", steps=11, record=None, **kw):
    spec = TINY_SPEC if algorithm == "tiny" else _spec(algorithm)
    kw = {**QUIET, "eval_every": 0, **kw}
    if algorithm in SMALL:
        kw.setdefault("overrides", SMALL[algorithm])
    callbacks = [record] if record is not None else []
    return train_algorithm(spec, FakeOfflineData(), out_dir=tmp_path / name, steps=steps, steps_per_call=k,
                 callbacks=callbacks, **kw)


def _assert_same_run(a: dict, b: dict, *, history: bool = True) -> None:
    """Two summaries of runs that must be equal: parameters, optimiser state, metrics
    (``history``: also every logged row and evaluation; a resumed run has one more, where it stopped)."""
    ca, cb = load_checkpoint(a["checkpoint"]), load_checkpoint(b["checkpoint"])
    assert ca["global_step"] == cb["global_step"]
    assert ca["state_dict"].keys() == cb["state_dict"].keys()
    for key in cb["state_dict"]:
        assert torch.equal(ca["state_dict"][key], cb["state_dict"][key]), key
    sa, sb = ca["optimizer_states"][0]["state"], cb["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    for i in sb:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[i][field]), torch.as_tensor(sb[i][field])), (i, field)
    assert ca["offline_plugins"]["target_updater"].keys() == cb["offline_plugins"]["target_updater"].keys()
    assert a["losses"] == b["losses"] and a["return_mean"] == b["return_mean"]
    if history:
        assert _rows(Path(a["metrics_csv"])) == _rows(Path(b["metrics_csv"]))
        # timings (eval_s, ms_per_action...) differ from run to run
        strip = lambda h: [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("ms_"))} for r in h]  # noqa: E731
        assert strip(a["eval_history"]) == strip(b["eval_history"])


# -- the stream -----------------------------------------------------------------
def test_the_stream_hands_out_the_one_step_batches_in_calls_ending_on_every_period():
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from offline_plugins.lightning.data import ReplayBufferStream, StepBatches

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=5)
    rb.extend(TensorDict({"x": torch.arange(100)}, [100]))
    one = [b["x"] for b in ReplayBufferStream(rb, seed=4, rank=1, start_step=3, stop_step=20)]
    calls = list(ReplayBufferStream(rb, seed=4, rank=1, start_step=3, stop_step=20, steps_per_call=4, periods=(6, 0)))
    assert all(isinstance(c, StepBatches) for c in calls)
    # ends at multiples of 4 and of 6, and at the stop step
    assert [(c.start, len(c)) for c in calls] == [(3, 1), (4, 2), (6, 2), (8, 4), (12, 4), (16, 2), (18, 2)]
    many = [b["x"] for c in calls for b in c.batches]
    assert len(many) == len(one) == 17 and all(torch.equal(x, y) for x, y in zip(one, many))


# -- the same run ---------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["iql", "td3-bc"])
def test_four_steps_per_call_train_exactly_as_one(tmp_path, algorithm):
    # 11 steps (not a multiple of 4), evaluations every 5, checkpoints every 7, logs every 3
    kw = dict(algorithm=algorithm, steps=11, eval_every=5, checkpoint_every=7, log_every=3)
    one_rec, four_rec = RecordCalls(), RecordCalls()
    one = _run(tmp_path, "one", 1, record=one_rec, **kw)
    four = _run(tmp_path, "four", 4, record=four_rec, **kw)
    _assert_same_run(one, four)
    assert one["steps"] == four["steps"] == 11
    assert [h["step"] for h in four["eval_history"]] == [5, 10, 11]
    assert four_rec.saved_at == one_rec.saved_at and 7 in four_rec.saved_at
    assert one_rec.calls == [(t, 1) for t in range(11)]
    # calls end at multiples of 4, of the evaluation and checkpoint periods, and at --steps
    assert four_rec.calls == [(0, 4), (4, 1), (5, 2), (7, 1), (8, 2), (10, 1)]
    assert one["steps_per_call"] == 1 and four["steps_per_call"] == 4
    assert load_checkpoint(four["checkpoint"])["offline_plugins"]["run"]["steps_per_call"] == 4
    assert len(_rows(Path(four["metrics_csv"]))) > 3  # the training rows (steps 3, 6, 9) and the evaluations


def test_a_call_never_runs_past_max_steps(tmp_path):
    record = RecordCalls()
    summary = _run(tmp_path, "r", 8, algorithm="tiny", steps=13, record=record)
    assert summary["steps"] == 13 and load_checkpoint(summary["checkpoint"])["global_step"] == 13
    assert record.calls == [(0, 8), (8, 5)]


def test_a_run_resumed_mid_way_and_with_another_k_is_exact(tmp_path):
    kw = dict(algorithm="td3-bc", eval_every=5, log_every=2)
    _run(tmp_path, "cut", 4, steps=7, **kw)
    assert load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.ckpt")["global_step"] == 7
    resumed = _run(tmp_path, "cut", 3, steps=13, resume=True, **kw)
    straight = _run(tmp_path, "straight", 1, steps=13, **kw)
    _assert_same_run(resumed, straight, history=False)
    assert [h["step"] for h in resumed["eval_history"]] == [5, 7, 10, 13]
    # the rows of the training terms are the uninterrupted run's
    trained = lambda s: [r for r in _rows(Path(s["metrics_csv"])) if r.get("train/loss_qvalue")]  # noqa: E731
    assert trained(resumed) == trained(straight)


class _SigtermAfterStep(Callback):
    """Send this process SIGTERM once, after gradient step ``step``: inside a call of several steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_gradient_step(self, trainer, pl_module, losses) -> None:
        if trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_inside_a_call_stops_at_its_end_and_resumes_exactly(tmp_path):
    from offline_plugins.lightning.guards import RunInterrupted

    kw = dict(algorithm="td3-bc", steps=20, eval_every=0, log_every=5)
    with pytest.raises(RunInterrupted, match=r"at step 12 of 20"):
        _run(tmp_path, "cut", 4, record=_SigtermAfterStep(10), **kw)
    assert load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.ckpt")["global_step"] == 12
    resumed = _run(tmp_path, "cut", 4, resume=True, **kw)
    straight = _run(tmp_path, "straight", 1, **kw)
    _assert_same_run(resumed, straight, history=False)


def test_the_non_finite_guard_names_the_same_step_with_several_steps_per_call(tmp_path):
    from offline_plugins.lightning.callbacks import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"step 1: loss_qvalue = nan"):
        train_algorithm(TINY_SPEC, FakeOfflineData(nan_reward=True), out_dir=tmp_path / "nan", steps=20, steps_per_call=4,
              eval_every=0, **QUIET)


def test_the_progress_bar_follows_calls_of_several_steps(tmp_path, capsys):
    summary = _run(tmp_path, "bar", 4, algorithm="tiny", steps=10, progress=True)
    assert summary["steps"] == 10
    shown = capsys.readouterr()
    assert "train: 100%" in shown.out + shown.err and "10/10" in shown.out + shown.err


# -- the default and bad values -------------------------------------------------
def test_the_default_is_recorded_and_a_batch_hooking_callback_gets_one_step_per_call(tmp_path):
    from offline_plugins.lightning.module import DEFAULT_STEPS_PER_CALL

    summary = _run(tmp_path, "default", None, algorithm="tiny", steps=4)
    assert summary["steps_per_call"] == DEFAULT_STEPS_PER_CALL
    saved = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert saved["steps_per_call"] == DEFAULT_STEPS_PER_CALL
    assert load_checkpoint(summary["checkpoint"])["offline_plugins"]["run"]["steps_per_call"] == DEFAULT_STEPS_PER_CALL
    record = RecordCalls()  # overrides on_train_batch_start: it expects one step per call
    hooked = _run(tmp_path, "hooked", None, algorithm="tiny", steps=4, record=record)
    assert hooked["steps_per_call"] == 1 and record.calls == [(t, 1) for t in range(4)]


@pytest.mark.parametrize("value", ["0", "-3", "abc", "2.5"])
def test_a_bad_steps_per_call_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, value):
    from offline_plugins.cli import main

    out = tmp_path / "run"
    code = main(["train", "iql", "--dataset", "pendulum/medium-replay-v0", "--steps", "2", "--steps-per-call", value,
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("offline-plugins: error: --steps-per-call"), err
    assert repr(value) in err
    assert not out.exists()


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4"])
def test_the_api_refuses_a_bad_steps_per_call(tmp_path, value):
    from offline_plugins.errors import UserError
    from offline_plugins.lightning.module import AlgorithmModule

    with pytest.raises(UserError, match="steps_per_call"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "r", steps=2, steps_per_call=value, **QUIET)
    assert not (tmp_path / "r").exists()
    parts = TINY_SPEC.load_build()(TINY_SPEC.default_config(), FakeOfflineData())
    with pytest.raises(UserError, match="steps_per_call"):
        AlgorithmModule(parts, steps_per_call=value)


# -- DDP ------------------------------------------------------------------------
def _ddp_run(out: Path, k: int) -> None:
    train_algorithm(_spec("td3-bc"), FakeOfflineData(), steps=10, seed=0, eval_every=0, eval_episodes=1, devices=2,
          accelerator="cpu", out_dir=out, progress=False, steps_per_call=k, overrides=SMALL["td3-bc"],
          callbacks=[SaveRankState(out)])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_cpu_ranks_with_four_steps_per_call_stay_in_sync_and_match_one_step_per_call(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    states = {}
    for k in (1, 4):
        out = tmp_path / f"ddp-k{k}"
        proc = subprocess.run([sys.executable, __file__, str(out), str(k)], env=env, capture_output=True, text=True,
                              timeout=190)
        assert proc.returncode == 0, proc.stderr[-3000:]
        a = ranks_in_sync(out)[0]["state"]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 10 and summary["steps_per_call"] == k
        states[k] = a
    for key in states[1]:
        assert torch.equal(states[1][key], states[4][key]), key


if __name__ == "__main__":
    _ddp_run(Path(sys.argv[1]), int(sys.argv[2]))
