"""Our ``IQLLoss`` / ``DiscreteIQLLoss`` keep TorchRL's contract: a user who swaps
``torchrl.objectives`` for ``offline_plugins.objectives`` gets the same module behaviour.

One test per contract point. Where we differ on purpose (paper defaults, range checks,
opt-in diagnostics) the test also checks that the documented argument gives TorchRL's behaviour.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torchrl.objectives as trl
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Bounded, OneHot
from torchrl.modules import OneHotCategorical, ProbabilisticActor

from offline_plugins.modules import networks as nets
from offline_plugins.objectives.common import HyperparameterError, MissingBatchKeyError
from offline_plugins.objectives.iql import DiscreteIQLLoss, IQLLoss

torch.set_num_threads(1)
SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))
H = (8,)
# TorchRL's hyperparameters, given explicitly where a test compares values with TorchRL's class
PAPER = dict(expectile=0.7, temperature=3.0, loss_function="l2")
DIAGNOSTICS = ["q_data_mean", "value_mean", "advantage_mean", "advantage_std", "advantage_weight_mean",
               "advantage_weight_clipped_frac"]
MC = ["mc_return_mean", "q_data_minus_mc"]

pytestmark = pytest.mark.filterwarnings("ignore:No target network updater:UserWarning")


def _continuous():
    return nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)


def _discrete(one_hot: bool = False, n: int = 4):
    if not one_hot:
        return nets.make_categorical_actor(3, n, H), nets.make_discrete_qvalue(3, n, H), nets.make_value(3, H)
    module = TensorDictModule(nn.Linear(3, n), in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticActor(module, in_keys=["logits"], spec=OneHot(n), distribution_class=OneHotCategorical)
    return actor, nets.make_discrete_qvalue(3, n, H), nets.make_value(3, H)


def _batch(batch_size=(8,), action=None, mc_return: bool = False, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    shape = tuple(batch_size)
    td = TensorDict(
        {
            "observation": torch.randn(*shape, 3, generator=g),
            "action": action if action is not None else torch.rand(*shape, 2, generator=g) * 2 - 1,
            ("next", "observation"): torch.randn(*shape, 3, generator=g),
            ("next", "reward"): torch.randn(*shape, 1, generator=g),
            ("next", "done"): torch.zeros(*shape, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(*shape, 1, dtype=torch.bool),
        },
        shape,
    )
    if mc_return:
        td["mc_return"] = torch.randn(*shape, 1, generator=g)
    return td


def _kwargs(td: TensorDict) -> dict:
    """The keyword-call form of a batch (``next_reward=...``), as TorchRL documents it."""
    return {"_".join(k) if isinstance(k, tuple) else k: v for k, v in td.items(True, True)}


def _pair(ours, theirs):
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    # not strict: checkpoint compatibility is its own test (test_state_dict_loads_both_ways_with_torchrl)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    return ours, theirs


def test_select_out_keys_works_in_a_fresh_process():
    # TorchRL's class must not have been instantiated first: that is what used to make it work
    code = textwrap.dedent(
        """
        import torch
        from torchrl.data import Bounded
        import torchrl.objectives.iql as torchrl_iql
        from offline_plugins.modules import networks as nets
        from offline_plugins.objectives.iql import DiscreteIQLLoss, IQLLoss

        class MyIQL(IQLLoss):  # a user's subclass, built before anything else
            pass

        spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        batch = dict(observation=torch.randn(4, 3), action=spec.rand((4,)), next_observation=torch.randn(4, 3),
                     next_reward=torch.randn(4, 1), next_done=torch.zeros(4, 1, dtype=torch.bool),
                     next_terminated=torch.zeros(4, 1, dtype=torch.bool))
        for loss in (
            MyIQL(nets.make_tanh_gaussian_actor(3, spec, (8,)), nets.make_qvalue(3, 2, (8,)), nets.make_value(3, (8,))),
            IQLLoss(nets.make_tanh_gaussian_actor(3, spec, (8,)), nets.make_qvalue(3, 2, (8,)), nets.make_value(3, (8,))),
        ):
            loss.make_value_estimator(gamma=0.99)
            assert loss.select_out_keys("loss_actor", "loss_value") is loss
            loss_actor, loss_value = loss(**batch)
            assert loss_actor.shape == loss_value.shape == ()
            assert loss.out_keys == ["loss_actor", "loss_value"], loss.out_keys
            loss.reset_out_keys()
            assert len(loss(**batch)) == len(loss.out_keys) > 2
        discrete = DiscreteIQLLoss(nets.make_categorical_actor(3, 4, (8,)), nets.make_discrete_qvalue(3, 4, (8,)),
                                   nets.make_value(3, (8,)))
        discrete.make_value_estimator(gamma=0.99)
        discrete.select_out_keys("loss_qvalue")
        batch["action"] = torch.randint(4, (4,))
        assert discrete(**batch).shape == ()
        # the point of the check: TorchRL's own classes were never built in this process
        assert isinstance(torchrl_iql.IQLLoss.__dict__["out_keys"], list)
        assert isinstance(torchrl_iql.DiscreteIQLLoss.__dict__["out_keys"], list)
        print("ok")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RL_WARNINGS": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _make(discrete: bool, **kwargs):
    loss = DiscreteIQLLoss(*_discrete(), **kwargs) if discrete else IQLLoss(*_continuous(), **kwargs)
    loss.make_value_estimator(gamma=0.99)
    return loss


def _batch_for(discrete: bool, **kwargs) -> TensorDict:
    return _batch(action=torch.randint(4, (8,)) if discrete else None, **kwargs)


@pytest.mark.parametrize("discrete", [False, True])
def test_diagnostics_follow_the_one_rule(discrete):
    # default: TorchRL's out_keys, in_keys and keyword call; diagnostics=True: listed after
    # TorchRL's keys; mc_diagnostics=True: the Monte-Carlo pair last, always returned, and a
    # batch without mc_return refused, naming the key and the fix
    theirs = (trl.DiscreteIQLLoss(*_discrete(), action_space="categorical") if discrete
              else trl.IQLLoss(*_continuous()))
    batch = _batch_for(discrete, mc_return=True)
    plain = batch.exclude("mc_return")

    default = _make(discrete)
    assert default.out_keys == theirs.out_keys == ["loss_actor", "loss_qvalue", "loss_value", "entropy"]
    assert set(default.in_keys) == set(theirs.in_keys)
    assert list(default(plain.clone()).keys()) == default.out_keys
    assert len(default(**_kwargs(plain))) == 4

    on = _make(discrete, diagnostics=True)
    assert on.out_keys == [*theirs.out_keys, *DIAGNOSTICS]
    assert set(on.in_keys) == set(theirs.in_keys)
    assert list(on(plain.clone()).keys()) == on.out_keys

    mc = _make(discrete, diagnostics=True, mc_diagnostics=True)
    assert mc.out_keys == [*theirs.out_keys, *DIAGNOSTICS, *MC]
    assert set(mc.in_keys) == {*theirs.in_keys, "mc_return"}
    out = mc(batch.clone())
    assert list(out.keys()) == mc.out_keys
    torch.testing.assert_close(out["mc_return_mean"], batch["mc_return"].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])
    assert len(mc(**_kwargs(batch))) == len(mc.out_keys)
    for call in (lambda: mc(plain.clone()), lambda: mc(**_kwargs(plain))):
        with pytest.raises(MissingBatchKeyError, match=r"'mc_return'.*mc_diagnostics=False"):
            call()
    with pytest.raises(HyperparameterError, match="diagnostics=True"):
        _make(discrete, mc_diagnostics=True)


@pytest.mark.parametrize("discrete", [False, True])
def test_keyword_call_returns_the_out_keys_in_order(discrete):
    loss = _make(discrete, diagnostics=True, mc_diagnostics=True)
    batch = _batch_for(discrete, mc_return=True)
    torch.manual_seed(0)
    out = loss(batch.clone())
    torch.manual_seed(0)
    values = loss(**_kwargs(batch))
    assert len(values) == len(loss.out_keys)
    for key, value in zip(loss.out_keys, values):
        torch.testing.assert_close(value, out[key], msg=key)


def test_expectile_one_is_accepted_as_torchrl_does():
    ours, theirs = _pair(IQLLoss(*_continuous(), expectile=1.0),
                         trl.IQLLoss(*_continuous(), expectile=1.0, temperature=3.0, loss_function="l2"))
    batch = _batch()
    a, b = ours(batch.clone()), theirs(batch.clone())
    for key in ("loss_actor", "loss_qvalue", "loss_value"):
        torch.testing.assert_close(a[key], b[key], msg=key)
    with pytest.raises(ValueError, match="expectile"):  # TorchRL's discrete loss refuses 1.0, and so do we
        DiscreteIQLLoss(*_discrete(), expectile=1.0)


def test_check_hyperparameters_false_accepts_what_torchrl_accepts():
    # outside our checked ranges, TorchRL takes any value; check_hyperparameters=False does too
    with pytest.raises(ValueError, match="temperature"):
        IQLLoss(*_continuous(), temperature=-1.0)
    loss = IQLLoss(*_continuous(), expectile=1.5, temperature=-1.0, check_hyperparameters=False)
    assert (loss.expectile, loss.temperature) == (1.5, -1.0)
    loss.make_value_estimator(gamma=0.99)
    assert torch.isfinite(loss(_batch())["loss_qvalue"])


def test_discrete_default_action_space_follows_the_actor():
    # TorchRL reads None as "one-hot" whatever the actor; ours reads the actor's spec, so
    # one-hot and categorical actors both work with the default
    for one_hot in (True, False):
        actor, q, v = _discrete(one_hot=one_hot)
        ours = DiscreteIQLLoss(actor, q, v)
        assert ours.action_space == ("one_hot" if one_hot else "categorical")
        theirs = trl.DiscreteIQLLoss(actor, q, v, action_space="one-hot" if one_hot else "categorical", **PAPER)
        ours, theirs = _pair(ours, theirs)
        index = torch.randint(4, (8,), generator=torch.Generator().manual_seed(1))
        batch = _batch(action=torch.nn.functional.one_hot(index, 4) if one_hot else index)
        a, b = ours(batch.clone()), theirs(batch.clone())
        for key in ("loss_actor", "loss_qvalue", "loss_value", "entropy"):
            torch.testing.assert_close(a[key], b[key], msg=f"one_hot={one_hot} {key}")


def test_nd_batch_writes_back_what_torchrl_writes():
    # a [B, T] batch from a collector, on the fused path (our plain MLPs, TD(0))
    ours, theirs = _pair(IQLLoss(*_continuous()), trl.IQLLoss(*_continuous(), **PAPER))
    assert ours._fused_blocker() is None
    batch = _batch((4, 5))
    mine, yours = batch.clone(), batch.clone()
    a, b = ours(mine), theirs(yours)
    for key in b.keys():
        torch.testing.assert_close(a[key], b[key], msg=key)
    for key in (ours.tensor_keys.priority, ours.tensor_keys.log_prob):
        assert key in mine.keys(), key
        torch.testing.assert_close(mine[key], yours[key], msg=key)


def test_diagnostics_count_only_the_positions_the_mask_keeps():
    loss = IQLLoss(*_continuous(), diagnostics=True, mc_diagnostics=True)
    loss.make_value_estimator(gamma=0.99)
    batch = _batch((4, 5), mc_return=True)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[:, :2] = True
    batch["collector", "mask"] = mask
    kept = loss(batch[:, :2].exclude("collector"))  # the same positions, unmasked
    masked = loss(batch)
    for key in ("q_data_mean", "mc_return_mean", "q_data_minus_mc", "value_mean", "advantage_mean", "loss_value"):
        torch.testing.assert_close(masked[key], kept[key], msg=key)


def test_state_dict_loads_both_ways_with_torchrl():
    pairs = [
        (IQLLoss(*_continuous()), trl.IQLLoss(*_continuous())),
        (DiscreteIQLLoss(*_discrete()), trl.DiscreteIQLLoss(*_discrete(), action_space="categorical")),
    ]
    for ours, theirs in pairs:
        assert set(ours.state_dict()) == set(theirs.state_dict()), type(ours).__name__
        ours.load_state_dict(theirs.state_dict())  # strict: a TorchRL checkpoint restores ours
        theirs.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("discrete", [False, True])
def test_columns_fill_mc_return_by_index_and_leave_torchrls_contract(discrete):
    # columns= fills the discounted mc_return by the batch's replay-buffer index before the key
    # check; they are no part of the state_dict, and with the defaults the keys stay TorchRL's
    from offline_plugins.objectives.columns import DatasetColumns

    column = torch.arange(10.0).unsqueeze(-1)
    columns = DatasetColumns({"mc_return": column})
    theirs = (trl.DiscreteIQLLoss(*_discrete(), action_space="categorical") if discrete
              else trl.IQLLoss(*_continuous()))
    theirs.make_value_estimator(gamma=0.99)
    plain = _make(discrete, columns=columns)
    assert plain.out_keys == theirs.out_keys and set(plain.in_keys) == set(theirs.in_keys)
    assert set(plain.state_dict()) == set(theirs.state_dict())
    mc = _make(discrete, diagnostics=True, mc_diagnostics=True, columns=columns)
    batch = _batch_for(discrete).set("index", torch.tensor([1, 3, 5, 7, 9, 0, 2, 4]))
    out = mc(batch)
    torch.testing.assert_close(out["mc_return_mean"], column[batch["index"]].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])
    with pytest.raises(MissingBatchKeyError, match=r"'mc_return'.*discounted at the loss's gamma.*columns="):
        mc(batch.exclude("index", "mc_return"))


def test_reduction_none_out_keys_match_the_output():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = IQLLoss(*_continuous(), reduction="none")  # TorchRL then drops the scalar entropy
    loss.make_value_estimator(gamma=0.99)
    batch = _batch()
    out = loss(batch.clone())
    assert list(out.keys()) == loss.out_keys == ["loss_actor", "loss_qvalue", "loss_value"]
    values = loss(**_kwargs(batch))
    assert len(values) == 3 and all(v.shape == (8,) for v in values)
