"""What a run guarantees when the user, the machine or a crafted file works against it.

The table ``BAD_INPUTS`` holds one CLI input per row: each must end in one
``offline-plugins: error:`` line naming the input, exit 2, and write nothing; adding a
case is one line. The other tests cover the guards that need a file, a signal or a
second process: checkpoints that carry code, interrupted runs, the run-folder lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from _lightning_fixtures import TINY_SPEC, FakeOfflineData
from lightning.pytorch import Callback

from offline_plugins.cli import main
from offline_plugins.lightning.guards import RunError, RunFolderLock, RunInterrupted
from offline_plugins.lightning.run import load_checkpoint, train_algorithm

torch.set_num_threads(1)

DATASET = "pendulum/medium-replay-v0"
QUIET = dict(progress=False, eval_episodes=1, eval_every=0, seed=0)


@pytest.fixture()
def store(monkeypatch, minari_store):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    return minari_store


def _cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _one_error_line(code, err, match):
    assert code == 2, err
    assert "internal error" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("offline-plugins: error:") and match in err, err


# -- the table of bad inputs -------------------------------------------------------
# (arguments after 'train', text the one error line must hold); {tmp} is a private folder
BAD_INPUTS = [
    (["iql", "--dataset", DATASET, "--devices", "999"], "--devices 999 asks for 999 CPU processes"),
    (["iql", "--dataset", DATASET, "--accelerator", "tpu"], "--accelerator 'tpu' is not one"),
    (["iql", "--dataset", DATASET, "--out", "{tmp}/a-file"], "is an existing file, not a folder"),
    (["iql", "--dataset", DATASET, "--out", "{tmp}/a-file/run"], "is a file, so no folder can be made under it"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/nope.ckpt"], "does not exist"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/code.ckpt"], "holds pickled Python objects"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/no-dataset.ckpt"], "lacks 'offline_plugins.dataset'"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/no-lightning.ckpt"], "lacks 'pytorch-lightning_version'"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/truncated.ckpt"], "could not be read"),
    (["iql", "--dataset", DATASET, "--resume", "{tmp}/random.ckpt"], "could not be read"),
    (["dpo", "--dataset", "arithmetic/preference-v0", "--drop-nonfinite"], "--drop-nonfinite applies to Minari"),
    (["iql", "--dataset", DATASET, "--set", "lrr=1"], "unknown config key 'lrr'"),
    (["iqll", "--dataset", DATASET], "did you mean 'iql'"),
    (["iql", "--dataset", DATASET, "--set", "steps=5"], "an option of the run: pass --steps 5"),
    (["iql", "--dataset", DATASET, "--set", "seed=3"], "pass --seed 3"),
    (["iql", "--dataset", DATASET, "--out", "{tmp}/r", "--resume", "--overwrite"], "contradict each other"),
    (["iql", "--dataset", DATASET, "--reward", "m:f"], "--reward applies to algorithms trained on their own rollouts"),
    (["iql", "--dataset", DATASET, "--precision", "8"], "--precision '8' is not one of"),
    (["dpo", "--dataset", "arithmetic", "--strategy", "deepspeed", "--accelerator", "cpu"],
     "--strategy deepspeed needs CUDA"),
    (["iql", "--dataset", DATASET, "--strategy", "horovod"], "--strategy 'horovod' is not one of"),
    (["iql", "--dataset", DATASET, "--precision", "16-mixed", "--accelerator", "cpu"], "needs a CUDA GPU"),
    (["iql", "--dataset", DATASET, "--seed", "99999999999999999999"], "--seed must be a whole number from 0 to "
                                                                       "4294967295 (numpy's seed range)"),
    (["iql", "--dataset", DATASET, "--seed", "-3"], "--seed must be a whole number from 0 to 4294967295"),
    (["grpo", "--dataset", "tool-python", "--set", "tool_sandbox=nope"], "tool_sandbox: unknown sandbox 'nope'"),
    (["grpo", "--dataset", "arithmetic", "--set", "reward_workers=fork"], "reward_workers must be one of thread, process"),
]


class _RunsCode:
    """Unpickling this calls ``open(marker, 'w')``: what a crafted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _bad_files(tmp, marker):
    (tmp / "a-file").write_text("not a folder\n")
    torch.save({"offline_plugins": {"algorithm": "iql"}, "state_dict": {}, "payload": _RunsCode(str(marker))},
               tmp / "code.ckpt")
    good = {"state_dict": {}, "global_step": 3, "epoch": 0, "loops": {}, "optimizer_states": [],
            "pytorch-lightning_version": "2.6.0",
            "offline_plugins": {"algorithm": "iql", "dataset": "offline-plugins/" + DATASET, "config": {}, "seed": 0}}
    no_dataset = {**good, "offline_plugins": {k: v for k, v in good["offline_plugins"].items() if k != "dataset"}}
    torch.save(no_dataset, tmp / "no-dataset.ckpt")
    torch.save({k: v for k, v in good.items() if k != "pytorch-lightning_version"}, tmp / "no-lightning.ckpt")
    torch.save(good, tmp / "whole.ckpt")
    (tmp / "truncated.ckpt").write_bytes((tmp / "whole.ckpt").read_bytes()[:40])
    (tmp / "random.ckpt").write_bytes(bytes(range(256)) * 8)  # no pickle of code: not "holds pickled objects"


@pytest.mark.parametrize("args, match", BAD_INPUTS, ids=[" ".join(a)[:60] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, store, args, match):
    marker = tmp_path / "code-ran"
    _bad_files(tmp_path, marker)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "run"
    extra = [] if "--out" in args else ["--out", str(out)]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = _cli(capsys, "train", *args, *extra, "--no-progress")
    _one_error_line(code, err, match)
    assert not marker.exists(), "the checkpoint's code ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_eval_of_a_checkpoint_carrying_code_runs_nothing(capsys, tmp_path):
    marker = tmp_path / "code-ran"
    _bad_files(tmp_path, marker)
    code, _, err = _cli(capsys, "eval", str(tmp_path / "code.ckpt"))
    _one_error_line(code, err, "weights_only=True")
    assert "open" in err  # names what it would have called
    assert not marker.exists()
    # the same file through pickle would have run it: the test's payload is real
    torch.load(tmp_path / "code.ckpt", weights_only=False)
    assert marker.exists()


def test_eval_of_an_uninstalled_plugin_names_the_package(capsys, tmp_path):
    summary = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "r", steps=2, **QUIET)
    ckpt = torch.load(summary["checkpoint"], weights_only=True)
    assert ckpt["offline_plugins"]["provider"] == TINY_SPEC.provider
    ckpt["offline_plugins"].update(algorithm="awacx", provider="awacx-plugin", provider_version="1.2")
    torch.save(ckpt, tmp_path / "foreign.ckpt")
    code, _, err = _cli(capsys, "eval", str(tmp_path / "foreign.ckpt"))
    # (TorchRL's logger may complain here about pytest's closed capture of an earlier test)
    _one_error_line(code, err.splitlines()[-1], "pip install 'awacx-plugin==1.2'")
    assert "did you mean" not in err


def test_resume_with_another_algorithm_or_config_says_what_differs(tmp_path):
    out = tmp_path / "r"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=3, overrides=["hidden=8"], **QUIET)
    with pytest.raises(RunError, match=r"does not fit this run's networks .*config differs in hidden \(checkpoint 8, now 16\)"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=6, overrides=["hidden=16"], resume=True, **QUIET)
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["offline_plugins"]["algorithm"] = "iql"
    torch.save(ckpt, tmp_path / "other.ckpt")
    with pytest.raises(RunError, match=r"is a run of 'iql' .*not of 'tiny-td3bc'"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=6, overrides=["hidden=8"],
              resume=tmp_path / "other.ckpt", **QUIET)
    # the refused resumes changed nothing: the run still resumes as it should
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 3


# -- interruption ------------------------------------------------------------------
class _SignalAt(Callback):
    """Send this process ``signum`` once, at the end of step ``step`` (a real signal)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_its_step_and_resumes_exactly(tmp_path, signum):
    kw = dict(QUIET, seed=2, eval_every=10, log_every=5)
    # whatever the handlers were before the run (SIG_IGN under nohup or in a background job)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(RunInterrupted, match=r"interrupted by SIG(INT|TERM) at step 12 of 30.*--resume") as err:
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "cut", steps=30, callbacks=[_SignalAt(12, signum)], **kw)
    assert err.value.exit_code == 130
    partial = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert partial["interrupted"] is True and partial["steps"] == 12 and partial["steps_requested"] == 30
    assert load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.ckpt")["global_step"] == 12
    assert {s: signal.getsignal(s) for s in before} == before  # our handlers are gone again
    resumed = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "cut", steps=30, resume=True, **kw)
    straight = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "straight", steps=30, **kw)
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    assert a["global_step"] == b["global_step"] == 30
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert "interrupted" not in json.loads((tmp_path / "cut" / "summary.json").read_text())


def test_ctrl_c_on_the_cli_exits_130_and_prints_how_to_resume(tmp_path, store):
    from offline_plugins.data import load_offline_data

    load_offline_data(DATASET, progress=False)  # made once in the session store, outside the timing
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", "iql", "--dataset", DATASET, "--steps", "100000",
           "--set", "hidden=[16,16]", "--set", "batch_size=32", "--checkpoint-every", "20", "--out", str(out),
           "--threads", "1", "--no-progress", "--eval-episodes", "1", "--eval-every", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        import time

        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "last.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("offline-plugins: interrupted by SIGINT at step "), err
    assert f"--out {out} --resume" in last and "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and load_checkpoint(summary["checkpoint"])["global_step"] == summary["steps"]


# -- one run per folder ----------------------------------------------------------------
def test_a_second_run_into_a_folder_in_use_is_refused_before_writing(tmp_path):
    out = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from offline_plugins.lightning.guards import RunFolderLock
            lock = RunFolderLock({str(out)!r}).acquire()
            print("locked", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunError, match=rf"output folder '{out}' is in use by another run \(pid {holder.pid}\)"):
            train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=2, **QUIET)
        assert sorted(p.name for p in out.iterdir()) == [RunFolderLock.NAME]  # the other run's folder untouched
    finally:
        holder.communicate("done\n", timeout=30)
    # the lock died with its holder: the folder is free again
    assert train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=2, **QUIET)["steps"] == 2


def test_read_only_out_is_refused_before_the_data_is_loaded(capsys, tmp_path, store):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        probe = target / "probe"
        try:
            probe.write_text("")  # root writes anywhere: use a folder the kernel refuses instead
            probe.unlink()
            target = "/sys/offline-plugins-run"
            if os.access("/sys", os.W_OK) and os.path.isdir("/sys"):
                try:
                    open("/sys/.offline-plugins-probe", "w").close()
                    pytest.skip("no folder on this machine refuses writes")
                except OSError:
                    pass
        except OSError:
            target = str(target / "run")
        code, _, err = _cli(capsys, "train", "iql", "--dataset", "pendulum/never-made-v0", "--out", str(target),
                            "--no-progress")
        _one_error_line(code, err, "cannot write in")  # before the unknown dataset is even looked at
    finally:
        (tmp_path / "ro").chmod(0o755)


# -- non-finite data ------------------------------------------------------------------
def test_train_drops_nonfinite_episodes_when_asked_and_reports_them(capsys, tmp_path, store):
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(0)
    episodes = []
    for k in range(6):
        obs = rng.normal(size=(21, 3)).astype(np.float32)
        rewards = rng.normal(size=20)
        if k in (1, 4):
            rewards[3] = np.nan
        episodes.append(EpisodeBuffer(id=k, observations=obs, actions=rng.uniform(-2, 2, (20, 1)).astype(np.float32),
                                      rewards=rewards, terminations=np.zeros(20, bool),
                                      truncations=np.r_[np.zeros(19, bool), True]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minari.create_dataset_from_buffers("user/nanpend-v0", episodes, env=gym.make("Pendulum-v1").spec,
                                          ref_min_score=-1500.0, ref_max_score=-150.0)
    args = ["train", "bc", "--dataset", "user/nanpend-v0", "--steps", "3", "--eval-episodes", "1",
            "--no-progress", "--threads", "1"]
    code, _, err = _cli(capsys, *args, "--out", str(tmp_path / "refused"))
    _one_error_line(code, err, "--drop-nonfinite")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, out, err = _cli(capsys, *args, "--out", str(tmp_path / "run"), "--drop-nonfinite")
    assert code == 0, err
    assert "dropped from user/nanpend-v0: 2 episode(s) (2 non-finite step(s)) with NaN/inf values" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dropped"] == {"empty_episodes": 0, "nonfinite_episodes": 2, "nonfinite_steps": 2}


def test_unknown_disabled_plugin_names_are_warned_about(capsys, monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_DISABLE", "offline_plugins.algorithms.iqll")
    assert main(["list"]) == 0
    err = capsys.readouterr().err
    assert "offline-plugins: warning: OFFLINE_PLUGINS_DISABLE/--disable names 'offline_plugins.algorithms.iqll'" in err
    assert "did you mean 'offline_plugins.algorithms.iql'" in err


def test_the_main_job_prints_no_lightning_banner(capsys, tmp_path):
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "r", steps=2, **QUIET)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "GPU available" not in text and "litlogger" not in text and "Initialized LazyTensorStorage" not in text


# -- messages name only flags that exist ------------------------------------------
def _all_flags():
    import argparse

    from offline_plugins.cli import build_parser

    flags, todo = set(), [build_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return flags


def test_every_flag_the_package_names_exists_on_the_cli():
    import re
    from pathlib import Path

    import offline_plugins

    flags = _all_flags()
    named = {}
    for path in Path(offline_plugins.__file__).parent.rglob("*.py"):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", path.read_text()):
            named.setdefault(flag, path.name)
    # another program's command line: bubblewrap's, which the tool sandbox builds (text/tools/sandbox.py) and nothing else names
    other = {f for f, where in named.items() if where == "sandbox.py" and f not in flags}
    assert "--unshare-net" in other and "--die-with-parent" in other
    unknown = {f: where for f, where in named.items() if f not in flags and f not in other}
    assert not unknown, f"flags named in the package but missing on the CLI: {unknown}"
    assert {"--drop-nonfinite", "--drop-empty", "--verbose"} <= flags


def test_two_runs_started_into_one_folder_at_once_one_is_refused(tmp_path):
    # two real processes race for the same --out: exactly one trains, the other is refused cleanly
    out = tmp_path / "shared"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        import torch
        torch.set_num_threads(1)
        from _lightning_fixtures import TINY_SPEC, FakeOfflineData
        from offline_plugins.errors import UserError
        from offline_plugins.lightning.run import train_algorithm
        try:
            s = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir={str(out)!r}, steps=40, progress=False,
                      eval_every=0, eval_episodes=1, seed=int(sys.argv[1]))
            print("trained", s["seed"])
        except UserError as exc:
            print("refused", exc)
            sys.exit(2)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for seed in (1, 2)]
    results = [(p.wait(timeout=300), (p.communicate()[0].strip().splitlines() or [""])[-1]) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    winner = next(text for rc, text in results if rc == 0)
    loser = next(text for rc, text in results if rc == 2)
    assert "already holds a run" in loser or "is in use by another run" in loser, loser
    summary = json.loads((out / "summary.json").read_text())
    assert winner == f"trained {summary['seed']}"  # the folder holds the winner's run, whole
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["offline_plugins"]["seed"] == summary["seed"]


def test_overwrite_replaces_only_the_earlier_runs_files(tmp_path):
    out = tmp_path / "run"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=2, **QUIET)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="--overwrite to replace it"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=3, **QUIET)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # the refused run changed nothing
    summary = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=3, overwrite=True, **QUIET)
    assert summary["steps"] == 3 and json.loads((out / "summary.json").read_text())["steps"] == 3
    assert (out / "notes.txt").read_text() == "mine"  # what the run did not write is left alone


def test_train_as_a_library_call_gives_back_threads_environment_and_rngs(tmp_path, monkeypatch):
    import random

    import numpy as np

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OFFLINE_PLUGINS_RUN_DIR", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    torch.set_num_threads(2)
    try:
        torch.manual_seed(123)
        random.seed(5)
        np.random.seed(6)
        expected = (torch.rand(1), random.random(), np.random.rand())
        torch.manual_seed(123)
        random.seed(5)
        np.random.seed(6)
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "r", steps=3, threads=1, **QUIET)
        assert torch.get_num_threads() == 2
        assert not {"OMP_NUM_THREADS", "OFFLINE_PLUGINS_RUN_DIR", "PL_GLOBAL_SEED"} & set(os.environ)
        assert (torch.rand(1), random.random(), np.random.rand()) == expected
    finally:
        torch.set_num_threads(1)
