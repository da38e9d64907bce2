"""Trajectory Transformer: discretiser round trip and bin checks, loss on windows, learning, beam-search planning."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.algorithms.sequence.tt import TTConfig, build
from offline_plugins.modules.sequence.discretizer import Discretizer
from offline_plugins.modules.sequence.trajectory_transformer import TrajectoryTransformerNet, TrajectoryTransformerPlanner
from offline_plugins.objectives.sequence.common import ContextLengthError, DiscretizationError
from test_sequence_common import make_data

SMALL = dict(slice_len=4, batch_size=32, bins=20, embed_dim=32, num_layers=1, num_heads=2, dropout=0.0,
             horizon=2, beam_width=4, n_expand=2, max_context_transitions=4)


def _parts(data=None, **kw):
    return build(dataclasses.replace(TTConfig(), **{**SMALL, **kw}), data if data is not None else make_data())


@pytest.mark.parametrize("method", ["uniform", "quantile"])
def test_discretiser_round_trip_is_within_half_a_bin_per_dimension(method):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(500, 1, generator=g), 10 * torch.rand(500, 1, generator=g), torch.randn(500, 1, generator=g).exp()], -1)
    d = Discretizer.fit(x, bins=32, method=method)
    tokens = d.encode(x)
    assert tokens.dtype == torch.int64 and int(tokens.min()) >= 0 and int(tokens.max()) < 32
    err = (d.decode(tokens) - x).abs()
    assert bool((err <= d.max_error() + 1e-5).all())
    if method == "uniform":
        torch.testing.assert_close(d.max_error(), (x.max(0).values - x.min(0).values) / 64)
    else:  # equal mass: every bin holds about 1/32 of the data
        counts = torch.stack([torch.bincount(tokens[:, j], minlength=32) for j in range(3)])
        assert int(counts.min()) >= 10 and int(counts.max()) <= 22
    # dimension slices encode like the whole vector
    assert torch.equal(d.encode(x[:, 1:], start=1), tokens[:, 1:])


def test_too_few_bins_is_a_clear_error():
    with pytest.raises(DiscretizationError, match="bins=1 is too few"):
        Discretizer.fit(torch.randn(10, 2), bins=1)
    with pytest.raises(DiscretizationError, match=r"3 bins reconstruct observation\[\d\].*use more bins, at least"):
        _parts(bins=3)
    with pytest.raises(ContextLengthError, match="slice_len=4"):
        _parts(make_data(lengths=(30, 3, 25)))


def test_loss_tokenises_flat_windows_and_decreases():
    torch.manual_seed(0)
    data = make_data(lengths=(12, 15))
    parts = _parts(data, lr=3e-3, warmup_steps=1)
    rb = data.replay_buffer(32, sampler="slice", slice_len=4, seed=0)
    batch = rb.sample()
    tokens = parts.loss.tokens(batch)
    assert tokens.shape == (8, 4 * (3 + 1 + 2))
    # the value column is the discounted return with the termination penalty
    assert "discounted_return_to_go" in data.td.keys()
    groups = [g for g in parts.optimizers]
    assert {g.name for g in groups} == {"model", "model_no_decay"} and parts.loss_keys() == ("loss_model",)
    params = [p for g in groups for p in g.params]
    opt = torch.optim.Adam(params, lr=3e-3)
    first = None
    for _ in range(60):
        out = parts.loss(rb.sample())
        first = out["loss_model"].detach() if first is None else first
        opt.zero_grad()
        out["loss_model"].backward()
        opt.step()
    assert float(out["loss_model"].detach()) < 0.6 * float(first)
    assert 0.0 <= float(out["token_accuracy"]) <= 1.0 and not out["action_ce"].requires_grad


def test_beam_search_returns_decodable_actions_and_keeps_context():
    torch.manual_seed(0)
    parts = _parts()
    planner = parts.policy
    assert isinstance(planner, TrajectoryTransformerPlanner)
    planner.reset()
    for t in range(6):
        out = planner(TensorDict({"observation": torch.randn(3, 3), "reward": torch.full((3, 1), -1.0)}, [3]))
    a = out["action"]
    assert a.shape == (3, 1) and bool((a.abs() <= 1).all())
    # decoded actions are bin midpoints of the action dimension
    centers = planner.discretizer.centers[3]
    assert bool(torch.isin(a.reshape(-1), centers).all())
    # the context holds max_context_transitions - 1 finished transitions
    assert planner._context.shape == (3, 3 * planner.D)
    reward_token = planner.discretizer.encode(torch.tensor([[-1.0]]), start=4)
    assert bool((planner._context[:, -planner.D + 4] == reward_token.reshape(-1)).all())
    stats = planner.planning_stats()
    assert stats["planned_actions"] == 18 and stats["plan_ms_per_action"] > 0
    planner.reset()
    single = planner(TensorDict({"observation": torch.zeros(3)}, []))["action"]
    assert single.shape == (1,)


def test_planner_prefers_the_plan_with_the_higher_predicted_return():
    torch.manual_seed(0)
    S, A, bins = 1, 1, 4
    disc = Discretizer(torch.tensor([[0.0, 1, 2, 3, 4]] * 4))
    net = TrajectoryTransformerNet(S + A + 2, bins, embed_dim=8, num_layers=1, num_heads=1, max_transitions=4)

    class Oracle(torch.nn.Module):
        """Reward and value tokens = the action token before them; everything else token 0."""

        max_len = net.max_len

        def forward(self, tokens):
            T = tokens.shape[1]
            logits = torch.zeros(tokens.shape[0], T, bins)
            logits[..., 0] = 5.0
            if (T - 1) % 4 == 1:  # next token is the reward: copy the action
                logits[:, -1] = -5.0
                logits[torch.arange(tokens.shape[0]), -1, tokens[:, -1]] = 5.0
            if (T - 1) % 4 == 2:  # next token is the value (the return from this step on): the action again
                logits[:, -1] = -5.0
                logits[torch.arange(tokens.shape[0]), -1, tokens[:, -2]] = 5.0
            if (T - 1) % 4 == 0:  # next token is the action: uniform
                logits[:, -1] = 0.0
            return logits

    planner = TrajectoryTransformerPlanner(Oracle(), disc, S, A, horizon=1, beam_width=8, n_expand=16, cdf_act=None, max_context_transitions=4)
    out = planner(TensorDict({"observation": torch.zeros(2, 1)}, [2]))
    assert out["action"].tolist() == [[3.5], [3.5]]  # the highest action earns the highest reward


def test_cached_beam_search_plans_exactly_like_the_uncached_one(monkeypatch):
    data = make_data()
    parts = _parts(data, slice_len=8, batch_size=32, horizon=3, max_context_transitions=2)
    planner = parts.policy
    planner.eval()
    obs = TensorDict({"observation": torch.randn(2, 3), "reward": torch.zeros(2, 1)}, [2])
    assert planner._fits_cache(planner.D + 3)

    def run():
        torch.manual_seed(0)
        planner.reset()
        return [planner(obs.clone())["action"] for _ in range(3)]

    cached = run()
    monkeypatch.setattr(planner, "_fits_cache", lambda prefix_len: False)
    assert all(torch.equal(a, b) for a, b in zip(cached, run()))


def test_plan_every_executes_the_kept_plan_between_planning_steps():
    torch.manual_seed(0)
    parts = _parts(slice_len=8, batch_size=32, horizon=3, max_context_transitions=2, plan_every=3)
    planner = parts.policy
    planner.eval()
    obs = TensorDict({"observation": torch.randn(2, 3), "reward": torch.zeros(2, 1)}, [2])
    planner(obs.clone())
    plan = planner._plan.clone()
    second = planner(obs.clone())["action"]
    D = planner.D
    torch.testing.assert_close(second, planner.discretizer.decode(plan[:, D : D + 1], start=3))


def test_planner_scores_a_plan_by_its_value_token_without_counting_the_reward_twice():
    # the value token is the return from step t on, r_t included: a one-step plan is worth
    # E[V_0]; with two steps, r_0 + gamma * E[V_1]
    S, A, bins = 1, 1, 4
    disc = Discretizer(torch.tensor([[0.0, 1, 2, 3, 4]] * 4))
    net = TrajectoryTransformerNet(S + A + 2, bins, embed_dim=8, num_layers=1, num_heads=1, max_transitions=4)

    class Fixed(torch.nn.Module):
        """Every token is 1 (center 1.5), except value tokens: 3 (center 3.5)."""

        max_len = net.max_len

        def forward(self, tokens):
            T = tokens.shape[1]
            logits = torch.full((tokens.shape[0], T, bins), -30.0)
            logits[..., 1] = 30.0
            if (T - 1) % 4 == 2:
                logits[:, -1] = -30.0
                logits[:, -1, 3] = 30.0
            return logits

    for horizon, expected in ((1, 3.5), (2, 1.5 + 0.9 * 3.5)):
        planner = TrajectoryTransformerPlanner(Fixed(), disc, S, A, horizon=horizon, beam_width=2, n_expand=1,
                                               cdf_act=None, max_context_transitions=4, discount=0.9)
        captured = []
        topk = torch.Tensor.topk

        def spy(values, *a, **kw):
            captured.append(values.clone())
            return topk(values, *a, **kw)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.Tensor, "topk", spy)
            planner(TensorDict({"observation": torch.zeros(1, 1)}, [1]))
        torch.testing.assert_close(captured[-1], torch.full_like(captured[-1], expected))


def _action_errors(parts, data, n=64):
    """Mean |a - a_data| on ``n`` data states of the action model's greedy action from the
    state's tokens, of the planner's action, of answering 0 and of shuffled data actions."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randperm(data.td.shape[0], generator=g)[:n]
    obs, act = data.td["observation"][idx], data.td["action"][idx]
    disc, net, S = parts.loss.discretizer, parts.policy.net, obs.shape[-1]
    net.eval()
    with torch.no_grad():
        greedy = disc.decode(net(disc.encode(obs))[:, -1:].argmax(-1), start=S)
        torch.manual_seed(2)
        parts.policy.reset()
        planned = parts.policy(TensorDict({"observation": obs}, [n]))["action"]
    err = lambda a: float((a - act).abs().mean())  # noqa: E731
    return err(greedy), err(planned), err(torch.zeros_like(act)), err(act[torch.randperm(n, generator=g)])


def test_action_model_predicts_the_data_actions():
    # the issue-26 check: the data's actions are a fixed function of the state; after a
    # short training the action model and the planner must be far closer to them than
    # answering 0 or a shuffled data action
    torch.manual_seed(0)
    data = make_data(lengths=(40, 40, 40, 40), seed=3)
    parts = _parts(data, lr=3e-3, warmup_steps=1, bins=20, horizon=1, beam_width=4, max_context_transitions=1)
    rb = data.replay_buffer(64, sampler="slice", slice_len=4, seed=0)
    opt = torch.optim.Adam([p for g in parts.optimizers for p in g.params], lr=3e-3)
    before = _action_errors(parts, data)
    parts.policy.net.train()
    for _ in range(150):
        out = parts.loss(rb.sample())
        opt.zero_grad()
        out["loss_model"].backward()
        opt.step()
    greedy, planned, zero, shuffled = _action_errors(parts, data)
    assert greedy < 0.4 * zero and greedy < 0.4 * shuffled and greedy < 0.5 * before[0], (before, greedy, zero, shuffled)
    assert planned < 0.5 * zero and planned < 0.5 * shuffled, (planned, zero, shuffled)
