"""Flow Q-learning (``fql``): each loss term against a hand computation on tiny hand-set networks,
the Euler sampler against its closed form, the one-step policy's trade-off between Q and the
flow, TorchRL's ``FQLLoss`` contract point by point, bad inputs, and a short CLI run."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.data import Bounded
from torchrl.modules import ValueOperator
from torchrl.objectives import SoftUpdate
from torchrl.objectives.utils import ValueEstimators

from _synthetic import synthetic_transitions
from offline_plugins.errors import UserError
from offline_plugins.modules import flow
from offline_plugins.objectives.common import HyperparameterError, MissingBatchKeyError
from offline_plugins.objectives.fql import FQLLoss
from offline_plugins.plugins.manager import load_registry

torch.set_num_threads(1)


def _linear(weight, bias=0.0) -> nn.Linear:
    weight = torch.as_tensor(weight, dtype=torch.float32).reshape(1, -1)
    layer = nn.Linear(weight.shape[1], 1)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.fill_(float(bias))
    return layer


def _critic(weight, bias=0.0) -> ValueOperator:
    """``Q(s, a) = w . [s, a] + b`` on a 1-d state and action."""
    return ValueOperator(flow.ConcatMLP(_linear(weight, bias)), in_keys=["observation", "action"])


def _tiny(velocity=(0.0, 0.0, 0.0), actor=(0.0, 0.0), critics=((0.0, 0.0), (0.0, 0.0)), bound=1.0, steps=2, **kw):
    """1-d state and action in [-bound, bound]; the velocity field, actor and critics are linear with
    the given weights on ``[s, x, t]``, ``[s, z]`` and ``[s, a]`` (zero biases but the actor's 2nd weight)."""
    low, high = -bound * torch.ones(1), bound * torch.ones(1)
    v = flow.FlowMatchingPolicy(flow.FlowMatchingModel(_linear(velocity), 1, steps, low=low, high=high))
    mu = flow.OneStepPolicy(flow.OneStepModel(_linear(actor[:2], actor[2] if len(actor) > 2 else 0.0), 1,
                                              low=low, high=high))
    loss = FQLLoss(v, mu, [_critic(c) for c in critics], num_qvalue_nets=len(critics), **kw)
    return loss.make_value_estimator(gamma=0.5)


def _batch(s, a, s_next=None, reward=None, terminated=None, done=None) -> TensorDict:
    col = lambda x: torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1)  # noqa: E731
    n = len(s)
    flags = lambda x: torch.as_tensor(x if x is not None else [False] * n).reshape(-1, 1)  # noqa: E731
    return TensorDict({
        "observation": col(s), "action": col(a),
        ("next", "observation"): col(s_next if s_next is not None else [0.0] * n),
        ("next", "reward"): col(reward if reward is not None else [0.0] * n),
        ("next", "terminated"): flags(terminated),
        ("next", "done"): flags(done if done is not None else terminated),
    }, [n])


@pytest.fixture
def fixed_draws(monkeypatch):
    """Makes the loss's ``randn_like``/``rand_like`` return the values a test sets, in order."""
    queues = {"randn_like": [], "rand_like": []}
    for name, queue in queues.items():
        monkeypatch.setattr(torch, name, lambda t, *a, _q=queue, **k: _q.pop(0).to(t).reshape(t.shape))
    return queues


# each term by hand ---------------------------------------------------------------------------------------

def test_flow_matching_loss_by_hand(fixed_draws):
    # v(s, x, t) = s + x + 2t; x_0 = (1, -1), t = (0.5, 0.25)
    loss = _tiny(velocity=(1.0, 1.0, 2.0))
    fixed_draws["randn_like"].append(torch.tensor([1.0, -1.0]))
    fixed_draws["rand_like"].append(torch.tensor([0.5, 0.25]))
    out = loss.flow_loss(_batch(s=[1.0, 2.0], a=[0.5, -0.5]))
    # x_t = (0.75, -0.875); v = (2.75, 1.625); target a - x_0 = (-0.5, 0.5)
    assert out.item() == pytest.approx((3.25 ** 2 + 1.125 ** 2) / 2)


class _Affine(nn.Module):
    """``v(s, x, t) = lam x + beta t`` counting its calls (the action starts after ``obs_dim`` inputs)."""

    def __init__(self, obs_dim: int, lam: float, beta: float) -> None:
        super().__init__()
        self.obs_dim, self.lam, self.beta, self.calls = obs_dim, lam, beta, 0
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, inputs):
        self.calls += 1
        return self.scale * (self.lam * inputs[..., self.obs_dim:-1] + self.beta * inputs[..., -1:])


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_euler_integration_of_a_linear_field_has_its_closed_form(steps):
    x0 = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]])
    obs = torch.randn(3, 4)
    field = _Affine(4, lam=-0.7, beta=0.0)
    model = flow.FlowMatchingModel(field, 2, steps, low=-100.0, high=100.0)
    # dx/dt = lam x: each Euler step multiplies by (1 + lam / K)
    torch.testing.assert_close(model(obs, x0), x0 * (1 - 0.7 / steps) ** steps)
    assert field.calls == steps  # one batched call per step, not one per sample
    # dx/dt = beta t: the left Riemann sum of beta t, beta (K - 1) / (2K)
    model = flow.FlowMatchingModel(_Affine(4, lam=0.0, beta=3.0), 2, steps, low=-100.0, high=100.0)
    torch.testing.assert_close(model(obs, x0), x0 + 3.0 * (steps - 1) / (2 * steps))


def test_euler_integration_approaches_the_flow_and_is_clipped():
    x0 = torch.tensor([[0.3], [-0.2]])
    fine = flow.FlowMatchingModel(_Affine(1, lam=1.0, beta=0.0), 1, 2000, low=-5.0, high=5.0)
    torch.testing.assert_close(fine(torch.zeros(2, 1), x0), x0 * math.e, rtol=1e-3, atol=0)
    tight = flow.FlowMatchingModel(_Affine(1, lam=1.0, beta=0.0), 1, 10, low=-0.5, high=0.5)
    torch.testing.assert_close(tight(torch.zeros(2, 1), x0), torch.tensor([[0.5], [-0.5]]))


def test_the_loss_samples_the_flow_with_its_own_parameters():
    loss = FQLLoss(flow.FlowMatchingPolicy(flow.FlowMatchingModel(_Affine(1, lam=-0.5, beta=0.0), 1, 5,
                                                                 low=-9.0, high=9.0)),
                   flow.make_one_step_policy(1, Bounded(-torch.ones(1), torch.ones(1), (1,)), (4,)),
                   flow.make_fql_qvalue(1, 1, (4,)))
    with torch.no_grad():
        loss.flow_policy_params["module", "velocity_network", "scale"].fill_(2.0)  # lam = -1 now
    z = torch.tensor([[2.0], [-4.0]])
    torch.testing.assert_close(loss.flow_actions(torch.zeros(2, 1), z), z * (1 - 1 / 5) ** 5)


def test_distillation_term_by_hand(fixed_draws):
    # actions in [-2, 2]: distances in half-range units (/2). The flow's velocity is 0, so its
    # action is clip(z); the actor is mu(s, z) = z + 0.5, read unclipped; the critics are 0
    loss = _tiny(actor=(0.0, 1.0, 0.5), bound=2.0, alpha=3.0)
    fixed_draws["randn_like"].append(torch.tensor([1.0, 4.0]))
    total, meta = loss.actor_loss(_batch(s=[0.3, -0.3], a=[0.0, 0.0]))
    # flow: (1, 2); actor: (1.5, 4.5); ((0.5 / 2)^2, (2.5 / 2)^2)
    torch.testing.assert_close(meta["distillation_loss"], torch.tensor([0.0625, 1.5625]))
    assert total.item() == pytest.approx(3.0 * 0.8125)
    total.backward()
    flow_grads = [p.grad for p in loss.flow_policy_params.values(True, True) if p.requires_grad]
    assert all(g is None for g in flow_grads), "the distillation target must not pass gradients to the flow"


@pytest.mark.parametrize("normalize", [False, True])
def test_q_term_by_hand_with_and_without_normalisation(fixed_draws, normalize):
    # critics Q1 = a, Q2 = 3a (the actor's term averages them: 2a); actor mu = s, clipped to [-1, 1]
    loss = _tiny(actor=(1.0, 0.0), critics=((0.0, 1.0), (0.0, 3.0)), alpha=0.0, normalize_q_loss=normalize)
    fixed_draws["randn_like"].append(torch.zeros(2))
    total, meta = loss.actor_loss(_batch(s=[0.5, 3.0], a=[0.0, 0.0]))
    q = torch.tensor([1.0, 2.0])  # 2 * clip(0.5, 3.0)
    scale = q.abs().mean() if normalize else 1.0
    torch.testing.assert_close(meta["q_loss"], -q / scale)
    assert total.item() == pytest.approx(float(-q.mean() / scale))
    total.backward()
    # d/dw of -mean(2 clip(w s)) / scale at w = 1: the clipped row gives nothing
    grad = loss.actor_network_params["module", "network", "weight"].grad
    assert float(grad[0, 0]) == pytest.approx(-0.5 / float(scale))
    assert all(p.grad is None for p in loss.qvalue_network_params.values(True, True)), "critics are frozen here"


@pytest.mark.parametrize("aggregation, next_value", [("mean", [1.25, -0.625, 3.0]), ("min", [1.0, -0.75, 3.0])])
def test_critic_td_target_by_hand_with_done_masking(aggregation, next_value):
    # Q1 = s + a, Q2 = 3a (targets equal at the start); the next action is mu(s', z) = clip(s'):
    # (0.5, -0.25, 1.0). The second transition terminates (no bootstrap), the third is only
    # truncated (done, not terminated: it bootstraps)
    loss = _tiny(actor=(1.0, 0.0), critics=((1.0, 1.0), (0.0, 3.0)), q_aggregation=aggregation)
    batch = _batch(s=[0.0, 1.0, -1.0], a=[0.5, 0.5, -0.5], s_next=[0.5, -0.25, 2.0], reward=[1.0, 2.0, 3.0],
                   terminated=[False, True, False], done=[False, True, True])
    total, meta = loss.qvalue_loss(batch)
    target = torch.tensor([1.0, 2.0, 3.0]) + 0.5 * torch.tensor([1.0, 0.0, 1.0]) * torch.tensor(next_value)
    torch.testing.assert_close(meta["target_value"], target)
    q = torch.tensor([[0.5, 1.5, -1.5], [1.5, 1.5, -1.5]])
    error = (q - target).pow(2)
    torch.testing.assert_close(meta["td_error"], error.max(0).values)
    assert float(total) == pytest.approx(float(error.mean(0).mean()))
    if aggregation == "mean":
        assert float(total) == pytest.approx(36.890625 / 3)


# the one-step policy's trade-off -------------------------------------------------------------------------

class _ToPoint(nn.Module):
    """The straight-path velocity to the point ``c``, ``(c - x) / (1 - t)``: Euler lands on ``c`` exactly."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.tensor(c))

    def forward(self, inputs):
        x, t = inputs[..., 1:2], inputs[..., 2:3]
        return (self.c - x) / (1 - t)


class _Bowl(nn.Module):
    """``Q(s, a) = -(a - 0.8)^2``."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = nn.Parameter(torch.tensor(0.8))

    def forward(self, observation, action):
        return -(action - self.peak).pow(2)


@pytest.mark.parametrize("alpha", [100.0, 1.0, 0.01])
def test_one_step_policy_trades_q_against_the_flow(alpha):
    """The flow puts all its mass at the data's -0.5, Q peaks at 0.8: the actor minimises
    alpha (a + 0.5)^2 + (a - 0.8)^2, at (0.8 - 0.5 alpha) / (1 + alpha): near the flow for a large
    alpha, near the maximiser of Q for a small one."""
    torch.manual_seed(0)
    spec = Bounded(-torch.ones(1), torch.ones(1), (1,))
    flow_policy = flow.FlowMatchingPolicy(flow.FlowMatchingModel(_ToPoint(-0.5), 1, 10))
    assert float(flow_policy.module(torch.zeros(3, 1), torch.randn(3, 1)).sub(-0.5).abs().max()) < 1e-5
    loss = FQLLoss(flow_policy, flow.make_one_step_policy(1, spec, (16,)),
                   ValueOperator(_Bowl(), in_keys=["observation", "action"]), num_qvalue_nets=1, alpha=alpha)
    loss.make_value_estimator(gamma=0.99)
    optimizer = torch.optim.Adam(loss.actor_network_params.values(True, True), lr=1e-2)
    batch = _batch(s=torch.randn(64).tolist(), a=[-0.5] * 64)
    for _ in range(400):
        total, _ = loss.actor_loss(batch)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    with torch.no_grad(), loss.actor_network_params.to_module(loss.actor_network):
        actions = loss.actor_network.module(batch["observation"])
    best = (0.8 - 0.5 * alpha) / (1 + alpha)
    assert float((actions - best).abs().mean()) < 0.03, (alpha, best, actions.squeeze(-1)[:5])


# TorchRL's FQLLoss contract --------------------------------------------------------------------------------

SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))


def _loss(**kw) -> FQLLoss:
    torch.manual_seed(0)
    loss = FQLLoss(flow.make_flow_policy(3, SPEC, (8,), num_steps=3), flow.make_one_step_policy(3, SPEC, (8,)),
                   flow.make_fql_qvalue(3, 2, (8,)), **kw)
    return loss.make_value_estimator(gamma=0.9)


def _transitions(*shape) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    return TensorDict({
        "observation": torch.randn(*shape, 3, generator=g),
        "action": torch.rand(*shape, 2, generator=g) * 2 - 1,
        ("next", "observation"): torch.randn(*shape, 3, generator=g),
        ("next", "reward"): torch.randn(*shape, 1, generator=g),
        ("next", "done"): torch.rand(*shape, 1, generator=g) < 0.3,
        ("next", "terminated"): torch.zeros(*shape, 1, dtype=torch.bool),
    }, shape)


def test_constructor_is_torchrls():
    params = inspect.signature(FQLLoss).parameters
    assert list(params)[:3] == ["flow_policy", "actor_network", "qvalue_network"]
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name not in list(params)[:3])
    defaults = {name: p.default for name, p in params.items() if p.default is not p.empty}
    assert {k: defaults[k] for k in ("num_qvalue_nets", "alpha", "q_aggregation", "normalize_q_loss", "reduction")} \
        == {"num_qvalue_nets": 2, "alpha": 10.0, "q_aggregation": "mean", "normalize_q_loss": False,
            "reduction": "mean"}


def test_keys_out_keys_and_in_keys_are_torchrls():
    loss = _loss()
    assert {"action", "value", "reward", "done", "terminated", "priority", "priority_weight"} <= {
        f.name for f in dataclasses.fields(loss.tensor_keys)}
    assert loss.out_keys == ["loss_flow", "loss_actor", "loss_qvalue"]
    assert loss.in_keys == ["action", "observation", ("next", "observation"), ("next", "reward"),
                            ("next", "done"), ("next", "terminated")]
    batch = _transitions(4)
    out = loss(batch)
    assert set(out.keys()) == {"loss_flow", "loss_actor", "loss_qvalue", "distillation_loss", "q_loss",
                               "target_value"}
    assert out["distillation_loss"].shape == out["q_loss"].shape == out["target_value"].shape == (4,)
    assert batch["td_error"].shape == (4,) and not batch["td_error"].requires_grad


def test_value_estimator_is_td0_only():
    loss = _loss()
    assert FQLLoss.default_value_estimator is ValueEstimators.TD0
    assert loss.make_value_estimator(ValueEstimators.TD0, gamma=0.5) is loss
    assert float(loss.value_estimator.gamma) == 0.5
    for other in (ValueEstimators.TDLambda, ValueEstimators.GAE):
        with pytest.raises(NotImplementedError):
            loss.make_value_estimator(other)


def test_each_term_reaches_only_its_network_and_targets_none():
    loss = _loss()
    SoftUpdate(loss, tau=0.1)
    for term, owner in (("loss_flow", "flow_policy"), ("loss_actor", "actor_network"),
                        ("loss_qvalue", "qvalue_network")):
        loss.zero_grad(set_to_none=True)
        out = loss(_transitions(5))
        out[term].backward()
        for name in ("flow_policy", "actor_network", "qvalue_network"):
            grads = [p.grad for p in getattr(loss, f"{name}_params").values(True, True) if p.requires_grad]
            if name == owner:
                assert all(g is not None and torch.isfinite(g).all() for g in grads), (term, name)
            else:
                assert all(g is None for g in grads), (term, name)
        assert all(p.grad is None for p in loss.target_qvalue_network_params.values(True, True))
        assert not out["target_value"].requires_grad


def test_only_the_critics_have_targets_and_soft_update_moves_them():
    loss = _loss()
    assert loss.target_flow_policy_params is None or not any(
        p.requires_grad for p in loss.target_flow_policy_params.values(True, True))
    updater = SoftUpdate(loss, tau=0.5)
    before = loss.target_qvalue_network_params.clone()
    with torch.no_grad():
        for p in loss.qvalue_network_params.values(True, True):
            p.add_(1.0)
    updater.step()
    for key, value in loss.target_qvalue_network_params.items(True, True):
        torch.testing.assert_close(value, before.get(key) + 0.5)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_reductions(reduction):
    batch = _transitions(2, 3)
    torch.manual_seed(3)
    none = _loss(reduction="none")(batch.clone())
    torch.manual_seed(3)
    out = _loss(reduction=reduction)(batch.clone())
    for key in ("loss_flow", "loss_actor", "loss_qvalue"):
        assert none[key].shape == (2, 3)
        expected = {"none": none[key], "mean": none[key].mean(), "sum": none[key].sum()}[reduction]
        torch.testing.assert_close(out[key], expected, msg=key)


def test_nd_batches_masks_and_priority_weights():
    batch = _transitions(2, 3)
    torch.manual_seed(4)
    flat = _loss(reduction="none")(batch.reshape(-1).clone())
    weights = torch.tensor([[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    batch["priority_weight"], batch["collector", "mask"] = weights, mask
    torch.manual_seed(4)
    out = _loss()(batch.clone())
    for key in ("loss_flow", "loss_actor", "loss_qvalue"):
        per = flat[key].reshape(2, 3)
        torch.testing.assert_close(out[key], (per * weights)[mask].sum() / weights[mask].sum(), msg=key)
    # nothing counted (and no weights): every term is 0
    batch["collector", "mask"] = torch.zeros(2, 3, dtype=torch.bool)
    del batch["priority_weight"]
    out = _loss()(batch.clone())
    for key in ("loss_flow", "loss_actor", "loss_qvalue"):
        assert float(out[key]) == 0.0


def test_renamed_keys_give_the_same_values():
    plain, renamed = _loss(), _loss()
    renamed.set_keys(action="act", reward="rew", value="q", priority="prio")
    for critic in (renamed.qvalue_network,):
        critic.in_keys = ["observation", "act"]
        critic.out_keys = ["q"]
    renamed._make_vmap()
    batch = _transitions(5)
    other = batch.clone()
    other.rename_key_("action", "act")
    other.rename_key_(("next", "reward"), ("next", "rew"))
    torch.manual_seed(0)
    a = plain(batch)
    torch.manual_seed(0)
    b = renamed(other)
    for key in ("loss_flow", "loss_actor", "loss_qvalue"):
        torch.testing.assert_close(a[key], b[key], msg=key)
    torch.testing.assert_close(other["prio"], batch["td_error"])
    assert "act" in renamed.in_keys and ("next", "rew") in renamed.in_keys


def test_a_list_of_critics_gives_the_ensemble():
    critics = [_critic((0.0, 1.0)), _critic((0.0, 3.0)), _critic((1.0, 0.0))]
    low, high = -torch.ones(1), torch.ones(1)
    loss = FQLLoss(flow.FlowMatchingPolicy(flow.FlowMatchingModel(_linear((0.0, 0.0, 0.0)), 1, 2, low=low, high=high)),
                   flow.OneStepPolicy(flow.OneStepModel(_linear((0.0, 0.0)), 1, low=low, high=high)), critics,
                   num_qvalue_nets=3)
    weights = loss.qvalue_network_params["module", "net", "weight"]
    assert weights.shape == (3, 1, 2) and float(weights[1, 0, 1]) == 3.0


def test_keyword_call_and_select_out_keys_in_a_fresh_process():
    code = textwrap.dedent("""
        import torch
        from torchrl.data import Bounded
        from offline_plugins.modules import flow
        from offline_plugins.objectives.fql import FQLLoss
        spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        loss = FQLLoss(flow.make_flow_policy(3, spec, (8,), num_steps=2), flow.make_one_step_policy(3, spec, (8,)),
                       flow.make_fql_qvalue(3, 2, (8,)))
        loss.make_value_estimator(gamma=0.9)
        loss.select_out_keys("loss_qvalue", "loss_flow")
        q, f = loss(action=spec.rand((4,)), observation=torch.randn(4, 3), next_observation=torch.randn(4, 3),
                    next_reward=torch.randn(4, 1), next_done=torch.zeros(4, 1, dtype=torch.bool),
                    next_terminated=torch.zeros(4, 1, dtype=torch.bool))
        print(q.shape == () and f.shape == ())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")


def test_diagnostics_are_listed_after_torchrls_keys_and_detached():
    loss = _loss(diagnostics=True)
    assert loss.out_keys == ["loss_flow", "loss_actor", "loss_qvalue", "q_data_mean", "q_policy_mean",
                             "distill_mse", "actor_data_mse"]
    out = loss(_transitions(6))
    for key in loss.out_keys[3:]:
        assert out[key].shape == () and not out[key].requires_grad and torch.isfinite(out[key]), key
    torch.testing.assert_close(out["distill_mse"], out["distillation_loss"].mean())
    assert _loss(diagnostics=True, reduction="none").out_keys == ["loss_flow", "loss_actor", "loss_qvalue"]


# bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["action", ("next", "reward"), ("next", "observation"), ("next", "terminated")])
def test_a_missing_key_is_named(key):
    with pytest.raises(MissingBatchKeyError, match=__import__("re").escape(repr(key))):
        _loss()(_transitions(4).exclude(key))


def test_bad_networks_and_hyperparameters_are_named():
    flow_policy, actor = flow.make_flow_policy(3, SPEC, (8,)), flow.make_one_step_policy(3, SPEC, (8,))
    q = flow.make_fql_qvalue(3, 2, (8,))
    with pytest.raises(TypeError, match="flow_policy must be a FlowMatchingPolicy.*make_flow_policy"):
        FQLLoss(actor, actor, q)
    with pytest.raises(TypeError, match="actor_network must be a OneStepPolicy"):
        FQLLoss(flow_policy, flow_policy, q)
    for kw, name in (({"q_aggregation": "max"}, "q_aggregation"), ({"alpha": -1.0}, "alpha"),
                     ({"reduction": "avg"}, "reduction"), ({"num_qvalue_nets": 0}, "num_qvalue_nets")):
        with pytest.raises(HyperparameterError, match=name):
            FQLLoss(flow_policy, actor, q, **kw)


# the glue ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _small(spec, **overrides):
    return dataclasses.replace(spec.default_config(), **{"hidden": (32, 32), "lr": 1e-3, **overrides})


def test_registered_with_the_papers_defaults(registry):
    from offline_plugins.algorithms.fql import OGBENCH_SETTINGS

    spec = registry.algorithm("fql")
    assert spec.family == "offline-rl" and spec.data == "transitions" and spec.action_spaces == ("continuous",)
    assert spec.load_loss_class() is FQLLoss and "2502.02538" in spec.paper
    config = spec.default_config()
    assert (config.lr, config.batch_size, tuple(config.hidden), config.gamma, config.tau, config.flow_steps,
            config.alpha, config.q_aggregation, config.normalize_q_loss, config.num_critics) == \
        (3e-4, 256, (512,) * 4, 0.99, 0.005, 10, 10.0, "mean", False, 2)
    assert OGBENCH_SETTINGS["cube-double-play-singletask"]["alpha"] == 300.0
    assert OGBENCH_SETTINGS["puzzle-4x4-play-singletask"]["alpha"] == 1000.0
    fields = {f.name for f in dataclasses.fields(config)}
    assert all(set(v) <= fields for v in OGBENCH_SETTINGS.values())


def test_build_trains_and_acts(registry):
    torch.manual_seed(0)
    spec = registry.algorithm("fql")
    data, batch = synthetic_transitions(64, obs_dim=3, action_dim=2, seed=1)
    batch["index"] = torch.arange(64)
    parts = spec.load_build()(_small(spec), data)
    assert [g.name for g in parts.optimizers] == ["flow", "actor", "critic"]
    assert parts.loss_keys() == ("loss_flow", "loss_actor", "loss_qvalue")
    optimizers = [g.make_optimizer() for g in parts.optimizers]
    history = []
    for _ in range(40):
        out = parts.loss(batch.clone())
        history.append(out.detach())
        for opt in optimizers:
            opt.zero_grad()
        sum(out[k] for k in parts.loss_keys()).backward()
        for opt in optimizers:
            opt.step()
        parts.target_updater.step()
    for key in ("loss_flow", "loss_qvalue", "distill_mse"):
        first = torch.stack([h[key] for h in history[:5]]).mean()
        last = torch.stack([h[key] for h in history[-5:]]).mean()
        assert last < first, f"{key} did not fall ({float(first):.4f} -> {float(last):.4f})"
    assert {"mc_return_mean", "q_data_minus_mc"} <= set(history[-1].keys())
    obs = TensorDict({"observation": batch["observation"][:7]}, [7])
    torch.manual_seed(1)
    a1 = parts.policy(obs.clone())["action"]
    torch.manual_seed(1)
    a2 = parts.policy(obs.clone())["action"]
    assert torch.equal(a1, a2) and a1.shape == (7, 2) and bool((a1.abs() <= 1).all())


def test_a_discrete_dataset_is_refused_by_name(registry):
    data, _ = synthetic_transitions(64, obs_dim=3, num_actions=3, seed=1)
    spec = registry.algorithm("fql")
    with pytest.raises(UserError, match="fql.*discrete.*continuous"):
        spec.load_build()(_small(spec), data)


@pytest.mark.parametrize("key, value", [("flow_steps", 0), ("num_critics", 0), ("alpha", -1.0),
                                        ("q_aggregation", "max")])
def test_bad_config_names_the_field(registry, key, value):
    spec = registry.algorithm("fql")
    data, _ = synthetic_transitions(64, obs_dim=3, action_dim=2, seed=1)
    with pytest.raises(UserError, match=key):
        spec.load_build()(_small(spec, **{key: value}), data)


def test_glue_module_imports_no_torch():
    code = "import sys, offline_plugins.algorithms.fql; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_cli_trains_fql_on_pendulum(tmp_path, capsys, minari_store, monkeypatch):
    from offline_plugins.cli import main

    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    out = tmp_path / "fql"
    args = ["train", "fql", "--dataset", "pendulum/medium-replay-v0", "--steps", "20", "--eval-every", "10",
            "--eval-episodes", "2", "--set", "hidden=[32,32]", "--set", "batch_size=64", "--set", "alpha=3",
            "--out", str(out), "--no-progress", "--threads", "1", "--log-every", "5"]
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "fql" and summary["steps"] == 20 and summary["config"]["alpha"] == 3.0
    assert summary["return_mean"] is not None and math.isfinite(summary["return_mean"])
    losses = {k: v for k, v in summary["losses"].items() if k.startswith("train/loss_")}
    assert set(losses) == {"train/loss_flow", "train/loss_actor", "train/loss_qvalue"}
    assert all(math.isfinite(v) for v in losses.values()), losses
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["return_mean"] == pytest.approx(summary["return_mean"])
