"""ReBRAC, SAC-N, EDAC and Cal-QL (issue 28): losses against hand computations on tiny
batches, EDAC's diversity gradient, the dataset columns they read, their contract
(``[*B]`` batches, keyword calls, clear errors) and their glue."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torchrl import objectives as trl
from torchrl.data import Bounded
from torchrl.envs.utils import ExplorationType, set_exploration_type

from _cql_by_hand import conservative_term_by_hand
from _offline_train import train
from _synthetic import synthetic_transitions
from offline_plugins.errors import UserError
from offline_plugins.modules import networks as nets
from offline_plugins.objectives.cal_ql import CalQLLoss
from offline_plugins.objectives.columns import DatasetColumns, discounted_returns, next_actions
from offline_plugins.objectives.common import HyperparameterError, MissingBatchKeyError
from offline_plugins.objectives.cql import CQLLoss
from offline_plugins.objectives.edac import EDACLoss, SACNLoss, diversity_penalty
from offline_plugins.objectives.rebrac import ReBRACLoss
from offline_plugins.plugins.manager import load_registry

torch.set_num_threads(1)
SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))
H = (16, 16)


def _batch(n: int = 8, seed: int = 2):
    batch = synthetic_transitions(n, obs_dim=3, action_dim=2, seed=seed)[1]
    batch["next", "action"] = SPEC.rand((n,))
    batch["mc_return"] = torch.randn(n, 1)
    return batch


def _set(params, name: str, value) -> None:
    with torch.no_grad():
        params[name].copy_(torch.as_tensor(value, dtype=params[name].dtype).expand_as(params[name]))


# ReBRAC ----------------------------------------------------------------------------------------

def _tiny_rebrac(**kw):
    """1-d state and action in [-2, 2]; the actor outputs 0.5 everywhere, critic i is Q_i = c_i * a
    with c = (1, 2); targets equal to the online networks."""
    spec = Bounded(-2 * torch.ones(1), 2 * torch.ones(1), (1,))
    loss = ReBRACLoss(nets.make_deterministic_actor(1, spec, ()), nets.make_qvalue(1, 1, ()), action_spec=spec,
                      policy_noise=0.0, noise_clip=0.0, **kw)
    for params in (loss.actor_network_params, loss.target_actor_network_params):
        _set(params, ("module", "0", "0", "weight"), 0.0)
        _set(params, ("module", "0", "0", "bias"), math.atanh(0.25))  # 2 * tanh(b) = 0.5
    for params in (loss.qvalue_network_params, loss.target_qvalue_network_params):
        _set(params, ("module", "net", "0", "weight"), torch.tensor([[[0.0, 1.0]], [[0.0, 2.0]]]))
        _set(params, ("module", "net", "0", "bias"), 0.0)
    loss.make_value_estimator(gamma=0.9)
    batch = TensorDict({
        "observation": torch.tensor([[0.3], [-1.0]]),
        "action": torch.tensor([[0.1], [-0.3]]),
        ("next", "observation"): torch.tensor([[0.7], [0.2]]),
        ("next", "action"): torch.tensor([[0.5], [1.5]]),
        ("next", "reward"): torch.tensor([[1.0], [2.0]]),
        ("next", "done"): torch.tensor([[False], [True]]),
        ("next", "terminated"): torch.tensor([[False], [True]]),
    }, [2])
    return loss, batch


def test_rebrac_actor_loss_by_hand():
    loss, batch = _tiny_rebrac(actor_bc_coef=0.5, critic_bc_coef=0.4)
    value, meta = loss.actor_loss(batch)
    # min_i Q_i(s, 0.5) = 0.5, lambda = 1 / 0.5; penalty ((0.5 - a) / 2)^2 = 0.04, 0.16
    assert float(meta["lmbd"]) == pytest.approx(2.0)
    assert float(meta["bc_loss"]) == pytest.approx(0.1)
    assert float(value) == pytest.approx(0.5 * 0.1 - 2.0 * 0.5)


def test_rebrac_critic_loss_by_hand():
    loss, batch = _tiny_rebrac(actor_bc_coef=0.5, critic_bc_coef=0.4)
    value, meta = loss.qvalue_loss(batch)
    # next action 0.5, min Q' = 0.5; penalty ((0.5 - a') / 2)^2 = 0, 0.25; y = 1 + 0.9 * 0.5, 2 (terminal)
    torch.testing.assert_close(meta["next_state_value"], torch.tensor([0.5, 0.5 - 0.4 * 0.25]))
    torch.testing.assert_close(meta["target_value"], torch.tensor([1.45, 2.0]))
    expected = ((0.1 - 1.45) ** 2 + (-0.3 - 2.0) ** 2) / 2 + ((0.2 - 1.45) ** 2 + (-0.6 - 2.0) ** 2) / 2
    assert float(value) == pytest.approx(expected)


def test_rebrac_without_a_next_action_has_no_critic_penalty():
    loss, batch = _tiny_rebrac(critic_bc_coef=100.0)
    batch["next", "action"] = torch.tensor([[float("nan")], [1.5]])
    _, meta = loss.qvalue_loss(batch)
    assert float(meta["next_state_value"][0]) == pytest.approx(0.5)
    assert torch.isfinite(meta["target_value"]).all()


def test_rebrac_zero_coefficients_are_td3_with_min_q_actor():
    loss, batch = _tiny_rebrac(actor_bc_coef=0.0, critic_bc_coef=0.0, normalize_q=False)
    value, meta = loss.actor_loss(batch)
    assert float(meta["lmbd"]) == 1.0 and float(value) == pytest.approx(-0.5)


def test_rebrac_only_the_actor_term_moves_the_actor():
    loss = ReBRACLoss(nets.make_deterministic_actor(3, SPEC, H), nets.make_layer_norm_qvalue(3, 2, H),
                      action_spec=SPEC)
    loss.make_value_estimator(gamma=0.99)
    out = loss(_batch())
    actor = list(loss.actor_network_params.parameters())
    assert all(g is None for g in torch.autograd.grad(out["loss_qvalue"], actor, allow_unused=True))
    critic = list(loss.qvalue_network_params.parameters())
    assert all(g is None or g.abs().max() == 0
               for g in torch.autograd.grad(out["loss_actor"], critic, allow_unused=True))


# SAC-N and EDAC -----------------------------------------------------------------------------------

def _agree(ours, theirs, batch, seed=0):
    theirs.load_state_dict(ours.state_dict(), strict=False)
    torch.manual_seed(seed)
    a = ours(batch.clone())
    torch.manual_seed(seed)
    b = theirs(batch.clone())
    for k in ("loss_actor", "loss_qvalue", "loss_alpha", "alpha", "entropy"):
        torch.testing.assert_close(a[k], b[k], msg=k)
    sum(a[k] for k in ("loss_actor", "loss_qvalue", "loss_alpha")).backward()
    sum(b[k] for k in ("loss_actor", "loss_qvalue", "loss_alpha")).backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, theirs_params[name].grad, msg=name)


@pytest.mark.parametrize("n", [2, 5])
def test_sac_n_is_torchrl_sac_with_n_critics(n):
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    ours = SACNLoss(actor, q, num_qvalue_nets=n, action_spec=SPEC, diagnostics=True)
    theirs = trl.SACLoss(actor, q, num_qvalue_nets=n, loss_function="l2", action_spec=SPEC)
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    _agree(ours, theirs, _batch())


def test_sac_n_critic_loss_by_hand():
    torch.manual_seed(0)
    n = 3
    loss = SACNLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), num_qvalue_nets=n,
                    action_spec=SPEC, alpha_init=0.5)
    loss.make_value_estimator(gamma=0.9)
    batch = _batch(n=6)
    torch.manual_seed(3)
    terms, meta = loss.qvalue_loss(batch.clone())
    qmod, actor = loss.qvalue_network.module, loss.actor_network
    with torch.no_grad():
        torch.manual_seed(3)
        s, s2 = batch["observation"], batch["next", "observation"]
        with set_exploration_type(ExplorationType.RANDOM):
            a2, lp2 = actor.get_dist(TensorDict({"observation": s2}, [6])).rsample_and_log_prob()
        q_next = []
        for i in range(n):
            with loss.target_qvalue_network_params[i].to_module(loss.qvalue_network):
                q_next.append(qmod(s2, a2).squeeze(-1))
        v_next = torch.stack(q_next).min(0).values - 0.5 * lp2
        y = batch["next", "reward"].squeeze(-1) + 0.9 * (~batch["next", "terminated"].squeeze(-1)) * v_next
        expected = 0
        for i in range(n):
            with loss.qvalue_network_params[i].to_module(loss.qvalue_network):
                expected = expected + F.mse_loss(qmod(s, batch["action"]).squeeze(-1), y)
    torch.testing.assert_close(terms["loss_qvalue"], expected)
    assert meta["pred_value"].shape == (n, 6)


def test_diversity_penalty_by_hand():
    # three critics whose action gradients are (1, 0), (0, 1), (1, 1): cosines 0, 1/sqrt2, 1/sqrt2
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).unsqueeze(1)  # [N=3, B=1, A=2]
    assert float(diversity_penalty(g)) == pytest.approx(2 * (0 + 2 / math.sqrt(2)) / 2)
    # the O(N) form equals the Gram-matrix form of the paper / CORL
    g = torch.randn(7, 5, 3)
    unit = g / (g.norm(dim=-1, keepdim=True) + 1e-9)
    gram = torch.einsum("ibk,jbk->bij", unit, unit) * (1 - torch.eye(7))
    torch.testing.assert_close(diversity_penalty(g), gram.sum((1, 2)) / 6)
    with pytest.raises(ValueError, match="at least 2"):
        diversity_penalty(g[:1])


def _linear_edac(eta=0.5):
    """Linear critics Q_i(s, a) = u_i . s + w_i . a: their action gradients are the w_i."""
    loss = EDACLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, ()), num_qvalue_nets=3,
                    eta=eta, action_spec=SPEC)
    w = torch.tensor([[[0.3, -0.2, 0.5, 1.0, 0.0]], [[0.1, 0.1, 0.1, 0.0, 1.0]], [[-1.0, 0.4, 0.0, 1.0, 1.0]]])
    _set(loss.qvalue_network_params, ("module", "net", "0", "weight"), w)
    loss.make_value_estimator(gamma=0.99)
    return loss


def test_edac_diversity_term_by_hand():
    loss = _linear_edac(eta=0.5)
    out = loss(_batch())
    assert float(out["loss_diversity"]) == pytest.approx(0.5 * math.sqrt(2), rel=1e-5)
    torch.testing.assert_close(out["loss_diversity"], loss.diversity_loss(_batch()))


def test_edac_diversity_gradient_matches_the_explicit_formula():
    """With linear critics the term is eta / (N - 1) * sum_{i != j} cos(w_i, w_j) of the action
    weights: autograd on that formula gives the gradient the loss must give its critics."""
    loss = _linear_edac(eta=0.5)
    weight = loss.qvalue_network_params["module", "net", "0", "weight"]
    (grad,) = torch.autograd.grad(loss.diversity_loss(_batch()), weight)
    w = weight.detach()[:, 0, 3:].clone().requires_grad_(True)
    unit = w / (w.norm(dim=-1, keepdim=True) + 1e-9)
    formula = 0.5 * ((unit.sum(0) ** 2).sum() - (unit ** 2).sum()) / 2
    (expected,) = torch.autograd.grad(formula, w)
    torch.testing.assert_close(grad[:, 0, 3:], expected)
    assert grad[:, 0, :3].abs().max() == 0  # the state weights do not enter the action gradients


def test_edac_diversity_gradient_matches_finite_differences():
    """A nonlinear critic (tanh), float64: d loss_diversity / d theta against central differences."""
    torch.manual_seed(0)
    q = nets.make_qvalue(3, 2, (4,))
    q.module.net[1] = torch.nn.Tanh()
    loss = EDACLoss(nets.make_tanh_gaussian_actor(3, SPEC, (4,)), q, num_qvalue_nets=3, action_spec=SPEC).double()
    loss.make_value_estimator(gamma=0.99)
    batch = _batch(n=5).apply(lambda t: t.double() if t.is_floating_point() else t)
    weight = loss.qvalue_network_params["module", "net", "0", "weight"]
    (grad,) = torch.autograd.grad(loss.diversity_loss(batch), weight)
    h = 1e-6
    for idx in [(0, 0, 0), (1, 2, 3), (2, 3, 4), (0, 1, 4)]:
        with torch.no_grad():
            weight[idx] += h
            up = float(loss.diversity_loss(batch))
            weight[idx] -= 2 * h
            down = float(loss.diversity_loss(batch))
            weight[idx] += h
        assert float(grad[idx]) == pytest.approx((up - down) / (2 * h), rel=1e-4, abs=1e-8), idx


def test_edac_at_eta_zero_is_sac_n():
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    edac = EDACLoss(actor, q, num_qvalue_nets=4, eta=0.0, action_spec=SPEC)
    sacn = SACNLoss(actor, q, num_qvalue_nets=4, action_spec=SPEC)
    for loss in (edac, sacn):
        loss.make_value_estimator(gamma=0.99)
    sacn.load_state_dict(edac.state_dict(), strict=False)
    torch.manual_seed(0)
    a = edac(_batch())
    torch.manual_seed(0)
    b = sacn(_batch())
    assert float(a["loss_diversity"]) == 0.0
    for k in ("loss_actor", "loss_qvalue", "loss_alpha"):
        torch.testing.assert_close(a[k], b[k])


# Cal-QL --------------------------------------------------------------------------------------------

def test_cal_ql_with_a_return_below_every_value_is_cql():
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    calql = CalQLLoss(actor, q, num_random=3, diagnostics=True)
    cql = CQLLoss(actor, q, num_random=3)
    for loss in (calql, cql):
        loss.make_value_estimator(gamma=0.99)
    cql.load_state_dict(calql.state_dict(), strict=False)
    batch = _batch()
    batch["mc_return"] = torch.full((8, 1), -1e9)
    torch.manual_seed(0)
    a = calql(batch.clone())
    torch.manual_seed(0)
    b = cql(batch.clone())
    for k in ("loss_qvalue", "loss_cql", "loss_actor", "loss_alpha"):
        torch.testing.assert_close(a[k], b[k], msg=k)
    assert float(a["calql_bound_frac"]) == 0.0


def test_cal_ql_conservative_term_by_hand():
    """The per-state log-sum-exp of CQL with the current and next policy's values replaced by
    max(Q, mc_return); uniform actions unbounded."""
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    n, w = 4, 5.0
    loss = CalQLLoss(actor, q, num_random=n, min_q_weight=w)
    loss.make_value_estimator(gamma=0.99)
    batch = _batch(n=8)
    bound = torch.linspace(-0.3, 0.3, 8).unsqueeze(-1)  # near the initial Q values: some raised, some not
    batch["mc_return"] = bound
    td = batch.clone()
    loss.q_loss(td)
    torch.manual_seed(1)
    value, _ = loss.cql_loss(td)
    expected, raised = conservative_term_by_hand(loss, actor, batch, n=n, weight=w, bound=bound)
    assert 0 < raised < 2 * 2 * 8 * n  # the bound binds on some of the values, not all
    torch.testing.assert_close(value, expected)
    assert float(loss._bound_frac) == pytest.approx(raised / (2 * 2 * 8 * n))


def test_cal_ql_refuses_torchrl_conservative_term():
    with pytest.raises(ValueError, match="conservative_term"):
        CalQLLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), conservative_term="torchrl")


# dataset columns -------------------------------------------------------------------------------------

def test_discounted_returns_match_the_synthetic_data_and_a_loop():
    data, _ = synthetic_transitions(40, obs_dim=3, action_dim=2, seed=0)
    torch.testing.assert_close(discounted_returns(data.td, 0.99), data.td["return_to_go"])
    td = data.td.clone()
    td["next", "terminated"][5] = True  # an episode that terminates early: nothing flows past it
    td["next", "done"][5] = True
    g = discounted_returns(td, 0.5)
    r = td["next", "reward"].squeeze(-1)
    assert float(g[5]) == pytest.approx(float(r[5]))
    assert float(g[4]) == pytest.approx(float(r[4] + 0.5 * r[5]))


def test_next_actions_stop_at_episode_ends():
    data, _ = synthetic_transitions(20, obs_dim=3, action_dim=2, seed=0)  # two episodes of 10
    nxt = next_actions(data.td)
    torch.testing.assert_close(nxt[:9], data.td["action"][1:10])
    assert torch.isnan(nxt[9]).all() and torch.isnan(nxt[19]).all()
    torch.testing.assert_close(nxt[10:19], data.td["action"][11:20])


def test_columns_fill_only_what_is_missing_and_check_the_index():
    columns = DatasetColumns({"mc_return": torch.arange(5.0).unsqueeze(-1)})
    own = TensorDict({"index": torch.tensor([1, 2]), "mc_return": torch.zeros(2, 1)}, [2])
    assert columns.fill(own)["mc_return"].sum() == 0  # a batch's own column wins
    with pytest.raises(MissingBatchKeyError, match="index"):
        columns.fill(TensorDict({"index": torch.tensor([7])}, [1]))
    assert columns.state_dict() == {}  # recomputed by build, not checkpointed
    # not buffers either: DDP would broadcast them from rank 0 every step
    assert list(columns.buffers()) == []
    assert columns.to(torch.float64).values[0].dtype == torch.float64  # they follow .to()


# the contract: N-D batches, keyword calls, errors ----------------------------------------------------

def _losses():
    actor_d, actor_s = nets.make_deterministic_actor(3, SPEC, H), nets.make_tanh_gaussian_actor(3, SPEC, H)
    q = nets.make_qvalue(3, 2, H)
    return {
        "rebrac": ReBRACLoss(actor_d, nets.make_layer_norm_qvalue(3, 2, H), action_spec=SPEC, diagnostics=True),
        "sac-n": SACNLoss(actor_s, q, num_qvalue_nets=4, action_spec=SPEC, diagnostics=True),
        "edac": EDACLoss(actor_s, q, num_qvalue_nets=4, action_spec=SPEC, diagnostics=True),
        "cal-ql": CalQLLoss(actor_s, q, num_random=2, action_spec=SPEC, diagnostics=True),
    }


@pytest.mark.parametrize("name", ["rebrac", "sac-n", "edac", "cal-ql"])
def test_nd_batches_give_the_flat_batch_values(name):
    loss = _losses()[name]
    loss.make_value_estimator(gamma=0.99)
    flat = _batch(n=12)
    torch.manual_seed(0)
    a = loss(flat.clone())
    torch.manual_seed(0)
    b = loss(flat.clone().reshape(3, 4))
    assert set(a.keys()) == set(loss.out_keys) == set(b.keys())
    for k in ("loss_qvalue", "loss_actor"):
        torch.testing.assert_close(a[k], b[k], msg=k)


@pytest.mark.parametrize("name", ["rebrac", "sac-n", "edac", "cal-ql"])
def test_keyword_calls_take_every_in_key(name):
    loss = _losses()[name]
    loss.make_value_estimator(gamma=0.99)
    batch = _batch(n=6)
    kwargs = {"_".join(k) if isinstance(k, tuple) else k: batch.get(k) for k in loss.in_keys}
    selected = loss.select_out_keys("loss_qvalue", "loss_actor")
    loss_qvalue, loss_actor = selected(**kwargs)
    assert loss_qvalue.shape == () and loss_actor.shape == ()


@pytest.mark.parametrize("name, key", [("rebrac", ("next", "action")), ("cal-ql", "mc_return"),
                                       ("sac-n", "action"), ("edac", ("next", "reward"))])
def test_missing_key_names_it(name, key):
    loss = _losses()[name]
    loss.make_value_estimator(gamma=0.99)
    with pytest.raises(UserError, match=re_escape(repr(key))):
        loss(_batch().exclude(key))


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("make, match", [
    (lambda: EDACLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), eta=-1.0), "eta"),
    (lambda: SACNLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), num_qvalue_nets=1),
     "num_qvalue_nets"),
    (lambda: ReBRACLoss(nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), action_spec=SPEC,
                        actor_bc_coef=-0.1), "actor_bc_coef"),
    (lambda: ReBRACLoss(nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), action_spec=SPEC,
                        critic_bc_coef=-0.1), "critic_bc_coef"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(HyperparameterError, match=match):
        make()


# the glue ----------------------------------------------------------------------------------------------

NAMES = ["rebrac", "sac-n", "edac", "cal-ql"]


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _small(spec, **overrides):
    config = spec.default_config()
    changes = {"hidden": (32, 32), "num_random": 2, "batch_size": 64, "num_critics": 3}
    for f in dataclasses.fields(config):
        if f.name.endswith("_lr"):
            changes[f.name] = 1e-3
    changes.update(overrides)
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if hasattr(config, k)})


@pytest.mark.parametrize("name", NAMES)
def test_build_train_and_act(registry, name):
    torch.manual_seed(0)
    spec = registry.algorithm(name)
    assert spec.family == "offline-rl" and spec.action_spaces == ("continuous",) and spec.paper
    data, batch = synthetic_transitions(64, obs_dim=3, action_dim=2, seed=1)
    batch["index"] = torch.arange(64)  # what the replay buffer writes: the columns are looked up by it
    parts = spec.load_build()(_small(spec), data)
    assert isinstance(parts.loss, spec.load_loss_class())
    assert parts.target_updater is not None

    def diagnostics_detached(out):
        for key in out.keys():
            if not key.startswith("loss_"):
                assert not out[key].requires_grad, key

    history = [float(out["loss_qvalue"]) for out in train(parts, batch, 30, check=diagnostics_detached)]
    assert all(math.isfinite(v) for v in history)
    assert sum(history[-5:]) < sum(history[:5]), f"{name}: loss_qvalue did not fall"
    obs = TensorDict({"observation": batch["observation"][:7]}, [7])
    a1, a2 = parts.policy(obs.clone())["action"], parts.policy(obs.clone())["action"]
    assert torch.equal(a1, a2) and a1.shape == (7, 2) and bool((a1.abs() <= 1).all())


def test_edac_critics_minimise_the_diversity_term(registry):
    spec = registry.algorithm("edac")
    data, _ = synthetic_transitions(64, obs_dim=3, action_dim=2, seed=1)
    parts = spec.load_build()(_small(spec), data)
    critic = next(g for g in parts.optimizers if g.name == "critic")
    assert critic.loss_keys == ("loss_qvalue", "loss_diversity")


def test_cal_ql_reads_discounted_returns_at_its_gamma(registry):
    spec = registry.algorithm("cal-ql")
    data, batch = synthetic_transitions(40, obs_dim=3, action_dim=2, seed=1)
    parts = spec.load_build()(_small(spec, gamma=0.5), data)
    td = TensorDict({"index": torch.arange(40)}, [40])
    parts.loss.columns.fill(td)
    torch.testing.assert_close(td["mc_return"], discounted_returns(data.td, 0.5))


@pytest.mark.parametrize("name", NAMES)
def test_wrong_action_space_is_a_user_error(registry, name):
    data, _ = synthetic_transitions(64, obs_dim=3, num_actions=3, seed=1)
    spec = registry.algorithm(name)
    with pytest.raises(UserError, match=f"{name}.*discrete"):
        spec.load_build()(_small(spec), data)


def test_glue_modules_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, offline_plugins.algorithms.rebrac, offline_plugins.algorithms.edac, "
            "offline_plugins.algorithms.cal_ql; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name, key, value", [("edac", "eta", -1.0), ("sac-n", "num_critics", 1),
                                              ("rebrac", "policy_freq", 0), ("rebrac", "actor_bc_coef", -1.0), ("rebrac", "num_critics", 1),
                                              ("cal-ql", "min_q_weight", -1.0)])
def test_bad_config_names_the_field(registry, name, key, value):
    spec = registry.algorithm(name)
    data, _ = synthetic_transitions(64, obs_dim=3, action_dim=2, seed=1)
    with pytest.raises(UserError, match=key):
        spec.load_build()(_small(spec, **{key: value}), data)
