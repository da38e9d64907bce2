"""The fused loss paths compute what TorchRL's losses compute, or are not taken.

``IQLLoss`` and ``TD3BCLoss`` replace TorchRL's code by hand-written maths when the networks
are ours. Each value estimator TorchRL's loss accepts, each subclass override of a loss
method, must give TorchRL's numbers: by the fused path where it is exact, by TorchRL's own
code otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrl import objectives as trl
from torchrl.data import Bounded
from torchrl.objectives.utils import ValueEstimators

from _synthetic import synthetic_transitions
from offline_plugins.modules import networks as nets
from offline_plugins.objectives.iql import IQLLoss
from offline_plugins.objectives.td3_bc import TD3BCLoss

torch.set_num_threads(1)
SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))
H = (16, 16)
DOCS = Path(__file__).resolve().parents[1] / "docs"

# (estimator, hyperparameters): every estimator both losses accept, TD(0) also with a
# non-default gamma and with standardised rewards
ESTIMATORS = [
    (ValueEstimators.TD0, {"gamma": 0.99}),
    (ValueEstimators.TD0, {"gamma": 0.8}),
    (ValueEstimators.TD0, {"gamma": 0.99, "average_rewards": True}),
    (ValueEstimators.TD1, {"gamma": 0.95}),
    (ValueEstimators.TDLambda, {"gamma": 0.99, "lmbda": 0.95}),
    (ValueEstimators.TDLambda, {"gamma": 0.9, "lmbda": 0.5}),
]
_IDS = [f"{vt.name}-" + "-".join(f"{k}={v}" for k, v in hp.items()) for vt, hp in ESTIMATORS]


def test_the_estimator_cases_cover_what_torchrl_supports():
    for cls in (trl.IQLLoss, trl.TD3BCLoss):
        assert set(cls.SUPPORTED_VALUE_ESTIMATORS) == {vt for vt, _ in ESTIMATORS}


def _batch(n: int = 40):
    # ordered episodes of 10 steps (3 of them terminal), so multi-step targets differ from TD(0)
    return synthetic_transitions(n, obs_dim=3, action_dim=2, seed=2)[1]


def _iql_pair(ours_cls=IQLLoss, theirs_cls=trl.IQLLoss):
    spec = Bounded(-2 * torch.ones(2), torch.ones(2), (2,))
    actor, q, v = nets.make_tanh_gaussian_actor(3, spec, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)
    ours = ours_cls(actor, q, v, diagnostics=True)  # the diagnostics ride along on the fused path
    theirs = theirs_cls(actor, q, v, expectile=0.7, temperature=3.0, loss_function="l2")
    return ours, theirs


def _td3bc_pair(ours_cls=TD3BCLoss, theirs_cls=trl.TD3BCLoss):
    actor, q = nets.make_deterministic_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    return ours_cls(actor, q, action_spec=SPEC), theirs_cls(actor, q, action_spec=SPEC, loss_function="l2")


def _iql_batch():
    batch = _batch()
    batch["action"] = batch["action"].clamp(-1, 1) * 1.5 - 0.5  # inside the asymmetric bounds
    return batch


def _exact_on_fused_path(value_type, hyperparams) -> bool:
    return value_type is ValueEstimators.TD0 and not hyperparams.get("average_rewards", False)


def _agree(ours, theirs, batch, *, seed=0, terms=None):
    """Every loss term, and the gradients of their sum, equal on the same parameters, batch and seed."""
    theirs.load_state_dict(ours.state_dict(), strict=False)
    torch.manual_seed(seed)
    out_a = ours(batch.clone()) if terms is None else ours.loss_terms(batch.clone(), terms)
    torch.manual_seed(seed)
    out_b = theirs(batch.clone())
    # TorchRL's code path (the fallback) computes every term even when fewer are asked for
    a = {k: out_a[k] for k in (terms or out_a.keys()) if k.startswith("loss_")}
    b = {k: out_b[k] for k in (terms or out_b.keys()) if k.startswith("loss_")}
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    sum(a.values()).backward()
    sum(b.values()).backward()
    grads_b = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None or grads_b[name].grad is not None:
            torch.testing.assert_close(p.grad, grads_b[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    return out_a


# -- every value estimator: our loss equals TorchRL's ---------------------------------------------
def _pair_with_estimator(make_pair, value_type, hyperparams):
    """``make_pair()`` with the value estimator made after construction (TorchRL's pattern); ours takes its
    fused path exactly where that path is exact."""
    ours, theirs = make_pair()
    for loss in (ours, theirs):
        loss.make_value_estimator(value_type, **hyperparams)
    assert (ours._fused_blocker() is None) == _exact_on_fused_path(value_type, hyperparams)
    return ours, theirs


@pytest.mark.parametrize(("value_type", "hyperparams"), ESTIMATORS, ids=_IDS)
def test_iql_equals_torchrl_for_every_value_estimator(value_type, hyperparams):
    ours, theirs = _pair_with_estimator(_iql_pair, value_type, hyperparams)
    out = _agree(ours, theirs, _iql_batch())
    assert {"q_data_mean", "advantage_mean", "value_mean"} <= set(out.keys())


@pytest.mark.parametrize(("value_type", "hyperparams"), ESTIMATORS, ids=_IDS)
def test_td3bc_equals_torchrl_for_every_value_estimator(value_type, hyperparams):
    ours, theirs = _pair_with_estimator(_td3bc_pair, value_type, hyperparams)
    _agree(ours, theirs, _batch(), seed=3)  # same seed: the same target-policy noise


@pytest.mark.parametrize(("value_type", "hyperparams"), ESTIMATORS, ids=_IDS)
def test_td3bc_critic_only_terms_equal_torchrl_for_every_value_estimator(value_type, hyperparams):
    ours, theirs = _pair_with_estimator(_td3bc_pair, value_type, hyperparams)
    _agree(ours, theirs, _batch(), seed=3, terms=["loss_qvalue"])


def test_td0_with_n_step_data_honours_steps_to_next_obs():
    # TorchRL's TD(0) discounts n-step transitions by gamma ** steps_to_next_obs; its IQL
    # qvalue_loss drops that root key before the estimator sees it, its TD3+BC keeps it
    steps = torch.randint(1, 4, (40, 1), generator=torch.Generator().manual_seed(0))
    for ours, theirs, b, seed in ((*_iql_pair(), _iql_batch(), 0), (*_td3bc_pair(), _batch(), 3)):
        b["steps_to_next_obs"] = steps
        for loss in (ours, theirs):
            loss.make_value_estimator(gamma=0.9)
        assert ours._fused_blocker() is None  # handled by the fused path itself
        _agree(ours, theirs, b, seed=seed)


def test_two_dimensional_batches_equal_torchrl():
    estimators = ((ValueEstimators.TD0, {"gamma": 0.99}), (ValueEstimators.TDLambda, {"gamma": 0.99, "lmbda": 0.9}))
    for value_type, hp in estimators:
        for (ours, theirs), batch, seed in ((_iql_pair(), _iql_batch(), 0), (_td3bc_pair(), _batch(), 3)):
            for loss in (ours, theirs):
                loss.make_value_estimator(value_type, **hp)
            _agree(ours, theirs, batch.reshape(4, 10), seed=seed)


def test_a_loss_mask_in_the_batch_is_applied_as_torchrl_does():
    for (ours, theirs), batch, seed in ((_iql_pair(), _iql_batch(), 0), (_td3bc_pair(), _batch(), 3)):
        batch["collector", "mask"] = torch.arange(batch.shape[0]) % 3 != 0
        for loss in (ours, theirs):
            loss.make_value_estimator(gamma=0.99)
        _agree(ours, theirs, batch, seed=seed)


def test_fast_path_is_taken_only_for_plain_td0():
    for ours, _ in (_iql_pair(), _td3bc_pair()):
        assert ours._fused_blocker() is None  # default estimator: TD(0)
        ours.make_value_estimator(gamma=0.9)
        assert ours._fused_blocker() is None
        ours.make_value_estimator(ValueEstimators.TDLambda, gamma=0.99, lmbda=0.95)
        assert "TDLambda" in ours._fused_blocker()
        ours.make_value_estimator(ValueEstimators.TD0, gamma=0.99)  # and back
        assert ours._fused_blocker() is None
        ours.make_value_estimator(ValueEstimators.TD0, gamma=0.99, average_rewards=True)
        assert "average_rewards" in ours._fused_blocker()


def test_fused_false_takes_torchrl_path():
    actor, q, v = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), nets.make_value(3, H)
    assert "fused=False" in IQLLoss(actor, q, v, fused=False)._fused_blocker()
    actor = nets.make_deterministic_actor(3, SPEC, H)
    assert "fused=False" in TD3BCLoss(actor, q, action_spec=SPEC, fused=False)._fused_blocker()


@pytest.mark.parametrize("value_type", [v for v in ValueEstimators if v not in trl.IQLLoss.SUPPORTED_VALUE_ESTIMATORS])
def test_estimators_torchrl_refuses_are_refused(value_type):
    # GAE, VTrace, ...: TorchRL's IQL and TD3+BC refuse them; ours do the same
    for ours, theirs in (_iql_pair(), _td3bc_pair()):
        for loss in (theirs, ours):
            with pytest.raises(NotImplementedError, match="is not implemented for loss"):
                loss.make_value_estimator(value_type, gamma=0.99)


# -- subclass overrides of the loss methods ---------------------------------------------------------
def _doubled(method_name):
    """A mixin doubling one loss method's term, applied to ours and TorchRL's alike."""

    def method(self, tensordict):
        loss, metadata = getattr(super(mixin, self), method_name)(tensordict)
        return 2.0 * loss, metadata

    mixin = type(f"Doubled_{method_name}", (), {method_name: method})
    return mixin


def _doubled_pair(method_name, make_pair, ours_cls, theirs_cls):
    """``make_pair`` of ours and TorchRL's loss, each subclassed with ``method_name``'s term doubled, with their
    value estimators; ours sees the override (it blocks the fused path)."""
    mixin = _doubled(method_name)
    ours, theirs = make_pair(type(f"Our{ours_cls.__name__}", (mixin, ours_cls), {}),
                             type(f"Their{theirs_cls.__name__}", (mixin, theirs_cls), {}))
    assert method_name in ours._fused_blocker()
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.99)
    return ours, theirs


@pytest.mark.parametrize("method_name", ["actor_loss", "qvalue_loss", "value_loss"])
def test_iql_subclass_override_is_honoured(method_name):
    ours, theirs = _doubled_pair(method_name, _iql_pair, IQLLoss, trl.IQLLoss)
    _agree(ours, theirs, _iql_batch())


@pytest.mark.parametrize("method_name", ["actor_loss", "qvalue_loss"])
def test_td3bc_subclass_override_is_honoured(method_name):
    ours, theirs = _doubled_pair(method_name, _td3bc_pair, TD3BCLoss, trl.TD3BCLoss)
    _agree(ours, theirs, _batch(), seed=3)


# -- every loss the docs name is importable from offline_plugins.objectives ------------------------
# named in the docs, not ours and not in torchrl.objectives: a third-party plugin's example
# (docs/plugins.md) and TorchRL's torchrl.objectives.llm.GRPOLoss, SFTLoss, CISPOLoss and DistillationLoss
_NOT_OURS = {"AWRLoss", "GRPOLoss", "SFTLoss", "CISPOLoss", "DistillationLoss"}


def test_every_loss_in_the_docs_imports_from_objectives():
    import offline_plugins.objectives as objectives

    named = set()
    for page in DOCS.rglob("*.md"):
        named |= set(re.findall(r"\b([A-Z]\w*Loss)\b", page.read_text()))
    named -= _NOT_OURS
    assert {"IQLLoss", "TD3BCLoss", "CQLLoss", "DPOLoss"} <= named  # the scan works
    for name in sorted(named):
        if name in objectives.__all__:
            cls = getattr(objectives, name)
            assert isinstance(cls, type) and cls.__name__ == name, name
            assert cls.__module__.startswith("offline_plugins.objectives."), name
        else:  # only TorchRL's own losses may be named without being ours
            assert hasattr(trl, name), f"docs name {name}, which offline_plugins.objectives does not export"
    for name in objectives.__all__:
        getattr(objectives, name)
    # the classes the docs point to by path are the ones exported
    for page in DOCS.rglob("*.md"):
        for module, name in re.findall(r"offline_plugins\.objectives\.([\w.]+):(\w+)", page.read_text()):
            assert getattr(objectives, name) is getattr(__import__(f"offline_plugins.objectives.{module}",
                                                                   fromlist=[name]), name)


def test_importing_objectives_stays_cheap():
    code = (
        "import sys; import offline_plugins.objectives as o; "
        "assert 'IQLLoss' in dir(o); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
    from offline_plugins.objectives import IQLLoss as exported

    assert exported is IQLLoss
    with pytest.raises(AttributeError, match="NoSuchLoss"):
        from offline_plugins import objectives

        objectives.NoSuchLoss
