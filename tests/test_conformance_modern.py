"""SAC-N, EDAC, ReBRAC and Cal-QL keep the contract of the TorchRL losses they extend
(``SACLoss``; ``TD3BCLoss`` and ``CQLLoss`` through ours): ``select_out_keys`` in a fresh
process, reductions, ``[B, T]`` batches with a collector mask, renamed keys.
SAC-N is compared number for number with TorchRL's ``SACLoss``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torchrl import objectives as trl
from torchrl.data import Bounded

from offline_plugins.modules import networks as nets
from offline_plugins.objectives.cal_ql import CalQLLoss
from offline_plugins.objectives.edac import EDACLoss, SACNLoss
from offline_plugins.objectives.rebrac import ReBRACLoss

torch.set_num_threads(1)
OBS, ACT, H = 3, 2, (8,)
SPEC = Bounded(-torch.ones(ACT), torch.ones(ACT), (ACT,))
LOSS_KEYS = ("loss_actor", "loss_qvalue", "loss_alpha")


def _transitions(*shape):
    from tensordict import TensorDict

    torch.manual_seed(1)
    return TensorDict({
        "observation": torch.randn(*shape, OBS),
        "action": SPEC.rand(shape),
        ("next", "observation"): torch.randn(*shape, OBS),
        ("next", "action"): SPEC.rand(shape),
        ("next", "reward"): torch.randn(*shape, 1),
        ("next", "done"): torch.zeros(*shape, 1, dtype=torch.bool),
        ("next", "terminated"): torch.zeros(*shape, 1, dtype=torch.bool),
        "mc_return": torch.randn(*shape, 1),
    }, shape)


def _make(name, **kw):
    torch.manual_seed(0)
    gauss, det = nets.make_tanh_gaussian_actor(OBS, SPEC, H), nets.make_deterministic_actor(OBS, SPEC, H)
    q = nets.make_qvalue(OBS, ACT, H)
    loss = {
        "sac-n": lambda: SACNLoss(gauss, q, num_qvalue_nets=3, action_spec=SPEC, **kw),
        "edac": lambda: EDACLoss(gauss, q, num_qvalue_nets=3, action_spec=SPEC, **kw),
        "rebrac": lambda: ReBRACLoss(det, q, action_spec=SPEC, **kw),
        "cal-ql": lambda: CalQLLoss(gauss, q, num_random=2, action_spec=SPEC, **kw),
    }[name]()
    loss.make_value_estimator(gamma=0.9)
    return loss


@pytest.mark.parametrize("name, cls", [("sac-n", "SACNLoss"), ("edac", "EDACLoss"), ("rebrac", "ReBRACLoss"),
                                       ("cal-ql", "CalQLLoss")])
def test_select_out_keys_works_in_a_fresh_process(name, cls):
    module = {"sac-n": "edac", "edac": "edac", "rebrac": "rebrac", "cal-ql": "cal_ql"}[name]
    actor = "make_deterministic_actor" if name == "rebrac" else "make_tanh_gaussian_actor"
    code = textwrap.dedent(f"""
        import torch
        from torchrl.data import Bounded
        from offline_plugins.modules import networks as nets
        from offline_plugins.objectives.{module} import {cls}
        spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        loss = {cls}(nets.{actor}(3, spec, (8,)), nets.make_qvalue(3, 2, (8,)), action_spec=spec)
        loss.make_value_estimator(gamma=0.9)
        loss.select_out_keys("loss_qvalue", "loss_actor")
        kw = dict(observation=torch.randn(4, 3), action=spec.rand((4,)), next_observation=torch.randn(4, 3),
                  next_action=spec.rand((4,)), next_reward=torch.randn(4, 1), mc_return=torch.randn(4, 1),
                  next_done=torch.zeros(4, 1, dtype=torch.bool), next_terminated=torch.zeros(4, 1, dtype=torch.bool))
        names = ["_".join(k) if isinstance(k, tuple) else k for k in loss.in_keys]
        q, a = loss(**{{k: kw[k] for k in names}})
        print(q.shape == () and a.shape == ())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sac_n_matches_torchrl_sac_under_each_reduction(reduction):
    ours = _make("sac-n", reduction=reduction)
    theirs = trl.SACLoss(ours.actor_network, ours.qvalue_network, num_qvalue_nets=3, loss_function="l2",
                         action_spec=SPEC, reduction=reduction)
    theirs.make_value_estimator(gamma=0.9)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    batch = _transitions(2, 3)
    torch.manual_seed(0)
    a = ours(batch.clone())
    torch.manual_seed(0)
    b = theirs(batch.clone())
    assert set(a.keys()) == set(ours.out_keys)
    for k in LOSS_KEYS:
        torch.testing.assert_close(a[k], b[k], msg=k)
    if reduction == "none":
        assert a["loss_qvalue"].shape == (2, 3) and "alpha" not in ours.out_keys


def test_sac_n_applies_the_collector_mask_as_torchrl():
    ours = _make("sac-n", diagnostics=True)
    theirs = trl.SACLoss(ours.actor_network, ours.qvalue_network, num_qvalue_nets=3, loss_function="l2",
                         action_spec=SPEC)
    theirs.make_value_estimator(gamma=0.9)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    batch = _transitions(2, 4)
    batch["collector", "mask"] = torch.tensor([[True, True, True, False], [True, True, False, False]])
    torch.manual_seed(0)
    a = ours(batch.clone())
    torch.manual_seed(0)
    b = theirs(batch.clone())
    for k in LOSS_KEYS:
        torch.testing.assert_close(a[k], b[k], msg=k)
    # the diagnostics count only the valid positions
    valid = batch["collector", "mask"]
    torch.manual_seed(0)
    flat = ours(batch[valid].clone())
    torch.testing.assert_close(a["q_data_mean"], flat["q_data_mean"])


@pytest.mark.parametrize("name", ["sac-n", "edac", "rebrac", "cal-ql"])
def test_renamed_keys_give_the_same_values(name):
    plain, renamed = _make(name), _make(name)
    renamed.load_state_dict(plain.state_dict(), strict=False)
    renamed.set_keys(action="act", reward="rew")
    if name == "cal-ql":
        renamed.set_keys(mc_return="bound")
    batch = _transitions(5)
    other = batch.clone()
    other.rename_key_("action", "act")
    other.rename_key_(("next", "action"), ("next", "act"))
    other.rename_key_(("next", "reward"), ("next", "rew"))
    if name == "cal-ql":
        other.rename_key_("mc_return", "bound")
    # the actor and critic read the renamed action through their own keys
    for module in (renamed.actor_network, renamed.qvalue_network):
        module.in_keys = ["act" if k == "action" else k for k in module.in_keys]
    if name == "rebrac":
        renamed.actor_network.out_keys = ["act"]
    else:
        renamed.actor_network.out_keys = ["act" if k == "action" else k for k in renamed.actor_network.out_keys]
    torch.manual_seed(0)
    a = plain(batch)
    torch.manual_seed(0)
    b = renamed(other)
    for k in ("loss_qvalue", "loss_actor"):
        torch.testing.assert_close(a[k], b[k], msg=k)
