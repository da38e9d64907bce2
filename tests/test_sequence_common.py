"""Shared synthetic trajectory data for the sequence-model tests, and the window helpers."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.algorithms.sequence import _common
from offline_plugins.objectives.sequence.common import ContextLengthError


def make_data(lengths=(30, 40, 25), obs_dim=3, act_dim=1, seed=0, reward_scale=1.0):
    """An ``OfflineData`` whose actions are a fixed function of the observation.

    Observations follow a smooth random walk, so windows have structure; actions are
    ``tanh(obs @ w)`` (learnable), rewards ``-|obs|^2``.
    """
    from torchrl.data import Bounded, Unbounded

    from offline_plugins.data.offline import DataStatistics, OfflineData

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(obs_dim, act_dim, generator=g)
    obs_l, next_l, act_l, rew_l, ep_l, term_l = [], [], [], [], [], []
    for i, T in enumerate(lengths):
        o = torch.cumsum(0.3 * torch.randn(T + 1, obs_dim, generator=g), 0)
        obs_l.append(o[:-1])
        next_l.append(o[1:])
        act_l.append(torch.tanh(o[:-1] @ w))
        rew_l.append(-(o[1:] ** 2).sum(-1, keepdim=True) * reward_scale)
        ep_l.append(torch.full((T,), i, dtype=torch.long))
        t = torch.zeros(T, 1, dtype=torch.bool)
        t[-1] = i % 2 == 0
        term_l.append(t)
    obs, nxt, act, rew, ep, term = (torch.cat(x) for x in (obs_l, next_l, act_l, rew_l, ep_l, term_l))
    N = obs.shape[0]
    trunc = torch.zeros(N, 1, dtype=torch.bool)
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    trunc[ends] = ~term[ends]
    rtg = torch.cat([r.flip(0).cumsum(0).flip(0) for r in rew_l])
    td = TensorDict(
        {
            "observation": obs,
            "action": act,
            "episode": ep,
            "return_to_go": rtg,
            "next": {"observation": nxt, "reward": rew, "done": term | trunc, "terminated": term, "truncated": trunc},
        },
        [N],
    )
    returns = torch.stack([r.sum() for r in rew_l]).double()
    return OfflineData(
        td=td,
        observation_spec=Unbounded((obs_dim,)),
        action_spec=Bounded(-torch.ones(act_dim), torch.ones(act_dim), (act_dim,)),
        action_space="continuous",
        dataset_id="synthetic/walk-v0",
        env_id=None,
        stats=DataStatistics(torch.zeros(obs_dim), torch.ones(obs_dim)),
        episode_returns=returns,
        episode_lengths=torch.tensor(lengths),
    )


def test_step_count_and_discounted_return_match_a_python_loop():
    data = make_data()
    ep = data.td["episode"]
    r = data.td["next", "reward"]
    g = _common.discounted_returns(ep, r, 0.9)
    expected = torch.zeros_like(r)
    for i in reversed(range(len(ep))):
        last = i == len(ep) - 1 or ep[i + 1] != ep[i]
        expected[i] = r[i] + (0 if last else 0.9 * expected[i + 1])
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-4)
    steps = _common.step_counts(ep).squeeze(-1)
    assert steps[:30].tolist() == list(range(30)) and steps[30:70].tolist() == list(range(40))


def test_window_longer_than_shortest_episode_is_refused_with_the_fix():
    data = make_data(lengths=(30, 12, 25))
    with pytest.raises(ContextLengthError, match=r"context_len=20 .* shortest episode \(12 steps\).*context_len=12"):
        _common.check_window(data, "dt", 20, "context_len", drop_short_episodes=False)
    with pytest.warns(UserWarning, match="left out"):
        _common.check_window(data, "dt", 20, "context_len", drop_short_episodes=True)
    with pytest.raises(ContextLengthError, match="longer than every episode"):
        _common.check_window(data, "dt", 50, "context_len", drop_short_episodes=True)
