"""Plugin discovery: entry points, block list, duplicates, broken plugins, CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offline_plugins.cli import main
from offline_plugins.plugins import (
    AlgorithmSpec,
    DuplicateNameError,
    PluginError,
    Registry,
    UnknownNameError,
    load_registry,
)
from offline_plugins.plugins.manager import make_plugin_manager

AWR_PROVIDER = "offline-plugins-awr"


def _awr_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution(AWR_PROVIDER)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_awr = pytest.mark.skipif(
    not _awr_installed(),
    reason="pip install ./examples/third_party_plugin (the README's test command does)",
)


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Make an installed distribution on sys.path: a dist-info with entry points plus modules."""

    def make(dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        root = tmp_path / f"site_{dist}"
        root.mkdir()
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[offline_plugins]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for name, source in modules.items():
            (root / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(root))

    return make


PLUGIN_SOURCE = """
from dataclasses import dataclass
from offline_plugins.config import config_field
from offline_plugins.plugins import AlgorithmSpec, hookimpl

@dataclass
class Cfg:
    lr: float = config_field(1e-3, "learning rate")

@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(AlgorithmSpec(name={name!r}, summary="test algorithm", family="offline-rl",
                               data="transitions", loss="torch.nn:MSELoss", build="builtins:print",
                               config=Cfg))
"""


@needs_awr
def test_installed_entry_point_is_discovered_with_its_provider():
    registry = load_registry()
    spec = registry.algorithm("awr")
    assert spec.provider == AWR_PROVIDER
    assert spec.version == "0.1.0"
    assert spec.plugin == "awr"
    assert spec.family == "offline-rl" and spec.data == "transitions"


@needs_awr
def test_list_json_has_one_object_per_algorithm(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))
    assert "awr" in names
    for row in rows:
        assert {"name", "family", "data", "provider"} <= set(row)


@needs_awr
def test_block_list_env_and_flag_remove_the_plugin(monkeypatch, capsys):
    monkeypatch.setenv("OFFLINE_PLUGINS_DISABLE", "something-else, awr")
    assert "awr" not in load_registry().algorithms
    monkeypatch.delenv("OFFLINE_PLUGINS_DISABLE")
    assert "awr" in load_registry().algorithms
    assert main(["--disable", "awr", "list", "--json"]) == 0
    assert "awr" not in [r["name"] for r in json.loads(capsys.readouterr().out)]
    assert main(["--disable", "awr", "info", "awr"]) == 2
    assert "switched off" in capsys.readouterr().err


@needs_awr
def test_third_party_loss_runs_and_learns_on_a_batch():
    import torch
    from tensordict import TensorDict
    from torchrl.data import Bounded, Unbounded

    spec = load_registry().algorithm("awr")
    data = type("Data", (), {})()
    data.observation_spec = Unbounded(shape=(3,))
    data.action_spec = Bounded(low=-2.0, high=2.0, shape=(1,))
    data.action_space = "continuous"
    config = spec.config(hidden=(32, 32))
    parts = spec.load_build()(config, data)
    assert isinstance(parts.loss, spec.load_loss_class())

    torch.manual_seed(0)
    obs = torch.randn(64, 3)
    # good actions (positive return) follow 0.5 * obs[0]; bad ones are noise
    good = torch.rand(64, 1) < 0.5
    action = torch.where(good, 0.5 * obs[:, :1], torch.rand(64, 1) * 4 - 2)
    batch = TensorDict(
        {"observation": obs, "action": action, "return_to_go": good.float() * 2 - 1}, [64]
    )
    optims = [g.make_optimizer() for g in parts.optimizers]
    first = None
    for _ in range(60):
        out = parts.loss(batch)
        total = out["loss_actor"] + out["loss_value"]
        first = total.detach() if first is None else first
        for o in optims:
            o.zero_grad()
        total.backward()
        for o in optims:
            o.step()
    assert out["loss_value"] < first
    action_out = parts.policy(TensorDict({"observation": obs}, [64]))["action"]
    assert action_out.shape == (64, 1)
    assert (action_out.abs() <= 2.0).all()
    # the weighted fit tracks the good actions more than the bad ones
    err_good = (action_out - 0.5 * obs[:, :1])[good.squeeze(-1)].abs().mean()
    err_bad = (action_out - action)[~good.squeeze(-1)].abs().mean()
    assert err_good < err_bad


def test_duplicate_algorithm_name_names_both_providers(fake_dist):
    fake_dist("pkg-one", "1.0", {"one": "plug_one"}, {"plug_one": PLUGIN_SOURCE.format(name="dup")})
    fake_dist("pkg-two", "2.0", {"two": "plug_two"}, {"plug_two": PLUGIN_SOURCE.format(name="dup")})
    registry = load_registry()
    winner = registry.algorithm("dup").provider
    assert winner in ("pkg-one", "pkg-two")
    [broken] = [b for b in registry.broken if b.plugin in ("one", "two")]
    assert broken.stage == "duplicate" and broken.provider != winner
    assert "pkg-one 1.0" in broken.error and "pkg-two 2.0" in broken.error
    with pytest.raises(PluginError, match="registered twice"):
        load_registry(strict=True)


def test_registry_add_raises_on_duplicates():
    from offline_plugins.config import config_field  # noqa: F401
    from dataclasses import make_dataclass

    cfg = make_dataclass("Cfg", [])
    spec = AlgorithmSpec(
        name="x", summary="", family="offline-rl", data="transitions", loss="a:b", build="a:b", config=cfg
    )
    registry = Registry()
    registry.scoped("first", "1", "p1").add(spec)
    with pytest.raises(DuplicateNameError, match="by first 1 .*by second 2"):
        registry.scoped("second", "2", "p2").add(spec)


def test_duplicate_entry_point_name_is_reported_not_silently_skipped(fake_dist):
    fake_dist("pkg-a", "1.0", {"same": "plug_a"}, {"plug_a": PLUGIN_SOURCE.format(name="algo-a")})
    fake_dist("pkg-b", "1.0", {"same": "plug_b"}, {"plug_b": PLUGIN_SOURCE.format(name="algo-b")})
    registry = load_registry()
    loaded = {"algo-a", "algo-b"} & set(registry.algorithms)
    assert len(loaded) == 1
    [broken] = [b for b in registry.broken if b.plugin == "same"]
    assert broken.stage == "duplicate"
    assert "pkg-a" in broken.error and "pkg-b" in broken.error


def test_broken_plugin_does_not_break_the_others(fake_dist, capsys):
    fake_dist("pkg-good", "1.0", {"good": "plug_good"}, {"plug_good": PLUGIN_SOURCE.format(name="fine")})
    fake_dist("pkg-bad", "0.3", {"bad": "plug_bad"}, {"plug_bad": "import not_a_module_anywhere\n"})
    fake_dist(
        "pkg-raises",
        "0.1",
        {"raises": "plug_raises"},
        {
            "plug_raises": """
            from offline_plugins.plugins import hookimpl
            @hookimpl
            def offline_plugins_register_algorithms(registry):
                raise RuntimeError("database offline")
            """
        },
    )
    fake_dist(
        "pkg-typo",
        "0.1",
        {"typo": "plug_typo"},
        {
            "plug_typo": """
            from offline_plugins.plugins import hookimpl
            @hookimpl
            def offline_plugins_register_algorithm(registry):
                pass
            """
        },
    )
    registry = load_registry()
    assert "fine" in registry.algorithms
    broken = {b.plugin: b for b in registry.broken}
    assert broken["bad"].provider == "pkg-bad" and broken["bad"].stage == "import"
    assert "not_a_module_anywhere" in broken["bad"].error
    assert broken["raises"].stage == "register" and "database offline" in broken["raises"].error
    assert broken["typo"].stage == "import" and "misspelt" in broken["typo"].error

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fine" in out
    assert "bad (pkg-bad 0.3) [import]" in out
    assert main(["list", "--json", "--all"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert {b["plugin"] for b in payload["broken"]} >= {"bad", "raises", "typo"}


def test_unknown_algorithm_suggests_close_matches():
    registry = Registry()
    from dataclasses import make_dataclass

    for name in ("iql", "cql", "bcq"):
        registry.scoped("offline-plugins", "0", "p").add(
            AlgorithmSpec(
                name=name,
                summary="",
                family="offline-rl",
                data="transitions",
                loss="a:b",
                build="a:b",
                config=make_dataclass("C", []),
            )
        )
    with pytest.raises(UnknownNameError) as err:
        registry.algorithm("iqll")
    assert str(err.value).startswith("unknown algorithm 'iqll'; did you mean 'iql'")


def test_cli_unknown_name_is_one_line_exit_2_no_traceback(fake_dist):
    fake_dist("pkg-good", "1.0", {"good": "plug_good"}, {"plug_good": PLUGIN_SOURCE.format(name="fine")})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "offline_plugins.cli", "info", "fien"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "unknown algorithm 'fien'; did you mean 'fine'?" in lines[0]


def test_spec_rejects_bad_family_and_non_dataclass_config():
    from dataclasses import make_dataclass

    with pytest.raises(ValueError, match="family 'rl' is not one of"):
        AlgorithmSpec(name="a", summary="", family="rl", data="transitions", loss="a:b", build="a:b",
                      config=make_dataclass("C", []))
    with pytest.raises(ValueError, match="config must be a dataclass"):
        AlgorithmSpec(name="a", summary="", family="offline-rl", data="transitions", loss="a:b",
                      build="a:b", config=dict)


def test_plugin_manager_is_made_by_a_factory_and_runs_check_pending():
    host_a = make_plugin_manager(entry_points=False)
    host_b = make_plugin_manager(entry_points=False)
    assert host_a.pm is not host_b.pm


def test_import_and_listing_load_no_torch():
    """`import offline_plugins` and plugin discovery must not import torch (fast CLI)."""
    code = (
        "import sys, offline_plugins\n"
        "assert 'torch' not in sys.modules, 'import offline_plugins imported torch'\n"
        "from offline_plugins.plugins import load_registry\n"
        "r = load_registry()\n"
        "heavy = [m for m in ('torch', 'torchrl', 'lightning', 'transformers', 'minari') if m in sys.modules]\n"
        "assert not heavy, f'plugin discovery imported {heavy}; {[b.plugin for b in r.broken]}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
