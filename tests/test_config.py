"""Config dataclasses: --set parsing, YAML files, type checks, error text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from offline_plugins.config import (
    ConfigError,
    apply_overrides,
    config_field,
    config_to_dict,
    describe_config,
    load_config_file,
    parse_set_args,
)


@dataclass
class Cfg:
    expectile: float = config_field(0.7, "expectile of the value regression")
    steps: int = config_field(1000, "gradient steps")
    normalize: bool = config_field(True, "normalise observations")
    hidden: tuple = config_field((256, 256), "hidden widths")
    name: str = config_field("iql", "run name")
    clip: Optional[float] = config_field(None, "gradient clip, none for no clipping")


def test_describe_lists_defaults_and_help():
    rows = {r["name"]: r for r in describe_config(Cfg)}
    assert rows["expectile"]["default"] == 0.7
    assert rows["expectile"]["help"] == "expectile of the value regression"
    assert rows["hidden"]["default"] == [256, 256]


def test_overrides_are_typed():
    cfg = apply_overrides(
        Cfg(),
        parse_set_args(["expectile=0.9", "steps=5", "normalize=false", "hidden=[64]", "name=x", "clip=1"]),
    )
    assert (cfg.expectile, cfg.steps, cfg.normalize, cfg.hidden, cfg.name) == (0.9, 5, False, (64,), "x")
    assert cfg.clip == 1
    assert apply_overrides(cfg, {"clip": "none"}).clip is None
    assert config_to_dict(cfg)["hidden"] == [64]


@pytest.mark.parametrize(
    "items, message",
    [
        (["expectlie=0.9"], "unknown config key 'expectlie' for Cfg; did you mean 'expectile'?"),
        (["steps=ten"], "config key 'steps' of Cfg expects int"),
        (["steps=1.5"], "config key 'steps' of Cfg expects int"),
        (["normalize=maybe"], "expects true/false"),
        (["steps"], "--set expects key=value, got 'steps'"),
    ],
)
def test_bad_overrides_name_the_key(items, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("[", r"\[")):
        apply_overrides(Cfg(), parse_set_args(items))


def test_yaml_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("expectile: 0.8\nhidden: [32, 32]\n")
    assert apply_overrides(Cfg(), load_config_file(good)).hidden == (32, 32)
    bad = tmp_path / "bad.yaml"
    bad.write_text("expectile: [0.8\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config_file(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config_file(listy)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "missing.yaml")


def test_a_key_set_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("expectile: 0.8\nhidden: [32, 32]\nexpectile: 0.9\n")
    with pytest.raises(ConfigError, match=r"sets 'expectile' twice \(lines 1 and 3\).*keep one"):
        load_config_file(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("outer:\n  a: 1\n  a: 2\n")
    with pytest.raises(ConfigError, match=r"sets 'a' twice \(lines 2 and 3\)"):
        load_config_file(nested)
    merged = tmp_path / "merged.yaml"  # a YAML merge key is not a key set twice
    merged.write_text("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n")
    assert load_config_file(merged)["other"] == {"x": 1, "y": 2}
