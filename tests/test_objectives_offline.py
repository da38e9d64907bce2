"""Offline-RL losses: values against hand computation and agreement with TorchRL's losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torchrl.data import Bounded
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import QValueActor
from torchrl import objectives as trl

from _cql_by_hand import conservative_term_by_hand
from _synthetic import synthetic_transitions
from offline_plugins.errors import UserError
from offline_plugins.modules import networks as nets
from offline_plugins.objectives.awac import AWACLoss, awac_weights
from offline_plugins.objectives.bc import BCLoss
from offline_plugins.objectives.bcq import BCQLoss, BCQPolicy, DiscreteBCQLoss, bcq_allowed_actions, bcq_backup
from offline_plugins.objectives.cql import CQLLoss, DiscreteCQLLoss
from offline_plugins.objectives.iql import DiscreteIQLLoss, IQLLoss
from offline_plugins.objectives.td3_bc import TD3BCLoss

torch.set_num_threads(1)
SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))
H = (16, 16)


def _batch(discrete: bool = False, n: int = 32):
    if discrete:
        return synthetic_transitions(n, obs_dim=3, num_actions=3, seed=2)[1]
    return synthetic_transitions(n, obs_dim=3, action_dim=2, seed=2)[1]


def _loss_terms(out):
    return {k: out[k] for k in out.keys() if k.startswith("loss_")}


def _agree(ours, theirs, batch, seed=0):
    """Same loss terms, and the same gradients of their sum, on the same parameters and batch."""
    theirs.load_state_dict(ours.state_dict(), strict=False)
    torch.manual_seed(seed)
    a = _loss_terms(ours(batch.clone()))
    torch.manual_seed(seed)
    b = _loss_terms(theirs(batch.clone()))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)
    sum(a.values()).backward()
    sum(b.values()).backward()
    grads_b = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None or grads_b[name].grad is not None:
            torch.testing.assert_close(p.grad, grads_b[name].grad, msg=name)
    return a, b


# -- TorchRL-based losses agree with TorchRL's ---------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_iql_agrees_with_torchrl(fused):
    spec = Bounded(-2 * torch.ones(2), torch.ones(2), (2,))  # asymmetric bounds exercise the affine term
    actor, q, v = nets.make_tanh_gaussian_actor(3, spec, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)
    ours = IQLLoss(actor, q, v, fused=fused, diagnostics=True)
    assert (ours._plan is not None) == fused
    theirs = trl.IQLLoss(actor, q, v, expectile=0.7, temperature=3.0, loss_function="l2")
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    batch = _batch()
    batch["action"] = batch["action"].clamp(-1, 1) * 1.5 - 0.5
    a, _ = _agree(ours, theirs, batch)
    out = ours(batch.clone())
    assert {"q_data_mean", "advantage_mean", "value_mean"} <= set(out.keys())


def test_discrete_iql_agrees_with_torchrl():
    actor, q, v = nets.make_categorical_actor(3, 3, H), nets.make_discrete_qvalue(3, 3, H), nets.make_value(3, H)
    ours = DiscreteIQLLoss(actor, q, v)
    theirs = trl.DiscreteIQLLoss(actor, q, v, action_space="categorical", expectile=0.7, temperature=3.0,
                                 loss_function="l2")
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    _agree(ours, theirs, _batch(discrete=True))


def test_iql_value_loss_is_the_expectile_regression():
    actor, q, v = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)
    loss = IQLLoss(actor, q, v, expectile=0.8, diagnostics=True)
    loss.make_value_estimator(gamma=0.99)
    batch = _batch()
    out = loss(batch.clone())
    with torch.no_grad():
        td = batch.select("observation", "action")
        q_all = loss._vmap_qvalue_networkN0(td, loss.target_qvalue_network_params)["state_action_value"]
        u = q_all.min(0).values.squeeze(-1) - v(batch.clone())["state_value"].squeeze(-1)
        expected = (torch.where(u > 0, 0.8, 0.2) * u.pow(2)).mean()
        weights = torch.exp(3.0 * u).clamp_max(100)
    torch.testing.assert_close(out["loss_value"], expected)
    torch.testing.assert_close(out["advantage_weight_mean"], weights.mean())


@pytest.mark.parametrize("fused", [True, False])
def test_td3bc_agrees_with_torchrl(fused):
    actor, q = nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    ours = TD3BCLoss(actor, q, action_spec=SPEC, fused=fused)
    assert (ours._plan is not None) == fused
    theirs = trl.TD3BCLoss(actor, q, action_spec=SPEC, loss_function="l2")
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    _agree(ours, theirs, _batch())


def test_td3bc_critic_only_terms_skip_the_actor_and_match_the_full_loss():
    # TD3's critic-only steps: loss_terms without loss_actor gives the same critic term and
    # gradients as the full forward, from the same random draws, and leaves the actor alone
    actor, q = nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    loss = TD3BCLoss(actor, q, action_spec=SPEC)
    loss.make_value_estimator(gamma=0.99)
    batch = _batch()
    torch.manual_seed(3)
    full = loss(batch.clone())
    full["loss_qvalue"].backward()
    expected = {n: p.grad.clone() for n, p in loss.named_parameters() if p.grad is not None}
    loss.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    part = loss.loss_terms(batch.clone(), ["loss_qvalue"])
    assert "loss_actor" not in part.keys() and "lmbd" not in part.keys()
    torch.testing.assert_close(part["loss_qvalue"], full["loss_qvalue"])
    part["loss_qvalue"].backward()
    got = {n: p.grad for n, p in loss.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and not any("actor" in n for n in got)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], msg=n)
    torch.manual_seed(3)
    both = loss.loss_terms(batch.clone(), ["loss_qvalue", "loss_actor"])
    torch.testing.assert_close(both["loss_actor"], full["loss_actor"])


def _same_state_batch():
    """A batch whose next observation is the observation: there TorchRL's estimator and the
    paper's coincide when each source has one sample."""
    batch = _batch()
    batch["next", "observation"] = batch["observation"].clone()
    return batch


@pytest.mark.parametrize("lagrange", [False, True])
def test_cql_agrees_with_torchrl_where_the_estimators_coincide(lagrange):
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    ours = CQLLoss(actor, q, num_random=1, with_lagrange=lagrange, lagrange_thresh=1.5, diagnostics=True)
    theirs = trl.CQLLoss(actor, q, min_q_weight=5.0, num_random=1, loss_function="l2", with_lagrange=lagrange,
                         lagrange_thresh=1.5)
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    if not lagrange:
        _agree(ours, theirs, _same_state_batch())
        return
    theirs.load_state_dict(ours.state_dict(), strict=False)
    with torch.no_grad():
        ours.log_alpha_prime.fill_(math.log(2.0))
        theirs.log_alpha_prime.fill_(math.log(2.0))
    batch = _same_state_batch()
    torch.manual_seed(0)
    a = ours(batch.clone())
    torch.manual_seed(0)
    b = theirs(batch.clone())
    # TorchRL learns alpha' but never applies it; ours scales the penalty by it
    torch.testing.assert_close(a["loss_cql"], 2.0 * (b["loss_cql"] - 2 * 1.5))
    torch.testing.assert_close(a["loss_qvalue"], b["loss_qvalue"])
    torch.testing.assert_close(a["loss_alpha_prime"], b["loss_alpha_prime"])
    torch.testing.assert_close(a["cql_gap"], b["loss_cql"] / (2 * 5.0))
    grads = torch.autograd.grad(a["loss_alpha_prime"], list(ours.qvalue_network_params.parameters()),
                                allow_unused=True)
    assert all(g is None or g.abs().max() == 0 for g in grads)


def test_cql_penalty_is_a_per_state_logsumexp_over_every_sampled_action():
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    n, w = 4, 5.0
    loss = CQLLoss(actor, q, num_random=n, min_q_weight=w)
    loss.make_value_estimator(gamma=0.99)
    assert loss._critic_chain() is not None  # the fused critic path is the one checked here
    batch = _batch(n=8)
    td = batch.clone()
    loss.q_loss(td)
    torch.manual_seed(1)
    value, _ = loss.cql_loss(td)
    expected, _ = conservative_term_by_hand(loss, actor, batch, n=n, weight=w)
    torch.testing.assert_close(value, expected)


def test_discrete_cql_agrees_with_torchrl_at_alpha_one_and_scales():
    net = nets.mlp(3, 3, H)
    qnet = QValueActor(net, in_keys=["observation"], action_space="categorical")
    ours = DiscreteCQLLoss(qnet, alpha=1.0, diagnostics=True)
    theirs = trl.DiscreteCQLLoss(qnet, action_space="categorical")
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    batch = _batch(discrete=True)
    _agree(ours, theirs, batch)
    ours.alpha.fill_(2.5)
    out = ours(batch.clone())
    with torch.no_grad():
        qv = net(batch["observation"])
        gap = (torch.logsumexp(qv, -1) - qv.gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)).mean()
    torch.testing.assert_close(out["loss_cql"], 2.5 * gap)
    torch.testing.assert_close(out["cql_gap"], gap)


def test_bc_losses_are_mse_and_cross_entropy():
    batch = _batch()
    actor = nets.make_deterministic_actor(3, SPEC, H)
    out = BCLoss(actor, loss_function="l2")(batch.clone())
    torch.testing.assert_close(out["loss_bc"], F.mse_loss(actor(batch.clone())["action"], batch["action"]))
    batch = _batch(discrete=True)
    actor = nets.make_categorical_actor(3, 3, H)
    out = BCLoss(actor)(batch.clone())
    logits = actor(batch.clone())["logits"]
    torch.testing.assert_close(out["loss_bc"], F.cross_entropy(logits, batch["action"]))


# -- BCQ ----------------------------------------------------------------------------------------
def _bcq(lmbda=0.75, n=4):
    loss = BCQLoss(nets.make_perturbation(3, SPEC, H, phi=0.05), nets.make_qvalue(3, 2, H),
                   nets.make_vae(3, SPEC, H), lmbda=lmbda, num_samples=n)
    loss.make_value_estimator(gamma=0.9)
    return loss


def test_bcq_backup_mixes_min_and_max_then_maxes_candidates():
    q = torch.tensor([[[1.0, 5.0, 0.0]], [[3.0, 2.0, 4.0]]])
    # candidates: 0.75*min + 0.25*max = [1.5, 2.75, 1.0]
    torch.testing.assert_close(bcq_backup(q, 0.75), torch.tensor([2.75]))
    torch.testing.assert_close(bcq_backup(q, 1.0), torch.tensor([2.0]))
    torch.testing.assert_close(bcq_backup(q, 0.0), torch.tensor([5.0]))


def test_bcq_perturbation_is_bounded_by_phi_times_max_action():
    spec = Bounded(-2 * torch.ones(2), 2 * torch.ones(2), (2,))
    module = nets.make_perturbation(3, spec, H, phi=0.05)
    with torch.no_grad():
        module.module.net[-1].bias.fill_(100.0)  # saturate tanh: the largest allowed step
    a = torch.zeros(6, 2)
    out = module(TensorDict({"observation": torch.randn(6, 3), "action": a}, [6]))["perturbed_action"]
    torch.testing.assert_close(out - a, torch.full((6, 2), 0.05 * 2.0))
    edge = torch.full((6, 2), 1.99)
    out = module(TensorDict({"observation": torch.randn(6, 3), "action": edge}, [6]))["perturbed_action"]
    torch.testing.assert_close(out, torch.full((6, 2), 2.0))  # clipped to the bound


def test_bcq_vae_loss_is_reconstruction_plus_half_kl():
    loss = _bcq()
    batch = _batch()
    torch.manual_seed(3)
    value, meta = loss.vae_loss(batch.clone())
    vae = loss.vae_network.module
    torch.manual_seed(3)
    recon, mean, std = vae(batch["observation"], batch["action"])
    kl = -0.5 * (1 + torch.log(std ** 2) - mean ** 2 - std ** 2).mean()
    torch.testing.assert_close(value, F.mse_loss(recon, batch["action"]) + 0.5 * kl)
    torch.testing.assert_close(meta["vae_kl"], kl.detach())


def test_bcq_critic_target_by_hand():
    loss = _bcq(lmbda=0.75, n=4)
    batch = _batch(n=8)
    torch.manual_seed(5)
    value, meta = loss.qvalue_loss(batch.clone())
    # the same computation written out: 4 VAE samples per next state, perturbed by the target actor
    vae = loss.vae_network.module
    pert = loss.actor_network.module
    qmod = loss.qvalue_network.module
    with torch.no_grad():
        torch.manual_seed(5)
        s2 = batch["next", "observation"].repeat_interleave(4, 0)
        cand = vae.decode(s2)
        with loss.target_actor_network_params.to_module(loss.actor_network):
            cand = pert(s2, cand)
        qs = []
        for i in range(2):
            with loss.target_qvalue_network_params[i].to_module(loss.qvalue_network):
                qs.append(qmod(s2, cand).reshape(8, 4))
        qs = torch.stack(qs)
        v_next = (0.75 * qs.min(0).values + 0.25 * qs.max(0).values).max(-1).values
        y = batch["next", "reward"].squeeze(-1) + 0.9 * (~batch["next", "terminated"].squeeze(-1)) * v_next
        expected = 0
        for i in range(2):
            with loss.qvalue_network_params[i].to_module(loss.qvalue_network):
                expected = expected + F.mse_loss(qmod(batch["observation"], batch["action"]).squeeze(-1), y)
    torch.testing.assert_close(value, expected)


def test_bcq_actor_loss_is_minus_q1_of_perturbed_vae_samples_and_only_moves_the_actor():
    loss = _bcq()
    batch = _batch()
    torch.manual_seed(7)
    value, _ = loss.actor_loss(batch.clone())
    with torch.no_grad():
        torch.manual_seed(7)
        sampled = loss.vae_network.module.decode(batch["observation"])
        perturbed = loss.actor_network.module(batch["observation"], sampled)
        with loss.qvalue_network_params[0].to_module(loss.qvalue_network):
            q1 = loss.qvalue_network.module(batch["observation"], perturbed)
    torch.testing.assert_close(value, -q1.mean())
    out = loss(batch.clone())
    for name, params in [("vae", loss.vae_network_params), ("qvalue", loss.qvalue_network_params)]:
        grads = torch.autograd.grad(out["loss_actor"], list(params.parameters()), allow_unused=True, retain_graph=True)
        assert all(g is None for g in grads), f"loss_actor reached the {name}"


def test_bcq_policy_picks_the_highest_q_candidate_deterministically():
    loss = _bcq()
    policy = BCQPolicy(loss, num_samples=8, seed=4)
    obs = TensorDict({"observation": torch.randn(5, 3)}, [5])
    a1, a2 = policy(obs.clone())["action"], policy(obs.clone())["action"]
    torch.testing.assert_close(a1, a2)
    vae, pert, qmod = loss.vae_network.module, loss.actor_network.module, loss.qvalue_network.module
    with torch.no_grad(), loss.qvalue_network_params[0].to_module(loss.qvalue_network):
        s = obs["observation"].repeat_interleave(8, 0)
        z = torch.randn(40, vae.latent_dim, generator=torch.Generator().manual_seed(4)).clamp(-0.5, 0.5)
        cand = pert(s, vae.decode(s, z))
        q1 = qmod(s, cand).reshape(5, 8)
        best = cand.reshape(5, 8, 2)[torch.arange(5), q1.argmax(-1)]
    torch.testing.assert_close(a1, best)


def test_discrete_bcq_by_hand():
    q = nets.make_discrete_qvalue(3, 3, H)
    q.out_keys = ["action_value"]
    q = type(q)(q.module, ["observation"], ["action_value"])
    g = type(q)(nets.mlp(3, 3, H), ["observation"], ["imitation_logits"])
    loss = DiscreteBCQLoss(q, g, threshold=0.3, loss_function="l2")
    loss.make_value_estimator(gamma=0.9)
    batch = _batch(discrete=True)
    out = loss(batch.clone())
    with torch.no_grad():
        s, s2, a = batch["observation"], batch["next", "observation"], batch["action"]
        probs = g.module(s2).softmax(-1)
        allowed = probs / probs.max(-1, keepdim=True).values > 0.3
        a2 = q.module(s2).masked_fill(~allowed, -1e9).argmax(-1)
        y = batch["next", "reward"].squeeze(-1) + 0.9 * (~batch["next", "terminated"].squeeze(-1)) * \
            q.module(s2).gather(-1, a2.unsqueeze(-1)).squeeze(-1)  # target == online at init
        pred = q.module(s).gather(-1, a.unsqueeze(-1)).squeeze(-1)
        logits = g.module(s)
    torch.testing.assert_close(out["loss_qvalue"], F.mse_loss(pred, y))
    torch.testing.assert_close(out["loss_imitation"], F.cross_entropy(logits, a) + 1e-2 * logits.pow(2).mean())
    assert bcq_allowed_actions(torch.log(torch.tensor([[0.5, 0.2, 0.3]])), 0.5).tolist() == [[True, False, True]]


# -- AWAC ---------------------------------------------------------------------------------------
def test_awac_weights_are_exp_advantage_over_beta_clipped():
    adv = torch.tensor([-1.0, 0.0, 0.5, 20.0])
    torch.testing.assert_close(awac_weights(adv, 0.5, 100.0),
                               torch.tensor([math.exp(-2), 1.0, math.e, 100.0]))


def test_awac_actor_loss_by_hand():
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    loss = AWACLoss(actor, q, beta=0.5, max_weight=3.0)
    loss.make_value_estimator(gamma=0.99)
    batch = _batch()
    torch.manual_seed(11)
    value, meta = loss.actor_loss(batch.clone())
    qmod = loss.qvalue_network.module

    def min_q(obs, act):
        qs = []
        for i in range(2):
            with loss.qvalue_network_params[i].to_module(loss.qvalue_network):
                qs.append(qmod(obs, act).squeeze(-1))
        return torch.stack(qs).min(0).values

    with torch.no_grad():
        torch.manual_seed(11)
        s, a = batch["observation"], batch["action"]
        with set_exploration_type(ExplorationType.RANDOM):
            pi_a = actor.get_dist(batch.clone()).sample()
        adv = min_q(s, a) - min_q(s, pi_a)
        w = torch.exp(adv / 0.5).clamp_max(3.0)
    log_prob = actor.get_dist(batch.clone()).log_prob(a)
    torch.testing.assert_close(value, -(w * log_prob).mean())
    torch.testing.assert_close(meta["advantage_mean"], adv.mean())


def test_awac_and_bcq_losses_learn():
    for build in ("awac", "bcq"):
        torch.manual_seed(0)
        batch = _batch(n=64)
        if build == "awac":
            loss = AWACLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H))
            key = "loss_qvalue"
        else:
            loss = _bcq()
            key = "loss_vae"
        loss.make_value_estimator(gamma=0.99)
        opt = torch.optim.Adam(loss.parameters(), lr=3e-3)
        first = None
        for _ in range(40):
            out = loss(batch.clone())
            total = sum(v for k, v in out.items() if k.startswith("loss_"))
            opt.zero_grad()
            total.backward()
            opt.step()
            first = out[key].detach() if first is None else first
        assert out[key] < first, build


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: AWACLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), beta=0.0), "beta"),
        (lambda: _bcq(lmbda=1.5), "lmbda"),
        (lambda: CQLLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), min_q_weight=-1.0),
         "min_q_weight"),
        (lambda: IQLLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H),
                         expectile=0.0), "expectile"),
    ],
)
def test_bad_hyperparameters_raise_user_errors(make, match):
    with pytest.raises(UserError, match=match):
        make()


def test_ensemble_per_member_path_equals_the_batched_one():
    from offline_plugins.objectives import _fused

    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(2, 8, 5, generator=g, requires_grad=True), torch.randn(2, 8, generator=g, requires_grad=True)),
              (torch.randn(2, 1, 8, generator=g, requires_grad=True), torch.randn(2, 1, generator=g, requires_grad=True))]
    x = torch.randn(16, 5, generator=g)
    params = [t for layer in layers for t in layer]
    batched = _fused.run_ensemble(layers, x)
    looped = _fused.run_ensemble(layers, x, per_member=True)
    torch.testing.assert_close(looped, batched)
    grads_b = torch.autograd.grad(batched.square().sum(), params)
    grads_l = torch.autograd.grad(looped.square().sum(), params)
    for a, b in zip(grads_l, grads_b):
        torch.testing.assert_close(a, b)


def test_fused_soft_update_matches_torchrl_soft_update():
    # TD3+BC has two target networks (actor and critics); both updaters see the same moves
    from offline_plugins.objectives.target import FusedSoftUpdate

    def build():
        torch.manual_seed(0)
        return TD3BCLoss(nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), action_spec=SPEC)

    ours, theirs = build(), build()
    fused, reference = FusedSoftUpdate(ours, tau=0.1), trl.SoftUpdate(theirs, tau=0.1)
    assert isinstance(fused, trl.SoftUpdate)
    for step in range(3):
        with torch.no_grad():
            for loss in (ours, theirs):
                for p in loss.parameters():
                    if p.requires_grad:
                        p.add_(0.01 * (step + 1))
        fused.step()
        reference.step()
    a, b = ours.state_dict(), theirs.state_dict()
    targets = [k for k in a if "target_" in k]
    assert any("actor" in k for k in targets) and any("qvalue" in k for k in targets)
    for k in targets:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-7)
        if k.endswith("weight"):  # the targets moved, towards but not onto the online weights
            assert not torch.equal(a[k], a[k.replace("target_", "")]), k


# -- device-agnostic: the fused paths run where the module is -------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_losses_run_where_the_module_is(device):
    # moved to `device`, IQL and TD3+BC (smoothing noise off: no device-specific draws) give
    # the CPU values; CQL's per-state estimator (one baddbmm off the CPU, per-member addmm on
    # it) and its gradients run there and stay finite
    import copy

    actor, q, v = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)
    det = nets.make_deterministic_actor(3, SPEC, H)
    losses = {
        "iql": IQLLoss(actor, q, v),
        "td3bc": TD3BCLoss(det, copy.deepcopy(q), action_spec=SPEC, policy_noise=0.0),
        "cql": CQLLoss(copy.deepcopy(actor), copy.deepcopy(q), num_random=3),
    }
    batch = _batch()
    for name, loss in losses.items():
        loss.make_value_estimator(gamma=0.99)
        moved = copy.deepcopy(loss).to(device)
        out = moved(batch.clone().to(device))
        terms = _loss_terms(out)
        assert all(t.device.type == device and torch.isfinite(t) for t in terms.values()), name
        sum(terms.values()).backward()
        assert all(p.grad is None or p.grad.device.type == device for p in moved.parameters()), name
        if name != "cql":  # CQL samples actions: the draws differ between devices
            ref = _loss_terms(loss(batch.clone()))
            for k in ref:
                torch.testing.assert_close(terms[k].cpu(), ref[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
