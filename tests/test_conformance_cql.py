"""Our CQL losses keep TorchRL's ``CQLLoss`` / ``DiscreteCQLLoss`` contract.

One test per contract point a user who swaps TorchRL's import for ours relies on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Categorical, OneHot
from torchrl.modules import QValueActor
from torchrl.objectives import CQLLoss as TorchRLCQLLoss
from torchrl.objectives import DiscreteCQLLoss as TorchRLDiscreteCQLLoss

from offline_plugins.modules import networks as nets
from offline_plugins.objectives.common import HyperparameterError, MissingBatchKeyError
from offline_plugins.objectives.cql import CQLLoss, DiscreteCQLLoss

pytestmark = pytest.mark.filterwarnings("ignore:No target network updater")

SPEC = Bounded(-torch.ones(2), torch.ones(2), (2,))
H = (8,)
MC = ["mc_return_mean", "q_data_minus_mc"]
#: what TorchRL's DiscreteCQLLoss.forward returns beyond its out_keys (so a keyword call leaves them out)
DISCRETE_METADATA = {"td_error", "pred_value", "target_value"}


def _continuous(**kwargs) -> CQLLoss:
    torch.manual_seed(0)
    loss = CQLLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H), num_random=3, **kwargs)
    loss.make_value_estimator(gamma=0.9)
    return loss


def _batch(*shape, mc_return=True) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    td = TensorDict(
        {
            "observation": torch.randn(*shape, 3, generator=g),
            "action": torch.rand(*shape, 2, generator=g) * 2 - 1,
            ("next", "observation"): torch.randn(*shape, 3, generator=g),
            ("next", "reward"): torch.randn(*shape, 1, generator=g),
            ("next", "done"): torch.zeros(*shape, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(*shape, 1, dtype=torch.bool),
        },
        list(shape),
    )
    if mc_return:
        td["mc_return"] = torch.randn(*shape, 1, generator=g)
    return td


def _keyword_args(td: TensorDict) -> dict:
    return {"_".join(k) if isinstance(k, tuple) else k: v for k, v in td.items(True, True)}


def _discrete(**kwargs) -> DiscreteCQLLoss:
    torch.manual_seed(0)
    loss = DiscreteCQLLoss(QValueActor(nets.mlp(3, 4, H), in_keys=["observation"], spec=Categorical(4)), **kwargs)
    loss.make_value_estimator(gamma=0.9)
    return loss


def _discrete_batch(*shape, mc_return=True) -> TensorDict:
    return _batch(*shape, mc_return=mc_return).exclude("action").set("action", torch.randint(4, shape))


@pytest.mark.parametrize("which", ["continuous", "lagrange", "discrete"])
def test_diagnostics_follow_the_one_rule(which):
    # default: TorchRL's out_keys, in_keys and keyword call; diagnostics=True: listed after
    # TorchRL's keys; mc_diagnostics=True: the Monte-Carlo pair last, always returned, and a
    # batch without mc_return refused, naming the key and the fix
    if which == "discrete":
        make, batch = _discrete, _discrete_batch(6)
        theirs = TorchRLDiscreteCQLLoss(QValueActor(nets.mlp(3, 4, H), in_keys=["observation"], spec=Categorical(4)))
        diagnostics, extra = ["q_data_mean", "cql_gap"], DISCRETE_METADATA
    else:
        lagrange = which == "lagrange"

        def make(**kwargs):
            return _continuous(with_lagrange=lagrange, **kwargs)

        batch = _batch(6)
        theirs = TorchRLCQLLoss(nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H),
                                with_lagrange=lagrange)
        diagnostics, extra = ["q_data_mean", "cql_gap", *(["alpha_prime"] if lagrange else [])], set()
    plain = batch.exclude("mc_return")

    default = make()
    assert default.out_keys == theirs.out_keys
    assert set(default.in_keys) == set(theirs.in_keys)
    assert set(default(plain.clone()).keys()) == {*default.out_keys, *extra}
    values = default(**_keyword_args(plain))
    assert isinstance(values, tuple) and len(values) == len(theirs.out_keys)

    on = make(diagnostics=True)
    assert on.out_keys == [*theirs.out_keys, *diagnostics]
    assert set(on.in_keys) == set(theirs.in_keys)
    assert set(on(plain.clone()).keys()) == {*on.out_keys, *extra}

    mc = make(diagnostics=True, mc_diagnostics=True)
    assert mc.out_keys == [*theirs.out_keys, *diagnostics, *MC]
    assert set(mc.in_keys) == {*theirs.in_keys, "mc_return"}
    out = mc(batch.clone())
    assert set(out.keys()) == {*mc.out_keys, *extra}
    torch.testing.assert_close(out["mc_return_mean"], batch["mc_return"].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])
    assert len(mc(**_keyword_args(batch))) == len(mc.out_keys)
    for call in (lambda: mc(plain.clone()), lambda: mc(**_keyword_args(plain))):
        with pytest.raises(MissingBatchKeyError, match=r"'mc_return'.*mc_diagnostics=False"):
            call()
    with pytest.raises(HyperparameterError, match="diagnostics=True"):
        make(mc_diagnostics=True)


def test_select_out_keys_works_in_a_fresh_process():
    # TorchRL's DiscreteCQLLoss declares out_keys as a class-level list that tensordict turns
    # into a property only when TorchRL's own class is instantiated: nothing of TorchRL's
    # may be instantiated before ours here
    code = textwrap.dedent(
        """
        import torch
        from tensordict import TensorDict
        from torchrl.modules import QValueActor
        from offline_plugins.objectives.cql import DiscreteCQLLoss

        qnet = QValueActor(torch.nn.Linear(3, 4), in_keys=["observation"], action_space="categorical")
        loss = DiscreteCQLLoss(qnet).select_out_keys("loss_cql")
        td = TensorDict({"observation": torch.randn(5, 3), "action": torch.randint(4, (5,)),
            ("next", "observation"): torch.randn(5, 3), ("next", "reward"): torch.randn(5, 1),
            ("next", "done"): torch.zeros(5, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(5, 1, dtype=torch.bool)}, [5])
        out = loss(td)
        assert loss.out_keys == ["loss_cql"], loss.out_keys
        assert [k for k in out.keys() if k.startswith("loss_")] == ["loss_cql"], list(out.keys())
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# reduction="none" with with_lagrange fails in TorchRL's forward (a scalar loss_alpha_prime); ours gives it per sample
@pytest.mark.parametrize("with_lagrange, reduction", [(False, "mean"), (True, "mean"), (False, "none"), (True, "none")])
def test_out_keys_list_exactly_what_forward_returns(with_lagrange, reduction):
    kwargs = {"scalar_output_mode": "exclude"} if reduction == "none" else {}
    loss = _continuous(with_lagrange=with_lagrange, reduction=reduction, **kwargs)
    out = loss(_batch(6))
    assert set(out.keys()) == set(loss.out_keys)
    # TorchRL's DiscreteCQLLoss also returns its metadata, outside its out_keys
    dloss = _discrete(reduction=reduction)
    assert set(dloss(_discrete_batch(6)).keys()) == {*dloss.out_keys, *DISCRETE_METADATA}


@pytest.mark.parametrize("conservative_term", ["paper", "torchrl"])
def test_lagrange_without_reduction_gives_per_sample_losses_whose_mean_is_the_reduced_loss(conservative_term):
    per_sample = _continuous(with_lagrange=True, reduction="none", scalar_output_mode="exclude",
                             conservative_term=conservative_term)
    reduced = _continuous(with_lagrange=True, conservative_term=conservative_term)
    with torch.no_grad():
        per_sample.log_alpha_prime.fill_(0.7)
        reduced.log_alpha_prime.fill_(0.7)
    torch.manual_seed(5)
    a = per_sample(_batch(6))
    torch.manual_seed(5)
    b = reduced(_batch(6))
    for key in ("loss_qvalue", "loss_cql", "loss_alpha_prime", "loss_actor", "loss_alpha"):
        assert a[key].shape == (6,), key
        assert a[key].mean().item() == pytest.approx(b[key].item(), rel=1e-5, abs=1e-6), key
    # the alpha' loss trains alpha' only, with the gradient of the reduced loss
    (g_a,) = torch.autograd.grad(a["loss_alpha_prime"].mean(), per_sample.log_alpha_prime)
    (g_b,) = torch.autograd.grad(b["loss_alpha_prime"], reduced.log_alpha_prime)
    assert g_a.item() == pytest.approx(g_b.item(), rel=1e-5)


def test_keyword_call_returns_the_out_keys_values_in_order():
    loss = _continuous(with_lagrange=True, diagnostics=True)
    td = _batch(6, mc_return=False)
    torch.manual_seed(3)
    expected = loss(td.clone())
    torch.manual_seed(3)
    values = loss(**_keyword_args(td))
    assert isinstance(values, tuple) and len(values) == len(loss.out_keys)
    got = dict(zip(loss.out_keys, values))
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=key)
    # after select_out_keys, the keyword call returns just the selection, in its order
    loss.select_out_keys("loss_cql", "cql_gap")
    torch.manual_seed(3)
    loss_cql, cql_gap = loss(**_keyword_args(td))
    torch.testing.assert_close(loss_cql, expected["loss_cql"])
    torch.testing.assert_close(cql_gap, expected["cql_gap"])


def test_collector_batches_with_a_time_dimension_match_flat_batches_and_respect_the_mask():
    loss = _continuous(with_lagrange=True)
    flat = _batch(12)
    seq = flat.reshape(3, 4)
    seq["collector", "mask"] = torch.ones(3, 4, dtype=torch.bool)
    torch.manual_seed(5)
    out_flat = loss(flat.clone())
    torch.manual_seed(5)
    out_seq = loss(seq.clone())
    for key in out_flat.keys():
        torch.testing.assert_close(out_seq[key], out_flat[key], msg=key)
    # padded steps (mask False) do not move any loss term
    seq["collector", "mask"][:, -1] = False
    torch.manual_seed(5)
    masked = loss(seq.clone())
    seq["next", "reward"][:, -1] += 100.0
    seq["action"][:, -1] *= -1
    torch.manual_seed(5)
    perturbed = loss(seq.clone())
    for key in [k for k in masked.keys() if k.startswith("loss_")]:
        torch.testing.assert_close(perturbed[key], masked[key], msg=key)
    none = _continuous(reduction="none", scalar_output_mode="exclude")
    assert none(seq.clone())["loss_cql"].shape == (3, 4)


@pytest.mark.parametrize("space, spec", [("one_hot", OneHot(4)), ("categorical", Categorical(4))])
def test_discrete_action_space_defaults_to_the_actors_spec(space, spec):
    torch.manual_seed(0)
    net = nets.mlp(3, 4, H)
    loss = DiscreteCQLLoss(QValueActor(net, in_keys=["observation"], spec=spec))
    loss.make_value_estimator(gamma=0.9)
    assert loss.action_space == space
    index = torch.randint(4, (6,))
    action = torch.nn.functional.one_hot(index, 4) if space == "one_hot" else index
    out = loss(_batch(6).exclude("action").set("action", action))
    with torch.no_grad():
        q = net(_batch(6)["observation"])
        gap = (torch.logsumexp(q, -1) - q.gather(-1, index.unsqueeze(-1)).squeeze(-1)).mean()
    torch.testing.assert_close(out["loss_cql"], gap)


@pytest.mark.parametrize("with_lagrange", [False, True])
def test_conservative_term_torchrl_reproduces_torchrls_numbers(with_lagrange):
    torch.manual_seed(0)
    actor, q = nets.make_tanh_gaussian_actor(3, SPEC, H), nets.make_qvalue(3, 2, H)
    settings = dict(num_random=3, with_lagrange=with_lagrange, min_q_weight=1.0, lagrange_thresh=0.0,
                    loss_function="smooth_l1")
    ours = CQLLoss(actor, q, conservative_term="torchrl", diagnostics=False, **settings)
    theirs = TorchRLCQLLoss(actor, q, **settings)
    theirs.load_state_dict(ours.state_dict())
    for loss in (ours, theirs):
        loss.make_value_estimator(gamma=0.9)
    batch = _batch(6)
    torch.manual_seed(7)
    a = ours(batch.clone())
    torch.manual_seed(7)
    b = theirs(batch.clone())
    assert ours.out_keys == theirs.out_keys
    assert set(a.keys()) == set(b.keys())
    for key in b.keys():
        torch.testing.assert_close(a[key], b[key], msg=key)


def test_min_q_weight_zero_is_accepted_as_torchrl_does_and_switches_the_term_off():
    loss = _continuous(min_q_weight=0.0, diagnostics=True)
    out = loss(_batch(6))
    assert "cql_gap" not in loss.out_keys and "cql_gap" not in out.keys()
    assert set(out.keys()) == set(loss.out_keys)
    plain = _continuous(min_q_weight=0.0, diagnostics=False)
    # with the conservative term off, the critic loss is the Bellman regression alone
    torch.manual_seed(3)
    with_term = _continuous(min_q_weight=1.0, diagnostics=False)(_batch(6))["loss_cql"]
    torch.manual_seed(3)
    assert plain(_batch(6))["loss_cql"].abs().item() == 0.0 and with_term.abs().item() > 0
