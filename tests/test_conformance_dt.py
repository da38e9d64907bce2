"""Our DT losses keep TorchRL's ``DTLoss`` / ``OnlineDTLoss`` contract: swapping the import changes nothing.

One test per contract point; the reference is TorchRL's own class, run on the same
actor and batch where numbers are compared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.data import Bounded
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.objectives import DTLoss, OnlineDTLoss

from offline_plugins.objectives.common import HyperparameterError
from offline_plugins.objectives.sequence.decision_transformer import (
    DecisionTransformerLoss,
    OnlineDecisionTransformerLoss,
)

OBS, ACT = 3, 2


def _det_actor():
    """A TorchRL-style deterministic actor: reads ``observation``, writes ``action``."""
    torch.manual_seed(0)
    return TensorDictModule(nn.Sequential(nn.Linear(OBS, ACT), nn.Tanh()), in_keys=["observation"], out_keys=["action"])


def _stoch_actor():
    torch.manual_seed(0)
    spec = Bounded(-torch.ones(ACT), torch.ones(ACT), (ACT,))
    module = TensorDictModule(
        nn.Sequential(nn.Linear(OBS, 2 * ACT), NormalParamExtractor()), in_keys=["observation"], out_keys=["loc", "scale"]
    )
    return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal)


def _batch(*shape):
    torch.manual_seed(1)
    return TensorDict(
        {"observation": torch.randn(*shape, OBS), "action": torch.rand(*shape, ACT) * 1.8 - 0.9}, batch_size=shape
    )


def test_dt_keys_and_output_names_are_torchrl_s():
    loss = DecisionTransformerLoss(_det_actor())
    assert (loss.tensor_keys.action_target, loss.tensor_keys.action_pred) == ("action", "action")
    assert loss.out_keys == ["loss"]
    assert list(loss(_batch(4)).keys()) == ["loss"]


@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 4)])
def test_dt_gives_torchrl_s_numbers_on_any_batch_shape_and_setting(shape):
    batch = _batch(*shape)
    for loss_function in ("l1", "l2", "smooth_l1"):
        for reduction in (None, "none", "mean", "sum"):
            kwargs = dict(loss_function=loss_function, reduction=reduction)
            ours, theirs = DecisionTransformerLoss(_det_actor(), **kwargs), DTLoss(_det_actor(), **kwargs)
            got, want = ours(batch.clone())["loss"], theirs(batch.clone())["loss"]
            torch.testing.assert_close(got, want)
            assert got.shape == (batch["action"].shape if reduction == "none" else ())


def test_dt_keyword_call_returns_out_keys_in_order():
    batch = _batch(2, 5)
    loss = DecisionTransformerLoss(_det_actor(), diagnostics=True)
    assert loss.out_keys == ["loss", "action_abs_error"]
    by_td = loss(batch.clone())
    by_name = loss(observation=batch["observation"], action=batch["action"])
    assert isinstance(by_name, tuple) and len(by_name) == 2
    for key, value in zip(loss.out_keys, by_name):
        torch.testing.assert_close(value, by_td[key])


def test_odt_keyword_call_returns_out_keys_in_order():
    batch = _batch(2, 5)
    loss = OnlineDecisionTransformerLoss(_stoch_actor())
    torch.manual_seed(0)
    by_td = loss(batch.clone())
    torch.manual_seed(0)
    by_name = loss(observation=batch["observation"], action=batch["action"])
    assert len(by_name) == len(loss.out_keys) == 5
    for key, value in zip(loss.out_keys, by_name):
        torch.testing.assert_close(value, by_td[key])
    loss.select_out_keys("loss_entropy")
    torch.manual_seed(0)
    torch.testing.assert_close(loss(observation=batch["observation"], action=batch["action"]), by_td["loss_entropy"])


def test_out_keys_list_exactly_what_forward_returns():
    batch = _batch(2, 5)
    cases = [
        DecisionTransformerLoss(_det_actor()),
        DecisionTransformerLoss(_det_actor(), diagnostics=True),
        DecisionTransformerLoss(_det_actor(), diagnostics=True, reduction="none"),
        OnlineDecisionTransformerLoss(_stoch_actor()),
        OnlineDecisionTransformerLoss(_stoch_actor(), reduction="none", scalar_output_mode="exclude"),
        OnlineDecisionTransformerLoss(_stoch_actor(), reduction="none", scalar_output_mode="non_tensor"),
    ]
    for loss in cases:
        assert sorted(loss(batch.clone()).keys()) == sorted(loss.out_keys), (type(loss).__name__, loss.reduction)
        # and a keyword call can fetch every one of them
        out = loss(observation=batch["observation"], action=batch["action"])
        assert len(out if isinstance(out, tuple) else (out,)) == len(loss.out_keys)


def test_dt_select_out_keys_works_in_a_fresh_process():
    # no TorchRL loss was built in this process before ours, so nothing tensordict sets up
    # on first instantiation of TorchRL's class can mask a broken out_keys setter
    code = textwrap.dedent(
        """
        import torch
        from tensordict import TensorDict
        from tensordict.nn import TensorDictModule
        from offline_plugins.objectives.sequence.decision_transformer import DecisionTransformerLoss
        actor = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action"])
        loss = DecisionTransformerLoss(actor, diagnostics=True)
        batch = TensorDict(observation=torch.randn(4, 3), action=torch.rand(4, 2), batch_size=[4])
        full = loss(batch.clone())
        loss.select_out_keys("loss")
        assert loss.out_keys == ["loss"], loss.out_keys
        assert set(loss(batch.clone()).keys()) == {"loss"}
        torch.testing.assert_close(loss(observation=batch["observation"], action=batch["action"]), full["loss"])
        loss.reset_out_keys()
        assert loss.out_keys == ["loss", "action_abs_error"], loss.out_keys
        print("ok")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_in_keys_are_the_batch_inputs_and_follow_set_keys():
    for cls in (DecisionTransformerLoss, OnlineDecisionTransformerLoss):
        actor = _det_actor() if cls is DecisionTransformerLoss else _stoch_actor()
        loss = cls(actor)
        assert loss.in_keys == ["action", "observation"]  # TorchRL's, with the default keys
        loss.set_keys(action_target="act", action_pred="pred")
        # the prediction is written by the actor, never read from the batch
        assert loss.in_keys == ["act", "observation"], cls.__name__
    loss = DecisionTransformerLoss(_det_actor())
    loss.set_keys(action_target="act")
    batch = _batch(4).rename_key_("action", "act")
    torch.testing.assert_close(loss(batch.clone())["loss"], loss(observation=batch["observation"], act=batch["act"]))


def test_hyperparameters_torchrl_accepts_are_accepted_and_others_fail_at_construction():
    DecisionTransformerLoss(_det_actor(), loss_function="smooth_l1", reduction="sum", device=torch.device("cpu"))
    OnlineDecisionTransformerLoss(
        _stoch_actor(), alpha_init=0.5, min_alpha=0.01, max_alpha=2.0, fixed_alpha=True, target_entropy=-1.0,
        samples_mc_entropy=3, reduction="mean",
    )
    with pytest.raises(HyperparameterError, match="loss_function='l3'"):
        DecisionTransformerLoss(_det_actor(), loss_function="l3")
    with pytest.raises(HyperparameterError, match="reduction='avg'"):
        DecisionTransformerLoss(_det_actor(), reduction="avg")
    with pytest.raises(HyperparameterError, match="reduction='avg'"):
        OnlineDecisionTransformerLoss(_stoch_actor(), reduction="avg")


def test_the_dt_shell_minimises_torchrl_s_loss_with_its_own_prediction_key():
    import dataclasses

    from offline_plugins.algorithms.sequence.dt import DTConfig, build
    from test_sequence_common import make_data

    data = make_data()
    cfg = dataclasses.replace(DTConfig(), context_len=5, batch_size=40, embed_dim=16, num_layers=1, warmup_steps=2)
    parts = build(cfg, data)
    assert parts.loss_keys() == ("loss",)
    assert parts.loss.tensor_keys.action_pred == "action_pred"  # our actor reads "action" as tokens
    out = parts.loss(data.replay_buffer(40, sampler="slice", slice_len=5, seed=0).sample())
    assert sorted(out.keys()) == sorted(parts.loss.out_keys) == ["action_abs_error", "loss"]
