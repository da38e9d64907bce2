"""Data kinds: the shell asks one object per kind of data, and a plugin can add a kind."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from offline_plugins.cli import main
from offline_plugins.plugins import AlgorithmSpec, UnknownNameError, load_registry
from offline_plugins.plugins.manager import make_plugin_manager

SRC = Path(__file__).resolve().parents[1] / "src" / "offline_plugins"


@pytest.fixture
def toy_registry(monkeypatch):
    """The installed plugins plus the test plugin of tests/_toy_kind_plugin.py; the CLI sees it too."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import _toy_kind_plugin
    finally:
        sys.path.pop(0)

    host = make_plugin_manager()
    host.register(_toy_kind_plugin, "toy-kind", "toy-dist", "1.0")
    registry = load_registry(host=host)

    import offline_plugins.plugins.manager as manager

    # every shared_registry() of this test discovers this registry, wherever the name was imported
    manager.forget_shared_registries()
    monkeypatch.setattr(manager, "load_registry", lambda disable=None, **_: registry)
    yield registry
    manager.forget_shared_registries()


def test_the_built_in_kinds_are_registered_with_their_provider():
    registry = load_registry()
    assert {"transitions", "trajectories", "preference-pairs", "unpaired-feedback"} <= set(registry.data_kinds)
    kind = registry.data_kind("transitions")
    assert kind.plugin == "offline_plugins.kinds" and kind.provider == "offline-plugins"
    # every built-in algorithm reads a kind some plugin provides
    for spec in registry.algorithms.values():
        assert registry.kind_of(spec).name == spec.data


def test_a_plugin_kind_trains_evaluates_summarises_and_exports_through_the_shell(toy_registry, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "toy-linreg", "--dataset", "toy-vectors:400", "--steps", "150", "--eval-every", "50",
                 "--out", str(out), "--no-progress", "--threads", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_kind"] == "labelled-vectors"
    # the kind's own figures, not an environment's
    assert summary["train_rows"] == 320 and "return_mean" not in summary
    assert summary["heldout_mse"] < 0.05, summary  # learnt y = x . w (variance of y is about 14)
    assert [r["step"] for r in summary["eval_history"]] == [50, 100, 150]
    weights = torch.load(summary["weights"], weights_only=True)
    assert torch.allclose(weights.flatten(), torch.tensor([1.0, -2.0, 0.5, 3.0]), atol=0.1)
    assert f"toy-linreg on toy-vectors:400: held-out MSE {summary['heldout_mse']:.4f}" in printed

    code = main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["data_kind"] == "labelled-vectors"
    assert result["heldout_mse"] == pytest.approx(summary["heldout_mse"], rel=1e-5)

    assert main(["list", "--kinds"]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"labelled-vectors\s+toy-dist 1.0\s+rows of \(x, y\)", listed) and "read by: toy-linreg" in listed


def test_another_kinds_dataset_is_refused_naming_both_kinds(toy_registry, tmp_path, capsys):
    code = main(["train", "iql", "--dataset", "toy-vectors:100", "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "r").exists()
    assert "'iql' reads transitions data" in err and "'toy-vectors:100' is a toy regression dataset" in err
    assert "train toy-linreg on it" in err


def test_an_algorithm_whose_kind_no_plugin_provides_is_refused_by_name(tmp_path):
    from dataclasses import make_dataclass

    from offline_plugins.lightning.plan import plan_run

    registry = load_registry()
    spec = AlgorithmSpec(name="grpo-ish", summary="", family="online-llm", data="video-frames", loss="a:b",
                         build="a:b", config=make_dataclass("C", []))
    with pytest.raises(UnknownNameError, match="'grpo-ish' reads video-frames data, which no installed plugin"):
        plan_run(spec, "anything", registry=registry)
    with pytest.raises(ValueError, match="data must name a data kind"):
        AlgorithmSpec(name="x", summary="", family="offline-rl", data="Two Words", loss="a:b", build="a:b",
                      config=make_dataclass("C", []))


def test_old_extra_keys_move_to_the_typed_fields_with_a_deprecation_warning():
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup

    groups = [OptimizerGroup("critic", [], 1e-3, ("loss_q",)), OptimizerGroup("actor", [], 1e-3, ("loss_a",), every=2)]
    with pytest.warns(DeprecationWarning, match="target_update_every=..., lr_schedulers=..."):
        parts = AlgorithmParts(loss=None, policy=None, optimizers=groups,
                               extra={"target_update_every": 3, "lr_schedulers": [print], "planner": "kept"})
    assert parts.target_update_every == 3 and parts.lr_schedulers == (print,) and parts.extra == {"planner": "kept"}
    assert parts.target_period() == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = AlgorithmParts(loss=None, policy=None, optimizers=groups)
    assert typed.target_period() == 2  # the delayed actor's period


def test_the_shell_asks_the_data_kind_and_tests_no_family_or_algorithm_name():
    """lightning/ holds no branch on a family, a data kind's name or an algorithm's suffix."""
    patterns = [r"\.family\b", r"_PREFERENCE_KINDS", r"_TRAINABLE_KINDS", r"-discrete", r"\.data\s*(==|in)\s",
                r"hasattr\([^)]*\"rewards\"", r"\.extra\.get\(", r"\.extra\["]
    for path in sorted((SRC / "lightning").glob("*.py")):
        text = path.read_text()
        for pattern in patterns:
            assert not re.search(pattern, text), f"{path.name} matches {pattern!r}"


def test_a_kind_missing_part_of_the_contract_cannot_be_made():
    from offline_plugins.kinds import DataKind

    class Half(DataKind):
        name = "half"

        def resolve(self, dataset, *, spec, registry):
            return dataset, None

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_each_kind_names_the_panels_of_its_learning_curve():
    from offline_plugins.plugins import shared_registry

    kinds = shared_registry().data_kinds
    env = ["eval/normalized_score", "eval/return_mean", "train/loss_actor", "train/loss_qvalue"]
    assert [p.select(env) for p in kinds["transitions"].curve_panels()] == [
        ["eval/normalized_score"], ["train/loss_actor", "train/loss_qvalue"]]
    # a dataset without reference scores: the raw return; the Decision Transformer's single "loss"
    assert [p.select(["eval/return_mean", "train/loss"]) for p in kinds["trajectories"].curve_panels()] == [
        ["eval/return_mean"], ["train/loss"]]
    pref = ["eval/preference_accuracy", "eval/likelihood_accuracy", "train/loss_dpo", "eval/kl_to_reference"]
    assert [p.select(pref) for p in kinds["preference-pairs"].curve_panels()] == [
        ["eval/preference_accuracy", "eval/likelihood_accuracy"], ["train/loss_dpo"]]
    online = ["eval/exact_match", "rollout/reward_mean", "rollout/kl_to_reference", "train/loss_objective"]
    assert [p.select(online) for p in kinds["text-rollouts"].curve_panels()] == [
        ["eval/exact_match", "rollout/reward_mean"], ["rollout/kl_to_reference", "train/loss_objective"]]
    # a kind that says nothing draws what its evaluation logs under eval/ above the losses
    from offline_plugins.plugins.datakind import DataKind

    assert [p.select(["eval/heldout_mse", "train/loss_mse"]) for p in DataKind.curve_panels(None)] == [
        ["eval/heldout_mse"], ["train/loss_mse"]]


def test_a_score_panel_is_labelled_by_the_score_it_drew(tmp_path, monkeypatch):
    """The environment kinds' top panel draws the first of success rate, normalised score and return that
    the run logged, and its axis says which (not the whole fallback list, which did not fit the figure)."""
    from matplotlib.axes import Axes

    from offline_plugins.lightning.outputs import plot_learning_curve
    from offline_plugins.plugins import shared_registry

    labels = []
    real = Axes.set_ylabel
    monkeypatch.setattr(Axes, "set_ylabel",
                        lambda self, text, *a, **k: (labels.append(text), real(self, text, *a, **k))[1])
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,eval/success_rate,eval/return_mean,train/loss_actor\n99,0.4,-150,1.0\n199,0.8,-120,0.9\n")
    panels = shared_registry().data_kinds["transitions"].curve_panels()
    plot_learning_curve(csv, tmp_path / "curve.png", panels=panels)
    assert labels[0] == "success rate" and (tmp_path / "curve.png").stat().st_size > 0
