"""Decision Transformer: loss on sampled windows, overfitting, the rolling-context policy, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.algorithms.sequence.dt import DTConfig, build
from offline_plugins.config import ConfigError
from offline_plugins.objectives.sequence.common import ContextLengthError, TargetReturnWarning
from test_sequence_common import make_data

SMALL = dict(context_len=5, batch_size=40, embed_dim=32, num_layers=1, num_heads=1, dropout=0.0, warmup_steps=10)


def _parts(data=None, **kw):
    cfg = dataclasses.replace(DTConfig(), **{**SMALL, **kw})
    return build(cfg, data if data is not None else make_data())


def test_loss_reads_flat_slice_sampler_windows():
    data = make_data()
    parts = _parts(data)
    batch = data.replay_buffer(40, sampler="slice", slice_len=5, seed=0).sample()
    assert batch.shape == (40,)
    out = parts.loss(batch)
    assert out["loss"].shape == () and torch.isfinite(out["loss"])
    assert not out["action_abs_error"].requires_grad
    out["loss"].backward()
    assert all(p.grad is not None for p in parts.optimizers[0].params if p.requires_grad)
    assert parts.loss_keys() == ("loss",)


def test_a_few_steps_overfit_a_tiny_dataset():
    torch.manual_seed(0)
    data = make_data(lengths=(12, 15))
    parts = _parts(data, lr=3e-3, warmup_steps=1)
    rb = data.replay_buffer(40, sampler="slice", slice_len=5, seed=0)
    opt = parts.optimizers[0].make_optimizer()
    first = None
    for _ in range(150):
        loss = parts.loss(rb.sample())["loss"]
        first = loss.detach() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.1 * float(first)


def test_warmup_scheduler_ramps_the_learning_rate():
    parts = _parts(warmup_steps=4)
    opt = parts.optimizers[0].make_optimizer()
    sched = parts.lr_schedulers[0](opt)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4 / 4) and lrs[3:] == pytest.approx([1e-4] * 3)


def test_policy_keeps_and_rolls_its_context_like_a_training_window():
    data = make_data()
    parts = _parts(data, target_return=-50.0)
    policy, net = parts.policy, parts.loss.actor_network.net
    net.eval()
    policy.reset()
    obs = torch.randn(8, 2, 3)
    actions = []
    for t in range(8):
        td = TensorDict({"observation": obs[t], "reward": torch.full((2, 1), -2.0)}, [2])
        actions.append(policy(td)["action"])
    assert policy.context_length == 5
    # the last action is the network's prediction on the last 5 steps, as in training
    window_obs = obs[3:8].transpose(0, 1)
    window_act = torch.stack(actions[3:8], 1).clone()
    window_act[:, -1] = 0
    rtg = (-50.0 + 2.0 * torch.arange(3, 8, dtype=torch.float32)).expand(2, 5).unsqueeze(-1)
    steps = torch.arange(3, 8).expand(2, 5)
    expected = net(window_obs, window_act, rtg, steps)[:, -1]
    torch.testing.assert_close(actions[-1], expected)
    # rows may drop out as episodes end; env_index says which is which
    a = policy(TensorDict({"observation": obs[0, 1:], "reward": torch.zeros(1, 1), "env_index": torch.tensor([1])}, [1]))
    assert a["action"].shape == (1, 1)
    with pytest.raises(ValueError, match="env_index"):  # rows dropped, but which?
        policy(TensorDict({"observation": obs[0, 1:]}, [1]))
    policy.reset()
    assert policy.context_length == 0
    single = policy(TensorDict({"observation": torch.zeros(3)}, []))["action"]
    assert single.shape == (1,) and policy.return_to_go.tolist() == [[-50.0]]


def test_context_longer_than_shortest_episode_is_a_clear_error():
    with pytest.raises(ContextLengthError, match="shortest episode"):
        _parts(make_data(lengths=(30, 4, 25)), context_len=5)
    with pytest.raises(ConfigError, match="multiple of context_len"):
        _parts(batch_size=42)


def test_target_return_of_wrong_sign_or_scale_warns():
    data = make_data()  # returns are negative
    with pytest.warns(TargetReturnWarning, match="opposite sign"):
        _parts(data, target_return=3600.0)
    best = float(data.episode_returns.max())
    with pytest.warns(TargetReturnWarning, match="far outside"):
        _parts(data, target_return=best * 1000)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetReturnWarning)
        parts = _parts(data)  # default: the best return in the data
    assert parts.extra["target_return"] == pytest.approx(best)


def test_online_dt_variant_trains_its_likelihood_and_acts_deterministically():
    from offline_plugins.algorithms.sequence.odt import ODTConfig
    from offline_plugins.algorithms.sequence.odt import build as build_odt

    torch.manual_seed(0)
    data = make_data(lengths=(12, 15))
    cfg = dataclasses.replace(ODTConfig(), **{**SMALL, "num_heads": 2, "lr": 3e-3, "eval_context_len": 3})
    parts = build_odt(cfg, data)
    assert {g.name: g.loss_keys for g in parts.optimizers} == {
        "actor": ("loss_log_likelihood", "loss_entropy"),
        "alpha": ("loss_alpha",),
    }
    rb = data.replay_buffer(40, sampler="slice", slice_len=5, seed=0)
    opt = torch.optim.Adam([p for g in parts.optimizers for p in g.params], lr=3e-3)
    first = None
    for _ in range(60):
        out = parts.loss(rb.sample())
        first = out["loss_log_likelihood"].detach() if first is None else first
        opt.zero_grad()
        sum(out[k] for k in parts.loss_keys()).backward()
        opt.step()
    assert float(out["loss_log_likelihood"].detach()) < float(first) - 0.5
    policy = parts.policy
    policy.eval()
    obs = TensorDict({"observation": torch.randn(2, 3), "reward": torch.zeros(2, 1)}, [2])
    a1 = [policy(obs.clone())["action"] for _ in range(4)]
    assert policy.context_length == 3 and a1[-1].shape == (2, 1)
    policy.eval()  # resets: the same first step gives the same action
    assert torch.equal(policy(obs.clone())["action"], a1[0])
