"""Every installed offline-RL and sequence-model algorithm trains a few steps through
``offline-plugins train`` on a built-in dataset of its action space, and its
checkpoint evaluates. Networks are shrunk with ``--set`` so each run takes seconds
(marked slow: the sweep as a whole takes a minute or two on 2 CPU cores)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offline_plugins.cli import main
from offline_plugins.plugins import load_registry

torch.set_num_threads(1)

_REGISTRY = load_registry()
_TRAINABLE = sorted(
    s.name for s in _REGISTRY.algorithms.values() if s.data in ("transitions", "trajectories")
)


def _dataset_for(spec) -> str | None:
    import importlib.util

    wanted = spec.action_spaces or ("continuous", "discrete")
    # the smallest built-in datasets first: no extra needed (Pendulum, CartPole), medium-replay tier
    for d in sorted(_REGISTRY.datasets.values(), key=lambda d: (bool(d.requires), d.tier != "medium-replay", d.id)):
        if d.action_space in wanted and all(importlib.util.find_spec(r) for r in d.requires):
            return d.id
    return None


def _small(spec) -> list[str]:
    fields = {f.name for f in dataclasses.fields(spec.config)}
    sets = []
    if "hidden" in fields:
        sets.append("hidden=[32,32]")
    window = "context_len" if "context_len" in fields else "slice_len" if "slice_len" in fields else None
    if window:
        sets += [f"{window}=8", "batch_size=32"]
    elif "batch_size" in fields:
        sets.append("batch_size=64")
    small = (("embed_dim", 16), ("num_layers", 1), ("warmup_steps", 2), ("max_ep_len", 250), ("dim", 8),
             ("dim_mults", "[1,2]"), ("n_diffusion_steps", 2), ("n_samples", 2))
    for key, value in small:
        if key in fields:
            sets.append(f"{key}={value}")
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.slow
@pytest.mark.parametrize("name", _TRAINABLE)
def test_short_run_of_every_algorithm(name, tmp_path, capsys, minari_store, monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    spec = _REGISTRY.algorithm(name)
    dataset = _dataset_for(spec)
    if dataset is None:
        pytest.skip(f"no built-in dataset with {spec.action_spaces} actions is installed")
    out = tmp_path / name
    args = ["train", name, "--dataset", dataset, "--steps", "4", "--eval-every", "0", "--eval-episodes", "1"]
    args += [*_small(spec), "--out", str(out), "--no-progress", "--threads", "1", "--log-every", "1"]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["return_mean"] is not None
    assert all(v == v for k, v in summary["losses"].items() if k.startswith("train/loss_")), summary["losses"]
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["return_mean"] == pytest.approx(summary["return_mean"])
