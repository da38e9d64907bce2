"""Our ``TD3BCLoss`` and ``BCLoss`` keep TorchRL's contract: swapping the import changes nothing.

One test per contract point; the reference is TorchRL's own class, run on the same
networks, parameters and batch where numbers are compared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torchrl import objectives as trl
from torchrl.data import Bounded
from torchrl.modules import Actor

from offline_plugins.modules import networks as nets
from offline_plugins.objectives.bc import BCLoss
from offline_plugins.objectives.common import HyperparameterError, MissingBatchKeyError
from offline_plugins.objectives.td3_bc import TD3BCLoss

OBS, ACT, H = 3, 2, (8,)
SPEC = Bounded(-torch.ones(ACT), torch.ones(ACT), (ACT,))
MC = ["mc_return_mean", "q_data_minus_mc"]


def _td3bc(**kwargs):
    torch.manual_seed(0)
    actor, qvalue = nets.make_deterministic_actor(OBS, SPEC, H), nets.make_qvalue(OBS, ACT, H)
    loss = TD3BCLoss(actor, qvalue, action_spec=SPEC, **kwargs)
    loss.make_value_estimator(gamma=0.9)
    return loss


def _transitions(*shape, mc_return=True):
    torch.manual_seed(1)
    td = TensorDict(
        {
            "observation": torch.randn(*shape, OBS),
            "action": SPEC.rand(shape),
            ("next", "observation"): torch.randn(*shape, OBS),
            ("next", "reward"): torch.randn(*shape, 1),
            ("next", "done"): torch.zeros(*shape, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(*shape, 1, dtype=torch.bool),
        },
        shape,
    )
    if mc_return:
        td["mc_return"] = torch.randn(*shape, 1)
    return td


def _categorical_bc(**kwargs):
    torch.manual_seed(0)
    return BCLoss(nets.make_categorical_actor(OBS, 4, H), **kwargs)


def _categorical_batch(n=6):
    torch.manual_seed(1)
    return TensorDict({"observation": torch.randn(n, OBS), "action": torch.randint(4, (n,))}, [n])


@pytest.mark.parametrize("which", ["td3bc", "bc"])
def test_select_out_keys_works_in_a_fresh_process(which):
    # TorchRL's own class is never built in the child: ours must not lean on it
    build = {
        "td3bc": """
            from offline_plugins.objectives.td3_bc import TD3BCLoss
            actor, qvalue = nets.make_deterministic_actor(3, spec, (8,)), nets.make_qvalue(3, 2, (8,))
            loss = TD3BCLoss(actor, qvalue, action_spec=spec)
            kw = dict(observation=torch.randn(4, 3), action=spec.rand((4,)), next_observation=torch.randn(4, 3),
                      next_reward=torch.randn(4, 1), next_done=torch.zeros(4, 1, dtype=torch.bool),
                      next_terminated=torch.zeros(4, 1, dtype=torch.bool))
            selected = ("loss_actor", "loss_qvalue")
        """,
        "bc": """
            from offline_plugins.objectives.bc import BCLoss
            loss = BCLoss(nets.make_categorical_actor(3, 4, (8,)), diagnostics=True)
            kw = dict(observation=torch.randn(4, 3), action=torch.randint(4, (4,)))
            selected = ("loss_bc",)
        """,
    }[which]
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("ignore")
        import torch
        from torchrl.data import Bounded
        from offline_plugins.modules import networks as nets
        spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        """
    ) + textwrap.dedent(build) + textwrap.dedent(
        """
        loss.select_out_keys(*selected)
        assert list(loss.out_keys) == list(selected), loss.out_keys
        out = loss(**kw)
        out = out if isinstance(out, tuple) else (out,)
        assert len(out) == len(selected) and all(t.shape == () for t in out)
        print("ok")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _keyword_args(td: TensorDict) -> dict:
    return {"_".join(key) if isinstance(key, tuple) else key: value for key, value in td.items(True, True)}


def test_td3bc_diagnostics_follow_the_one_rule():
    # default: TorchRL's out_keys, in_keys and keyword call; diagnostics=True: listed after
    # TorchRL's keys; mc_diagnostics=True: the Monte-Carlo pair last, always returned, and a
    # batch without mc_return refused, naming the key and the fix
    default = _td3bc()
    theirs = trl.TD3BCLoss(default.actor_network, default.qvalue_network, action_spec=SPEC)
    batch = _transitions(5)
    plain = batch.exclude("mc_return")

    assert default.out_keys == theirs.out_keys
    assert set(default.in_keys) == set(theirs.in_keys)
    assert set(default(plain.clone()).keys()) == set(default.out_keys)
    assert len(default(**_keyword_args(plain))) == len(theirs.out_keys)

    on = _td3bc(diagnostics=True)
    assert on.out_keys == [*theirs.out_keys, "q_data_mean"]
    assert set(on.in_keys) == set(theirs.in_keys)
    assert set(on(plain.clone()).keys()) == set(on.out_keys)

    mc = _td3bc(diagnostics=True, mc_diagnostics=True)
    assert mc.out_keys == [*theirs.out_keys, "q_data_mean", *MC]
    assert set(mc.in_keys) == {*theirs.in_keys, "mc_return"}
    out = mc(batch.clone())
    assert set(out.keys()) == set(mc.out_keys)
    torch.testing.assert_close(out["mc_return_mean"], batch["mc_return"].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])
    assert len(mc(**_keyword_args(batch))) == len(mc.out_keys)
    calls = (lambda: mc(plain.clone()), lambda: mc(**_keyword_args(plain)),
             lambda: mc.loss_terms(plain.clone(), ["loss_qvalue"]))
    for call in calls:
        with pytest.raises(MissingBatchKeyError, match=r"'mc_return'.*mc_diagnostics=False"):
            call()
    with pytest.raises(HyperparameterError, match="diagnostics=True"):
        _td3bc(mc_diagnostics=True)


def test_bc_diagnostics_follow_the_one_rule():
    # BC has no critic, so no Monte-Carlo pair: TorchRL's keys by default, the diagnostic after
    default = _categorical_bc()
    theirs = trl.BCLoss(default.actor_network)
    assert default.out_keys == theirs.out_keys == ["loss_bc"]
    assert set(default.in_keys) == set(theirs.in_keys)
    batch = _categorical_batch()
    assert set(default(batch.clone()).keys()) == {"loss_bc"}
    assert default(**_keyword_args(batch)).shape == ()  # TorchRL's keyword call: the loss alone
    on = _categorical_bc(diagnostics=True)
    assert on.out_keys == ["loss_bc", "log_prob_data_mean"]
    assert set(on.in_keys) == set(theirs.in_keys)
    assert set(on(batch.clone()).keys()) == set(on.out_keys)
    with pytest.raises(TypeError, match="mc_diagnostics"):
        _categorical_bc(diagnostics=True, mc_diagnostics=True)


def test_keyword_call_returns_what_the_tensordict_call_returns():
    loss = _td3bc(diagnostics=True, mc_diagnostics=True)
    batch = _transitions(5)
    torch.manual_seed(2)
    expected = loss(batch.clone())
    torch.manual_seed(2)
    got = loss(**_keyword_args(batch))
    assert isinstance(got, tuple) and len(got) == len(loss.out_keys)
    for key, value in zip(loss.out_keys, got):
        torch.testing.assert_close(value, expected[key], msg=key)


def test_bc_default_loss_regresses_a_deterministic_actor():
    # TorchRL's ``Actor`` (a Delta distribution): with no loss_function TorchRL regresses it by MSE
    torch.manual_seed(0)
    actor = Actor(nn.Linear(OBS, ACT), spec=SPEC)
    batch = TensorDict({"observation": torch.randn(8, OBS), "action": SPEC.rand((8,))}, [8])
    ours, theirs = BCLoss(actor), trl.BCLoss(actor)
    loss = ours(batch.clone())["loss_bc"]
    torch.testing.assert_close(loss, theirs(batch.clone())["loss_bc"])
    torch.testing.assert_close(loss, F.mse_loss(actor(batch.clone())["action"], batch["action"]))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.parameters())


def test_bc_pad_mask_excludes_padded_steps_for_a_categorical_policy():
    loss = _categorical_bc()
    loss.set_keys(pad_mask="action_is_pad")
    batch = _categorical_batch(6)
    pad = torch.tensor([False, False, True, False, True, True])
    batch["action_is_pad"] = pad
    logits = loss.actor_network.module[0].module(batch["observation"])
    expected = F.cross_entropy(logits[~pad], batch["action"][~pad])
    torch.testing.assert_close(loss(batch)["loss_bc"], expected)


def test_td3bc_n_d_batch_gives_torchrl_shapes_and_priorities():
    # a [B, T] batch: every output and the written priority keep TorchRL's shapes and values
    ours = _td3bc(diagnostics=False)
    theirs = trl.TD3BCLoss(ours.actor_network, ours.qvalue_network, action_spec=SPEC, loss_function="l2")
    theirs.load_state_dict(ours.state_dict(), strict=False)
    theirs.make_value_estimator(gamma=0.9)
    batch = _transitions(4, 3, mc_return=False)
    a, b = batch.clone(), batch.clone()
    torch.manual_seed(3)
    out_ours = ours(a)
    torch.manual_seed(3)
    out_theirs = theirs(b)
    for key in out_theirs.keys():
        torch.testing.assert_close(out_ours[key], out_theirs[key], msg=key)
    assert a["td_error"].shape == (4, 3)
    torch.testing.assert_close(a["td_error"], b["td_error"])


def test_td3bc_diagnostics_count_only_unmasked_positions():
    loss = _td3bc(diagnostics=True, mc_diagnostics=True)
    batch = _transitions(4, 3)
    valid = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [False, False, False]])
    batch["collector", "mask"] = valid.unsqueeze(-1)
    out = loss(batch.clone())
    q_data = out["pred_value"].min(0).values
    mc = batch["mc_return"].squeeze(-1)
    torch.testing.assert_close(out["q_data_mean"], q_data[valid].mean())
    torch.testing.assert_close(out["mc_return_mean"], mc[valid].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], (q_data - mc)[valid].mean())


def test_td3bc_alpha_zero_is_accepted_as_torchrl_does_and_leaves_pure_behaviour_cloning():
    loss = _td3bc(alpha=0.0)
    batch = _transitions(6)
    out = loss(batch.clone())
    with torch.no_grad():
        td = batch.clone()
        loss.actor_network(td)
        bc = F.mse_loss(td["action"], batch["action"])
    torch.testing.assert_close(out["loss_actor"].detach(), bc)
