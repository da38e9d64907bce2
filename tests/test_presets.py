"""Named presets (``--set preset=NAME``): a benchmark's published settings applied as config
overrides, the user's own keys still winning, and an unknown preset or an algorithm a preset does
not cover refused in one line."""

from __future__ import annotations

import json

import pytest

from offline_plugins.cli import main
from offline_plugins.errors import UserError
from offline_plugins.presets import preset, presets

DATASET = "offline-plugins/pendulum/medium-replay-v0"


def test_every_shipped_preset_sets_only_fields_its_algorithms_have():
    from offline_plugins.plugins import shared_registry

    registry = shared_registry()
    assert {"ogbench-cube-single", "ogbench-puzzle-3x3", "ogbench-scene"} <= set(presets())
    for name, path in presets().items():
        import yaml

        for algorithm, values in yaml.safe_load(path.read_text()).items():
            fields = {f for f in registry.algorithm(algorithm).default_config().__dataclass_fields__}
            assert set(values) <= fields, (name, algorithm, set(values) - fields)


def test_a_preset_sets_its_values_and_the_users_keys_win(tmp_path, minari_store, capsys):
    out = tmp_path / "run"
    assert main(["train", "rebrac", "--dataset", DATASET, "--steps", "2", "--eval-every", "0", "--eval-episodes", "1",
                 "--set", "preset=ogbench-cube-single", "--set", "critic_bc_coef=0.25", "--set", "hidden=[16, 16]",
                 "--out", str(out), "--no-progress", "--threads", "1"]) == 0, capsys.readouterr().err
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["actor_bc_coef"] == 1.0 and config["actor_lr"] == 3e-4 and config["batch_size"] == 256
    assert config["critic_bc_coef"] == 0.25 and config["hidden"] == [16, 16]  # given with --set
    assert "preset" not in config


def test_an_unknown_preset_and_an_algorithm_a_preset_does_not_cover_meet_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="unknown preset 'nope'; the presets are ogbench-cube-single"):
        preset("nope", "iql")
    with pytest.raises(UserError, match="preset .ogbench-scene. holds settings for bc, fql, not for 'iql'"):
        preset("ogbench-scene", "iql")
    assert main(["train", "iql", "--dataset", DATASET, "--steps", "1", "--set", "preset=ogbench-scene",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "holds settings for bc, fql, not for 'iql'" in err and "Traceback" not in err
