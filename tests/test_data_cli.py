"""``offline-plugins data list | make | info`` and the recipe plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("minari")

from offline_plugins.cli import main  # noqa: E402
from offline_plugins.plugins import load_registry  # noqa: E402


@pytest.fixture()
def store(monkeypatch, minari_store):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    return minari_store


def test_recipes_are_registered_with_all_tiers():
    registry = load_registry()
    tiers = {s.tier for s in registry.datasets.values() if s.env_id == "Pendulum-v1" and s.provider == "offline-plugins"}
    assert tiers == {"random", "medium", "medium-replay", "expert", "medium-expert"}
    spec = registry.dataset("offline-plugins/pendulum/medium-replay-v0")
    assert spec.provider == "offline-plugins" and spec.plugin == "datasets" and spec.action_space == "continuous"


def test_recipes_module_imports_no_torch():
    code = "import sys, offline_plugins.data.recipes, offline_plugins.cli.data; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_make_then_info_then_list(store, capsys):
    assert main(["data", "make", "pendulum/expert-v0", "--episodes", "2", "--no-progress", "--force", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["id"] == "offline-plugins/pendulum/expert-v0" and made["episodes"] == 2 and made["steps"] == 400

    assert main(["data", "info", "offline-plugins/pendulum/expert-v0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 2 and info["steps"] == 400 and info["env_id"] == "Pendulum-v1"
    assert info["ref_min_score"] < info["return_mean"] <= info["return_max"]
    assert info["return_min"] <= info["return_mean"]
    assert "Box" in info["observation_space"] and info["action_kind"] == "continuous"

    assert main(["data", "info", "pendulum/expert-v0"]) == 0
    text = capsys.readouterr().out
    assert "reference scores:" in text and "(random)" in text and "(expert)" in text

    assert main(["data", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in listed["preference_datasets"]] == ["offline-plugins/arithmetic/preference-v0",
                                                                "offline-plugins/arithmetic-length/preference-v0",
                                                                "offline-plugins/word-problems/preference-v0"]
    # the online algorithms' text tasks too, each with what it is
    tasks = {r["id"]: r["summary"] for r in listed["text_tasks"]}
    assert "calculator" in tasks["offline-plugins/tool-arithmetic/v0"] and "offline-plugins/arithmetic/v0" in tasks
    assert "GSM8K" in tasks["offline-plugins/word-problems/v0"] and "calculator" in tasks[
        "offline-plugins/word-problems-calculator/v0"]
    rows = {r["id"]: r for r in listed["datasets"]}
    assert rows["offline-plugins/pendulum/expert-v0"]["local"] and rows["offline-plugins/pendulum/expert-v0"]["steps"] == 400
    assert not rows["offline-plugins/pendulum/medium-expert-v0"]["local"]
    assert main(["data", "list"]) == 0
    text = capsys.readouterr().out
    assert "medium-replay" in text and "not made" in text
    assert "preference datasets" in text and "offline-plugins/arithmetic/preference-v0" in text


def test_make_is_deterministic_for_a_seed(store):
    import numpy as np

    from offline_plugins.data import load_offline_data

    def build(seed):
        assert main(["data", "make", "pendulum/medium-expert-v0", "--episodes", "2", "--seed", str(seed), "--no-progress", "--force"]) == 0
        return load_offline_data("pendulum/medium-expert-v0", progress=False).td

    a, b, c = build(1), build(1), build(2)
    np.testing.assert_array_equal(a["action"].numpy(), b["action"].numpy())
    np.testing.assert_array_equal(a["observation"].numpy(), b["observation"].numpy())
    assert not np.array_equal(a["observation"].numpy(), c["observation"].numpy())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data", "info", "pendulum/medum-v0"], "Did you mean 'offline-plugins/pendulum/medium-v0'"),
        (["data", "make", "nothing/here-v0"], "unknown dataset 'nothing/here-v0'"),
        (["data", "info", "offline-plugins/pendulum/medium-expert-v1"], "Did you mean"),
    ],
)
def test_bad_input_is_one_line_exit_2(store, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("offline-plugins: error:") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_make_refuses_to_overwrite_without_force(store, capsys):
    assert main(["data", "make", "pendulum/random-v0", "--episodes", "1", "--no-progress", "--force"]) == 0
    capsys.readouterr()
    assert main(["data", "make", "pendulum/random-v0", "--episodes", "1", "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err
