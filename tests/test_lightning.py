"""The training shell: training reduces the loss, delayed groups, target updates,
the non-finite guard, checkpoint contents, exact resume, and evaluation."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from _lightning_fixtures import TINY_SPEC, FakeOfflineData
from offline_plugins.lightning.callbacks import NonFiniteLossError
from offline_plugins.lightning.run import evaluate_checkpoint, load_checkpoint, train_algorithm

torch.set_num_threads(1)

QUIET = dict(progress=False, eval_episodes=1)


def _column(path, key):
    with open(path, newline="") as fh:
        return [float(r[key]) for r in csv.DictReader(fh) if r.get(key)]


def _run(tmp_path, name, **kw):
    kw = {**QUIET, "seed": 0, "eval_every": 0, **kw}
    return train_algorithm(kw.pop("algorithm", TINY_SPEC), kw.pop("data", None) or FakeOfflineData(), out_dir=tmp_path / name, **kw)


def test_training_reduces_the_loss_and_writes_the_run(tmp_path):
    summary = _run(tmp_path, "run", steps=200, log_every=10, eval_every=100)
    out = tmp_path / "run"
    bc = _column(out / "metrics.csv", "train/bc_loss")
    assert len(bc) == 20
    assert sum(bc[-3:]) / 3 < 0.5 * sum(bc[:3]) / 3
    for key in ("algorithm", "dataset", "steps", "seed", "return_mean", "return_std", "normalized_score", "wall_s"):
        assert summary[key] is not None, key
    assert summary["steps"] == 200 and summary["algorithm"] == "tiny-td3bc"
    assert json.loads((out / "summary.json").read_text())["normalized_score"] == summary["normalized_score"]
    assert [h["step"] for h in summary["eval_history"]] == [100, 200]
    assert len(_column(out / "metrics.csv", "eval/normalized_score")) == 2
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert (out / "checkpoints" / "last.ckpt").is_file()


def test_a_delayed_group_sits_out_and_targets_follow(tmp_path):
    # actor_every=2, as TD3: the actor steps at 0-based steps 1, 3...; step 2 moves the critic only
    one = load_checkpoint(_run(tmp_path, "one", steps=2)["checkpoint"])["state_dict"]
    two = load_checkpoint(_run(tmp_path, "two", steps=3)["checkpoint"])["state_dict"]
    actor = [k for k in one if k.startswith("loss_module.actor_network_params")]
    critic = [k for k in one if k.startswith("loss_module.qvalue_network_params")]
    assert actor and critic
    assert all(torch.equal(one[k], two[k]) for k in actor)
    assert not all(torch.equal(one[k], two[k]) for k in critic)
    # SoftUpdate ran: targets moved towards, but are not equal to, the online critic
    k = critic[0]
    target = "loss_module.target_" + k[len("loss_module.") :]
    assert not torch.equal(two[target], two[k])


def test_checkpoint_holds_what_eval_and_resume_need(tmp_path):
    summary = _run(tmp_path, "run", steps=10, eval_every=5, overrides=["hidden=8"])
    ckpt = load_checkpoint(summary["checkpoint"])
    info = ckpt["offline_plugins"]
    assert info["algorithm"] == "tiny-td3bc" and info["dataset"] == "fake/pendulum-v0"
    assert info["config"]["hidden"] == 8 and info["seed"] == 0
    assert set(info["data_state"]) == {"obs_loc", "obs_scale"}
    assert len(ckpt["optimizer_states"]) == 1
    assert [g["name"] for g in ckpt["optimizer_states"][0]["param_groups"]] == ["critic", "actor"]
    assert any(k.startswith("loss_module.target_qvalue") for k in ckpt["state_dict"])
    assert [h["step"] for h in ckpt["callbacks"]["PolicyEvaluation"]["history"]] == [5, 10]
    assert ckpt["global_step"] == 10


def test_resumed_run_ends_with_the_same_parameters(tmp_path):
    kw = dict(seed=3, eval_every=10, log_every=5)
    _run(tmp_path, "cut", steps=15, **kw)
    resumed = _run(tmp_path, "cut", steps=30, resume=True, **kw)
    straight = _run(tmp_path, "straight", steps=30, **kw)
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    assert a["global_step"] == b["global_step"] == 30
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sb)
    assert resumed["return_mean"] == straight["return_mean"]
    # the interrupted run evaluated when it stopped (15); the curve continues across the cut
    assert [h["step"] for h in resumed["eval_history"]] == [10, 15, 20, 30]
    assert len(_column(tmp_path / "cut" / "metrics.csv", "eval/return_mean")) == 4
    assert len(_column(tmp_path / "cut" / "metrics.csv", "train/loss_qvalue")) == 6


def test_non_finite_guard_names_the_step_and_the_term(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"step 1: loss_qvalue = nan"):
        _run(tmp_path, "nan", steps=20, data=FakeOfflineData(nan_reward=True))


@pytest.mark.parametrize("bad_step, end", [(237, 300), (250, 262), (3, 3)])
def test_non_finite_guard_finds_the_earliest_bad_term_across_windows(bad_step, end):
    # the guard's ring buffer is read every check_every steps and at the end: the message
    # names the first bad step and term, also after earlier windows passed their check
    from types import SimpleNamespace

    from offline_plugins.lightning.callbacks import NonFiniteGuard

    guard = NonFiniteGuard(check_every=100)
    strategy = SimpleNamespace(reduce_boolean_decision=lambda found, all: found)
    module = SimpleNamespace(loss_keys=("loss_a", "loss_b", "loss_c"))
    with pytest.raises(NonFiniteLossError, match=rf"step {bad_step}: loss_b = inf"):
        for step in range(1, end + 1):
            trainer = SimpleNamespace(global_step=step, strategy=strategy, world_size=1, global_rank=0)
            losses = torch.tensor([1.0, float(step), 2.0])
            if step >= bad_step:
                losses[1] = float("inf")
                losses[2] = float("nan") if step > bad_step else 2.0
            guard.on_train_batch_end(trainer, module, {"losses": losses}, None, step - 1)
        guard.on_train_end(trainer, module)


def test_eval_of_a_checkpoint_repeats_the_final_evaluation(tmp_path):
    summary = _run(tmp_path, "run", steps=20, eval_episodes=2)
    result = evaluate_checkpoint(summary["checkpoint"], spec=TINY_SPEC, data=FakeOfflineData())
    assert result["episodes"] == 2 and result["step"] == 20
    assert result["return_mean"] == pytest.approx(summary["return_mean"])
    assert result["normalized_score"] == pytest.approx(summary["normalized_score"])


def _sgd_critic_spec():
    """tiny-td3bc whose critic group asks for SGD with momentum instead of Adam."""
    import dataclasses

    from _lightning_fixtures import build_tiny_td3bc
    from offline_plugins.algorithms.base import OptimizerGroup

    class SGDGroup(OptimizerGroup):
        def make_optimizer(self):
            return torch.optim.SGD(self.trainable(), lr=self.lr, momentum=0.9)

    def build(config, data):
        parts = build_tiny_td3bc(config, data)
        critic = parts.optimizers[0]
        parts.optimizers[0] = SGDGroup(critic.name, critic.params, 0.05, critic.loss_keys)
        return parts

    return dataclasses.replace(TINY_SPEC, name="tiny-td3bc-sgd", build=build)


def test_a_group_that_overrides_make_optimizer_gets_its_optimizer_and_resumes_exactly(tmp_path):
    spec = _sgd_critic_spec()
    kw = dict(seed=1, eval_every=0)
    train_algorithm(spec, FakeOfflineData(), out_dir=tmp_path / "cut", steps=10, **QUIET, **kw)
    resumed = train_algorithm(spec, FakeOfflineData(), out_dir=tmp_path / "cut", steps=20, resume=True, **QUIET, **kw)
    straight = train_algorithm(spec, FakeOfflineData(), out_dir=tmp_path / "straight", steps=20, **QUIET, **kw)
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    # one Lightning step per gradient step, though two optimisers stepped
    assert a["global_step"] == b["global_step"] == 20
    (saved,) = b["optimizer_states"]
    sgd, adam = saved["optimizers"]
    assert sgd["param_groups"][0]["momentum"] == 0.9 and sgd["param_groups"][0]["lr"] == 0.05
    assert all("momentum_buffer" in s for s in sgd["state"].values())
    assert all("exp_avg" in s for s in adam["state"].values())
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def test_ddp_zero_weighting_of_an_idle_group_changes_nothing(tmp_path, monkeypatch):
    # Under DDP a group sitting a step out backpropagates with weight 0 and its gradients
    # are dropped (no find_unused_parameters); forced on one process, the run is unchanged
    from offline_plugins.lightning.module import AlgorithmModule

    plain = load_checkpoint(_run(tmp_path, "plain", steps=5)["checkpoint"])
    monkeypatch.setattr(AlgorithmModule, "on_fit_start", lambda self: setattr(self, "_zero_weight_idle", True))
    zeroed = load_checkpoint(_run(tmp_path, "zeroed", steps=5)["checkpoint"])
    for k, v in plain["state_dict"].items():
        assert torch.equal(v, zeroed["state_dict"][k]), k
    sa, sb = plain["optimizer_states"][0]["state"], zeroed["optimizer_states"][0]["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) and sa[i]["step"] == sb[i]["step"] for i in sa)


def test_td3bc_skips_the_actor_on_critic_only_steps_without_changing_the_run(tmp_path, monkeypatch):
    # The shell asks the loss for the due terms only (compute_terms): TD3+BC's critic-only
    # steps skip the actor's forward. The run must equal one computing every term each step
    # (forced here through the DDP zero-weight path, which needs all terms).
    from offline_plugins.lightning.module import AlgorithmModule
    from offline_plugins.objectives.td3_bc import TD3BCLoss
    from offline_plugins.plugins import load_registry

    spec = load_registry().algorithm("td3-bc")
    asked = []
    original = TD3BCLoss.loss_terms
    monkeypatch.setattr(TD3BCLoss, "loss_terms", lambda self, td, keys: asked.append(tuple(keys)) or original(self, td, keys))
    kw = dict(algorithm=spec, steps=4, overrides=["hidden=[16,16]", "batch_size=32"], log_every=1)
    partial = _run(tmp_path, "partial", data=FakeOfflineData(), **kw)
    assert asked == [("loss_qvalue",), ("loss_qvalue", "loss_actor")] * 2
    rows = [r for r in csv.DictReader(open(tmp_path / "partial" / "metrics.csv", newline="")) if r.get("train/loss_qvalue")]
    # a skipped term is logged at its last value (not before its first step), never as NaN
    actor_logged = [float(r["train/loss_actor"]) for r in rows if r.get("train/loss_actor")]
    assert len(rows) == 4 and len(actor_logged) == 3 and actor_logged[1] == actor_logged[0]
    monkeypatch.setattr(AlgorithmModule, "on_fit_start", lambda self: setattr(self, "_zero_weight_idle", True))
    full = _run(tmp_path, "full", data=FakeOfflineData(), **kw)
    a, b = load_checkpoint(partial["checkpoint"]), load_checkpoint(full["checkpoint"])
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k


@pytest.mark.slow
def test_compiled_loss_trains_as_the_eager_one(tmp_path):
    # train_algorithm(compile=True): the loss terms run through torch.compile (both TD3+BC step kinds);
    # the run follows the eager one: same loss values step by step, up to floating-point
    # reordering (parameters are not compared: Adam's first steps turn a rounding-level
    # difference in a near-zero gradient into a full step)
    from offline_plugins.plugins import load_registry

    kw = dict(algorithm=load_registry().algorithm("td3-bc"), steps=6, log_every=1,
              overrides=["hidden=[16,16]", "batch_size=32"])
    _run(tmp_path, "eager", **kw)
    _run(tmp_path, "compiled", compile=True, **kw)
    for key in ("train/loss_qvalue", "train/loss_actor"):
        eager, compiled = _column(tmp_path / "eager" / "metrics.csv", key), _column(tmp_path / "compiled" / "metrics.csv", key)
        assert len(eager) >= 5
        assert compiled == pytest.approx(eager, rel=1e-3, abs=1e-5), key


@pytest.mark.gpu
def test_the_shell_trains_on_cuda_and_its_checkpoint_evaluates(tmp_path):
    # device-agnostic shell: the same run on one GPU (batches moved by Lightning, fused
    # losses, fused Adam and target updates on the device) ends finite and evaluates
    from offline_plugins.plugins import load_registry

    summary = _run(tmp_path, "cuda", algorithm=load_registry().algorithm("td3-bc"), steps=6, accelerator="gpu",
                   devices=1, log_every=1, overrides=["hidden=[16,16]", "batch_size=32"])
    assert summary["return_mean"] is not None
    state = load_checkpoint(summary["checkpoint"])["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    loss_q = _column(tmp_path / "cuda" / "metrics.csv", "train/loss_qvalue")
    assert len(loss_q) == 6 and all(x == x for x in loss_q)


def test_a_group_with_decoupled_weight_decay_decays_as_adamw_and_the_transformers_use_it():
    """AdamW's decay shrinks a weight by lr * wd * w whatever its gradient; Adam's L2 term is a
    gradient, normalised away (a weight with no gradient moves by lr). TT, DT and AD follow their
    references' AdamW; TT also their minGPT's beta2 of 0.95."""
    from offline_plugins.algorithms.base import OptimizerGroup
    from offline_plugins.lightning.module import make_grouped_adam

    def one_step(decoupled: bool) -> float:
        w = torch.nn.Parameter(torch.ones(1))
        opt = make_grouped_adam([OptimizerGroup("g", [w], 0.01, ("loss",), weight_decay=0.1,
                                                decoupled_weight_decay=decoupled)])
        (0.0 * w).sum().backward()
        opt.step()
        return float(w)

    assert one_step(True) == pytest.approx(1 - 0.01 * 0.1, abs=1e-7)
    assert one_step(False) == pytest.approx(1 - 0.01, abs=1e-5)
    from offline_plugins.algorithms.sequence.tt import TTConfig

    assert TTConfig().adam_beta2 == 0.95
