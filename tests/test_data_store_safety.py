"""The local Minari store survives failed, killed and concurrent builds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

minari = pytest.importorskip("minari")

from offline_plugins.data import DatasetError, load_offline_data  # noqa: E402
from offline_plugins.data import build as build_module  # noqa: E402
from offline_plugins.data import store as store_module  # noqa: E402
from offline_plugins.data.store import is_local, local_dataset_ids, make_dataset  # noqa: E402

MEDIUM = "offline-plugins/pendulum/medium-v0"

# A child process: make or load a dataset with a patched build step, so the test can
# catch it midway. Written to a file so the child's tracebacks name real lines.
CHILD = r'''
import hashlib, os, sys, time
from pathlib import Path

import offline_plugins.data.build as build

mode, dataset_id = sys.argv[1], sys.argv[2]
if mode == "hang-after-write":
    real_create = build._create

    def create_then_hang(*args, **kwargs):
        dataset = real_create(*args, **kwargs)
        print("written", flush=True)
        time.sleep(120)
        return dataset

    build._create = create_then_hang
    from offline_plugins.data.store import make_dataset

    make_dataset(dataset_id, episodes=2, progress=False)
else:
    real_rollout = build.rollout_episodes

    def small_rollout(*args, **kwargs):  # two episodes, then wait until the test releases it
        with open(os.environ["BUILD_LOG"], "a") as f:
            f.write(f"{os.getpid()}\n")
        kwargs["episodes"] = 2
        episodes = real_rollout(*args, **kwargs)
        release, deadline = Path(os.environ["RELEASE"]), time.monotonic() + 60
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return episodes

    build.rollout_episodes = small_rollout
    if mode == "load":
        from offline_plugins.data import load_offline_data

        data = load_offline_data(dataset_id, progress=False)
        digest = hashlib.sha256(data.td["observation"].numpy().tobytes()).hexdigest()
        print(data.num_episodes, digest, flush=True)
    else:
        from offline_plugins.cli import main

        sys.exit(main(["data", "make", dataset_id, "--episodes", "2", "--no-progress"]))
'''


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """An empty Minari store private to one test (child processes inherit it)."""
    path = tmp_path / "minari"
    path.mkdir()
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(path))
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return path


@pytest.fixture()
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    def start(mode, dataset_id, **popen):
        return subprocess.Popen([sys.executable, str(script), mode, dataset_id], text=True, **popen)

    return start


def _builds(store: Path) -> list:
    folder = store / ".building"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _episodes(dataset_id: str) -> int:
    return load_offline_data(dataset_id, make_if_missing=False, progress=False).num_episodes


def _wait_for(condition, what: str, proc=None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the child exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("error, direct", [(RuntimeError("disk full"), False), (KeyboardInterrupt(), True)])
def test_failed_force_rebuild_keeps_the_old_dataset(store, monkeypatch, error, direct):
    make_dataset(MEDIUM, episodes=2, progress=False)
    real_create = build_module._create

    def create_then_fail(*args, **kwargs):
        real_create(*args, **kwargs)  # the new dataset is fully written before the failure
        raise error

    monkeypatch.setattr(build_module, "_create", create_then_fail)
    with pytest.raises(type(error)):
        if direct:
            from offline_plugins.plugins import load_registry

            build_module.make_recipe_dataset(load_registry().dataset(MEDIUM), episodes=3, progress=False, force=True)
        else:
            make_dataset(MEDIUM, episodes=3, progress=False, force=True)
    assert os.environ["MINARI_DATASETS_PATH"] == str(store)
    assert local_dataset_ids() == [MEDIUM] and _episodes(MEDIUM) == 2
    assert _builds(store) == []


def test_failed_swap_puts_the_old_dataset_back(store, monkeypatch):
    make_dataset(MEDIUM, episodes=2, progress=False)
    real_rename = os.rename

    def rename(src, dst):
        if ".building" in str(src) and f"{os.sep}store{os.sep}" in str(src):  # the new one moving in
            raise OSError("simulated failure after the old dataset was moved aside")
        real_rename(src, dst)

    with monkeypatch.context() as patch, pytest.raises(OSError, match="simulated"):
        patch.setattr(store_module.os, "rename", rename)
        make_dataset(MEDIUM, episodes=3, progress=False, force=True)
    assert _episodes(MEDIUM) == 2 and _builds(store) == []


def test_swap_killed_midway_is_undone_by_the_next_build(store, monkeypatch):
    make_dataset(MEDIUM, episodes=2, progress=False)
    # what a --force rebuild killed between its two renames leaves: the old dataset moved aside
    folder = store / ".building" / f"{store_module._key(MEDIUM)}+999999999-deadbeef"
    (folder / "previous" / MEDIUM).parent.mkdir(parents=True)
    (folder / "build.json").write_text(f'{{"dataset_id": "{MEDIUM}", "pid": 999999999}}')
    os.rename(store / MEDIUM, folder / "previous" / MEDIUM)
    assert not is_local(MEDIUM)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the dataset was rebuilt instead of put back")

    monkeypatch.setattr(build_module, "_build", no_rebuild)
    assert load_offline_data(MEDIUM, progress=False).num_episodes == 2
    assert _builds(store) == []


@pytest.mark.slow
def test_killed_build_leaves_no_dataset_and_the_next_build_cleans_up(store, child):
    proc = child("hang-after-write", MEDIUM, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "written", "the child failed before writing its dataset"
        partial = [b for b in _builds(store) if (b / "store" / MEDIUM / "data" / "metadata.json").is_file()]
        assert len(partial) == 1
        assert local_dataset_ids() == [] and not is_local(MEDIUM)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Minari warns about misconfigured folders it finds
            assert minari.list_local_datasets() == {}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _builds(store) == partial and not is_local(MEDIUM)

    dataset = make_dataset(MEDIUM, episodes=2, progress=False)  # no --force needed
    assert dataset.total_episodes == 2 and dataset.spec.data_path == str(store / MEDIUM / "data")
    assert local_dataset_ids() == [MEDIUM] and _builds(store) == []


@pytest.mark.slow
@pytest.mark.parametrize("second", ["load", "make"])
def test_concurrent_builds_of_one_missing_dataset(store, child, tmp_path, monkeypatch, second):
    log, release = tmp_path / "builds.log", tmp_path / "release"
    monkeypatch.setenv("BUILD_LOG", str(log))
    monkeypatch.setenv("RELEASE", str(release))
    first = child("load", MEDIUM, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    other = None
    try:
        # the first is building once its log line is written (it then holds the lock)
        _wait_for(lambda: log.is_file() and log.read_text(), "the first build to start", first)
        other = child(second, MEDIUM, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        seen = []
        while not any("waiting for another process building" in line for line in seen):
            line = other.stderr.readline()
            assert line, f"the second process never waited; stderr: {''.join(seen)}"
            seen.append(line)
        assert is_local(MEDIUM) is False  # still building: the first one waits for the release
        release.touch()
        out1, err1 = first.communicate(timeout=120)
        out2, err2 = other.communicate(timeout=120)
    finally:
        for proc in (first, other):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 0, err1
    assert out1.split()[0] == "2"
    assert log.read_text().split() == [str(first.pid)]  # built once, by the first
    wait_line = [line for line in seen if "waiting for another process building" in line][0]
    assert MEDIUM in wait_line and ".locks" in wait_line
    if second == "load":
        assert other.returncode == 0, err2
        assert out2 == out1  # the second loaded the first one's dataset
    else:
        assert other.returncode == 2
        error = [line for line in err2.splitlines() if line.startswith("offline-plugins: error:")]
        assert len(error) == 1 and "already exists" in error[0] and "--force" in error[0]
    assert local_dataset_ids() == [MEDIUM] and _builds(store) == []


def _option_strings(parser) -> set:
    import argparse

    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def test_no_env_message_names_only_existing_cli_flags(store):
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer

    from offline_plugins.cli import build_parser

    T = 5
    episode = EpisodeBuffer(
        id=0,
        observations=np.zeros((T + 1, 2), np.float32),
        actions=np.zeros((T, 1), np.float32),
        rewards=np.zeros(T),
        terminations=np.zeros(T, bool),
        truncations=np.r_[np.zeros(T - 1, bool), True],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minari.create_dataset_from_buffers(
            "user/noenv-v0",
            [episode],
            observation_space=gym.spaces.Box(-1, 1, (2,), np.float32),
            action_space=gym.spaces.Box(-1, 1, (1,), np.float32),
        )
    data = load_offline_data("user/noenv-v0", progress=False)
    with pytest.raises(DatasetError) as e:
        data.make_env()
    message = str(e.value)
    assert "'user/noenv-v0'" in message and "make_env(env_id=" in message and len(message.splitlines()) == 1
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", message))
    assert flags <= _option_strings(build_parser()), f"the message names CLI flags that do not exist: {flags}"
