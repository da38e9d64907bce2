"""Diffuser: schedule, losses on windows, learning, EMA, inpainting and value guidance in the planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from offline_plugins.algorithms.sequence.diffuser import DiffuserConfig, build
from offline_plugins.config import ConfigError
from offline_plugins.modules.sequence.diffuser import DiffuserPlanner
from offline_plugins.modules.sequence.diffusion import DDPMSchedule
from offline_plugins.objectives.sequence.common import ContextLengthError
from test_sequence_common import make_data

SMALL = dict(slice_len=8, batch_size=64, n_diffusion_steps=5, dim=8, dim_mults=(1, 2), n_samples=4)


def _parts(data=None, **kw):
    return build(dataclasses.replace(DiffuserConfig(), **{**SMALL, **kw}), data if data is not None else make_data())


def test_schedule_noises_to_a_standard_normal():
    s = DDPMSchedule(20)
    assert bool((s.betas > 0).all()) and float(s.sqrt_alphas_cumprod[-1]) < 0.05
    x0 = torch.full((4000, 1, 1), 3.0)
    xt = s.q_sample(x0, torch.full((4000,), 19), torch.randn_like(x0))
    assert abs(float(xt.mean())) < 0.2 and abs(float(xt.std()) - 1) < 0.1


def test_losses_read_windows_and_decrease_with_training():
    torch.manual_seed(0)
    data = make_data(lengths=(16, 24))
    parts = _parts(data)
    assert {g.name: g.loss_keys for g in parts.optimizers} == {"diffusion": ("loss_diffusion",), "value": ("loss_value",)}
    rb = data.replay_buffer(64, sampler="slice", slice_len=8, seed=0)
    params = [p for g in parts.optimizers for p in g.params]
    opt = torch.optim.Adam(params, lr=3e-3)
    fixed = rb.sample()

    def evaluate():
        torch.manual_seed(1)  # same noise and steps for both measurements
        with torch.no_grad():
            out = parts.loss(fixed)
        return float(out["loss_diffusion"]), float(out["loss_value"])

    before = evaluate()
    for _ in range(80):
        out = parts.loss(rb.sample())
        opt.zero_grad()
        (out["loss_diffusion"] + out["loss_value"]).backward()
        opt.step()
        parts.target_updater.step()
    after = evaluate()
    assert after[0] < 0.7 * before[0] and after[1] < 0.5 * before[1]
    # the planner's denoiser is the moving average, which has moved towards the trained one
    ema = parts.loss.diffusion_loss.target_model_network_params
    online = parts.loss.diffusion_loss.model_network_params
    assert parts.policy.denoiser_params is ema
    gap = sum(float((e - o).detach().abs().sum()) for e, o in zip(ema.values(True, True), online.values(True, True)))
    assert gap > 0


def test_inpainting_keeps_the_conditioned_state_exactly():
    torch.manual_seed(0)
    parts = _parts()
    planner = parts.policy
    obs = torch.randn(3, 3)
    planner.reset()
    out = planner(TensorDict({"observation": obs}, [3]))
    assert out["action"].shape == (3, 1)
    loc, scale = planner.loc, planner.scale
    torch.testing.assert_close(planner.last_plan_normalized[:, 0, 1:], (obs - loc[1:]) / scale[1:], rtol=0, atol=0)
    plans, _ = planner.sample((obs - loc[1:]) / scale[1:])
    assert torch.equal(plans[:, 0, 1:], ((obs - loc[1:]) / scale[1:]).repeat_interleave(4, 0))
    assert planner(TensorDict({"observation": obs[0]}, []))["action"].shape == (1,)
    assert planner.planning_stats()["planned_actions"] == 4


def test_value_guidance_moves_plans_towards_higher_return():
    torch.manual_seed(0)
    C, H = 2, 8
    keys = ["noisy_trajectory", "diffusion_step"]

    class ZeroNoise(torch.nn.Module):
        def forward(self, x, t):
            return torch.zeros_like(x)

    class FirstAction(torch.nn.Module):
        """Return = the first action: guidance should push it up."""

        def forward(self, x, t):
            return x[:, :1, :1].reshape(-1, 1)

    def planner(scale):
        return DiffuserPlanner(TensorDictModule(ZeroNoise(), keys, ["model_output"]), TensorDictModule(FirstAction(), keys, ["value"]),
                               DDPMSchedule(10), observation_dim=1, action_dim=1, horizon=H, n_samples=32, guide_scale=scale, t_stopgrad=0,
                               predict_epsilon=True)

    obs = TensorDict({"observation": torch.zeros(1, 1)}, [1])
    torch.manual_seed(0)
    unguided = planner(0.0)
    unguided(obs)
    torch.manual_seed(0)
    guided = planner(5.0)
    guided(obs)
    assert float(guided.last_plan_values.mean()) > float(unguided.last_plan_values.mean()) + 0.5


def test_bad_windows_are_clear_errors():
    with pytest.raises(ConfigError, match=r"slice_len=12 must be divisible by 8"):
        _parts(slice_len=12, batch_size=48, dim_mults=(1, 2, 4, 8))
    with pytest.raises(ContextLengthError, match="slice_len=8 is longer than the dataset's shortest episode"):
        _parts(make_data(lengths=(30, 5, 25)))


def test_plan_every_executes_the_kept_plan_between_planning_steps():
    torch.manual_seed(0)
    planner = _parts(plan_every=2).policy
    planner.eval()
    obs = TensorDict({"observation": torch.randn(2, 3)}, [2])
    planner(obs.clone())
    plan = planner.last_plan_normalized.clone()
    second = planner(obs.clone())["action"]
    torch.testing.assert_close(second, plan[:, 1, :1] * planner.scale[:1] + planner.loc[:1])
    planner(obs.clone())  # a new plan
    assert not torch.equal(planner.last_plan_normalized, plan)


def test_denoised_plans_are_clipped_to_the_data_range():
    # the noisiest reverse step divides by sqrt(abar) ~ 0: unclipped, an untrained denoiser
    # sends actions far outside anything in the data; clipped, they stay in its range
    from offline_plugins.modules.sequence.unet import TemporalUnet, ValueUnet

    keys = ["noisy_trajectory", "diffusion_step"]
    obs = torch.randn(4, 3)
    actions = {}
    for clip in (False, True):
        torch.manual_seed(0)
        bounds = dict(low=-torch.ones(4), high=torch.ones(4)) if clip else {}
        planner = DiffuserPlanner(TensorDictModule(TemporalUnet(4, dim=8, dim_mults=(1, 2)), keys, ["model_output"]),
                                  TensorDictModule(ValueUnet(4, dim=8, dim_mults=(1, 2)), keys, ["value"]),
                                  DDPMSchedule(10), observation_dim=3, action_dim=1, horizon=8, n_samples=4,
                                  guide_scale=0.0, predict_epsilon=True, **bounds)
        actions[clip] = planner(TensorDict({"observation": obs}, [4]))["action"]
    assert actions[False].abs().max() > 1.5
    assert actions[True].abs().max() <= 1.0 + 1e-5
    # the clip bounds are rebuilt from the data, not saved: old checkpoints still load
    assert "x0_low" not in planner.state_dict()


def test_diffuser_build_clips_to_the_data_range_unless_told_not_to():
    data = make_data(lengths=(40, 40))
    parts = build(dataclasses.replace(DiffuserConfig(), slice_len=8, batch_size=16, dim=8), data)
    planner = parts.extra["planner"]
    table = torch.cat([data.td["action"], data.td["observation"]], -1)
    torch.testing.assert_close(planner.x0_low * planner.scale + planner.loc, table.amin(0))
    assert planner._clip
    off = build(dataclasses.replace(DiffuserConfig(), slice_len=8, batch_size=16, dim=8, clip_denoised=False), make_data(lengths=(40, 40)))
    assert not off.extra["planner"]._clip


def _first_action_errors(parts, data, n=64):
    """Mean |a_planned - a_data| of the unguided plan's first action on ``n`` data states,
    beside answering 0 and beside shuffled data actions."""
    planner = parts.policy
    g = torch.Generator().manual_seed(1)
    idx = torch.randperm(data.td.shape[0], generator=g)[:n]
    obs, act = data.td["observation"][idx], data.td["action"][idx]
    planner.eval()
    torch.manual_seed(2)
    with torch.no_grad():
        planned = planner(TensorDict({"observation": obs}, [n]))["action"]
    err = lambda a: float((a - act).abs().mean())  # noqa: E731
    return err(planned), err(torch.zeros_like(act)), err(act[torch.randperm(n, generator=g)])


def test_unguided_denoiser_reproduces_the_data_actions():
    # the issue-26 failure: the planned first action was as far from the data's as
    # answering 0; here the data's actions are a fixed function of the state
    torch.manual_seed(0)
    data = make_data(lengths=(40, 40, 40, 40), seed=3)
    parts = _parts(data, guide_scale=0.0, n_samples=1, n_diffusion_steps=10, dim=16, ema_tau=0.05)
    rb = data.replay_buffer(128, sampler="slice", slice_len=8, seed=0)
    opt = torch.optim.Adam(parts.optimizers[0].params, lr=3e-3)
    before, zero, shuffled = _first_action_errors(parts, data)
    for _ in range(150):
        out = parts.loss.diffusion_loss(rb.sample())
        opt.zero_grad()
        out["loss_diffusion"].backward()
        opt.step()
        parts.target_updater.step()
    after, zero, shuffled = _first_action_errors(parts, data)
    assert after < 0.4 * zero and after < 0.4 * shuffled and after < 0.5 * before, (before, after, zero, shuffled)
