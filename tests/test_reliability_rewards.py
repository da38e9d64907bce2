"""A reward function that raises, exits or hangs: a defined reward for what it failed on, one line
when it fails on everything, and a run that SIGINT/SIGTERM always stop (reliability pass 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offline_plugins.cli import main
from offline_plugins.text.sources.prompts import (
    PromptSource,
    RewardGuard,
    RolloutError,
    RolloutInterrupted,
    score_responses,
)

HERE = Path(__file__).resolve().parent


def length_reward(prompts, responses, **_):
    return [float(len(r)) for r in responses]


def hangs_on_bad(prompts, responses, **_):
    if "bad" in responses:
        time.sleep(3600)
    return [float(len(r)) for r in responses]


def raises_on_bad(prompts, responses, **_):
    if "bad" in responses:
        raise ValueError("cannot score 'bad'")
    return [float(len(r)) for r in responses]


def exits_on_bad(prompts, responses, **_):
    if "bad" in responses:
        sys.exit(0)
    return [float(len(r)) for r in responses]


def always_hangs(prompts, responses, **_):
    if os.environ.get("REWARD_CALLED"):  # tells a test the run is inside its reward call
        Path(os.environ["REWARD_CALLED"]).touch()
    time.sleep(3600)


def always_exits(prompts, responses, **_):
    sys.exit(0)


def _source(fn) -> PromptSource:
    return PromptSource("t", [], fn, fn.__name__, train=[{"prompt": "p"}])


ROWS = [{"prompt": f"q{i}"} for i in range(4)]
RESPONSES = ["aa", "bad", "c", "dddd"]


@pytest.mark.parametrize("fn", [hangs_on_bad, raises_on_bad, exits_on_bad])
def test_only_the_response_the_function_fails_on_loses_its_reward(fn):
    guard = RewardGuard(time_limit=0.3, on_failure=-1.0)
    assert score_responses(_source(fn), ROWS, RESPONSES, guard=guard) == [2.0, -1.0, 1.0, 4.0]
    assert guard.failed == 1
    # the round's call and the bad response's own call ran past the limit
    assert guard.timed_out == (2 if fn is hangs_on_bad else 0)


def test_a_function_that_works_is_called_once_per_round():
    calls = []

    def counted(prompts, responses, **_):
        calls.append(len(responses))
        return length_reward(prompts, responses)

    guard = RewardGuard(time_limit=5)
    assert score_responses(_source(counted), ROWS, RESPONSES, guard=guard) == [2.0, 3.0, 1.0, 4.0]
    assert calls == [4] and guard.counts() == {"reward_failed": 0, "reward_timed_out": 0}


@pytest.mark.parametrize("fn, says, tried", [
    (always_hangs, "ran past its time limit of 0.2 s", "the first response"),  # the shared limit: 2x in all
    (always_exits, "called sys.exit(0)", "each of the first 4 responses")])
def test_a_function_that_fails_on_everything_stops_with_one_line(fn, says, tried):
    started = time.monotonic()
    with pytest.raises(RolloutError, match=f"failed on {tried} scored one at a time") as info:
        score_responses(_source(fn), ROWS * 5, RESPONSES * 5, guard=RewardGuard(time_limit=0.2))
    assert says in str(info.value) and fn.__name__ in str(info.value)
    assert "\n" not in str(info.value)
    # the round's call and 4 single calls, not one per response
    assert time.monotonic() - started < 0.2 * 5 + 2


def test_a_stop_request_ends_the_wait_at_once():
    stop = {"now": False}
    guard = RewardGuard(time_limit=0, should_stop=lambda: stop["now"])  # no limit: only a signal ends it
    import threading

    threading.Timer(0.3, lambda: stop.update(now=True)).start()
    started = time.monotonic()
    with pytest.raises(RolloutInterrupted) as info:
        score_responses(_source(always_hangs), ROWS, RESPONSES, guard=guard)
    assert time.monotonic() - started < 3
    assert info.value.exit_code == 130


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}:"}) + "\n" for a in "abcdefghij" for b in "abcdefghij"))
    return path


_SMALL = ["--set", "group_size=2", "--set", "prompts_per_round=2", "--set", "batch_size=4", "--set",
          "max_new_tokens=2", "--set", "eval_prompts=4", "--steps", "2", "--threads", "1", "--no-progress"]


@pytest.mark.parametrize("fn, says", [("always_exits", "called sys.exit(0)"),
                                      ("always_hangs", "ran past its time limit of 0.3 s")])
def test_the_cli_stops_a_run_whose_reward_always_fails(prompt_file, tmp_path, capsys, monkeypatch, fn, says):
    monkeypatch.syspath_prepend(str(HERE))
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--reward", f"test_reliability_rewards:{fn}",
                 "--set", "reward_timeout=0.3", "--out", str(tmp_path / "run"), *_SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("offline-plugins: error:") and says in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_stops_a_run_hung_in_its_reward(prompt_file, tmp_path, sig):
    """No time limit and a function that never returns: one SIGTERM or Ctrl-C still stops the run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "REWARD_CALLED": str(tmp_path / "called")}
    proc = subprocess.Popen([sys.executable, "-m", "offline_plugins.cli", "train", "grpo", "--dataset", str(prompt_file),
                             "--reward", "test_reliability_rewards:always_hangs", "--set", "reward_timeout=0",
                             "--out", str(tmp_path / "run"), *_SMALL], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # wait until the run is inside its first reward call, then signal once
        while proc.poll() is None and time.monotonic() < deadline and not (tmp_path / "called").exists():
            time.sleep(0.1)
        assert (tmp_path / "called").exists(), "the run never called its reward"
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.strip().splitlines() if line.startswith("offline-plugins")]
    assert proc.returncode == 130, err[-2000:]
    assert lines and "interrupted while reward function" in lines[-1], err[-2000:]


def test_a_function_that_hangs_on_everything_stops_within_about_twice_its_limit():
    started = time.monotonic()
    with pytest.raises(RolloutError, match="ran past its time limit of 1 s.*failed on the first response"):
        score_responses(_source(always_hangs), ROWS * 5, RESPONSES * 5, guard=RewardGuard(time_limit=1.0))
    assert time.monotonic() - started < 2 * 1.0 + 1.5  # about twice the limit; before, five times


def writes_pid_and_hangs(prompts, responses, **_):
    """Hangs on 'bad' after writing its process id to $REWARD_PID."""
    if "bad" in responses:
        Path(os.environ["REWARD_PID"]).write_text(str(os.getpid()))
        time.sleep(3600)
    return [float(len(r)) for r in responses]


def dies_on_bad(prompts, responses, **_):
    if "bad" in responses:
        os._exit(3)  # no exception, no sys.exit: the process is gone
    return [float(len(r)) for r in responses]


def test_process_workers_give_the_rewards_threads_give(monkeypatch):
    guard = RewardGuard(time_limit=30.0, workers="process")
    try:
        assert score_responses(_source(length_reward), ROWS, ["aa", "b", "ccc", ""], guard=guard) == [2.0, 1.0, 3.0, 0.0]
        first = guard._process.proc.pid
        assert score_responses(_source(length_reward), ROWS, ["x"] * 4, guard=guard) == [1.0] * 4
        assert guard._process.proc.pid == first  # one worker process serves the calls
    finally:
        guard.close()


def test_a_call_past_its_limit_is_killed_with_its_process(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("REWARD_PID", str(pid_file))
    guard = RewardGuard(time_limit=2.0, workers="process")
    try:
        values = score_responses(_source(writes_pid_and_hangs), ROWS, RESPONSES, guard=guard)
        assert values == [2.0, 0.0, 1.0, 4.0] and guard.timed_out >= 1
        hung = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # killed, not abandoned: the process is gone (reaped)
            try:
                os.kill(hung, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the reward process {hung} that ran past its limit is still alive")
    finally:
        guard.close()


def test_a_worker_process_that_dies_costs_only_that_response():
    guard = RewardGuard(time_limit=30.0, workers="process")
    try:
        assert score_responses(_source(dies_on_bad), ROWS, RESPONSES, guard=guard) == [2.0, 0.0, 1.0, 4.0]
        assert guard.failed >= 1
    finally:
        guard.close()


def test_process_workers_need_a_function_importable_by_name_and_a_known_mode():
    guard = RewardGuard(workers="process")
    with pytest.raises(RolloutError, match="reward_workers=process .* importable by name"):
        score_responses(_source(lambda prompts, responses, **_: [0.0] * len(responses)), ROWS, RESPONSES, guard=guard)
    with pytest.raises(RolloutError, match="reward_workers must be one of thread, process"):
        RewardGuard(workers="fork")


def test_a_hung_process_reward_stops_within_about_twice_its_limit():
    started = time.monotonic()
    guard = RewardGuard(time_limit=1.0, workers="process")
    try:
        with pytest.raises(RolloutError, match="ran past its time limit of 1 s"):
            score_responses(_source(always_hangs), ROWS * 5, RESPONSES * 5, guard=guard)
    finally:
        guard.close()
    assert time.monotonic() - started < 2 * 1.0 + 4.0  # twice the limit, and the new processes' start-up


def test_the_cli_trains_with_process_workers_and_a_hung_reward_stops_there_too(prompt_file, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    assert main(["train", "grpo", "--dataset", str(prompt_file), "--reward", "test_reliability_rewards:length_reward",
                 "--set", "reward_workers=process", "--out", str(tmp_path / "ok"), *_SMALL]) == 0
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["config"]["reward_workers"] == "process" and summary["reward_mean"] > 0
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--reward", "test_reliability_rewards:always_hangs",
                 "--set", "reward_workers=process", "--set", "reward_timeout=0.5", "--out", str(tmp_path / "hung"),
                 *_SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "worker process was killed" in err[-1], err
