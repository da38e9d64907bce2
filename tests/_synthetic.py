"""A tiny in-memory transition dataset in TED layout, for the tests (not shipped in the package).

The task: the best action is ``tanh(W s)`` (continuous) or ``argmax(W s)`` (discrete);
the reward is higher the closer the behaviour action is to it; episodes last
``episode_len`` steps. The behaviour policy is the best action plus noise, so BC,
and the value-based methods, have something to learn. ``return_to_go`` holds the
Monte-Carlo discounted return of the data from each step (the data layer's is
undiscounted; the losses' Monte-Carlo diagnostics read neither, but ``mc_return``, which
the algorithms' ``build`` computes from the episodes at the loss's gamma).

>>> data, batch = synthetic_transitions(40, obs_dim=3, action_dim=2, seed=0)
>>> data.action_space, tuple(batch["action"].shape), tuple(batch["next", "reward"].shape)
('continuous', (40, 2), (40, 1))
>>> data, batch = synthetic_transitions(40, obs_dim=3, num_actions=4, seed=0)
>>> data.action_space, batch["action"].dtype
('discrete', torch.int64)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

__all__ = ["synthetic_transitions"]


def synthetic_transitions(
    n: int,
    *,
    obs_dim: int = 3,
    action_dim: int = 1,
    num_actions: Optional[int] = None,
    episode_len: int = 10,
    gamma: float = 0.99,
    noise: float = 0.3,
    seed: int = 0,
):
    """``(data, batch)``: specs and ``td`` (the transitions, as ``OfflineData.td``) in a
    ``SimpleNamespace`` (what ``build`` reads), and the same ``n`` transitions."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import Bounded, Categorical, Unbounded

    g = torch.Generator().manual_seed(seed)
    discrete = num_actions is not None
    out_dim = int(num_actions) if discrete else action_dim
    w = torch.randn(obs_dim, out_dim, generator=g)
    n_ep = -(-n // episode_len)
    obs = torch.zeros(n_ep, episode_len + 1, obs_dim)
    obs[:, 0] = torch.randn(n_ep, obs_dim, generator=g)
    for t in range(episode_len):
        obs[:, t + 1] = 0.9 * obs[:, t] + 0.3 * torch.randn(n_ep, obs_dim, generator=g)
    s, s_next = obs[:, :-1], obs[:, 1:]
    scores = s @ w
    if discrete:
        explore = torch.rand(n_ep, episode_len, generator=g) < noise
        random_a = torch.randint(out_dim, (n_ep, episode_len), generator=g)
        action = torch.where(explore, random_a, scores.argmax(-1))
        reward = (action == scores.argmax(-1)).float() - 0.1 * torch.randn(n_ep, episode_len, generator=g).abs()
    else:
        best = torch.tanh(scores)
        action = (best + noise * torch.randn(best.shape, generator=g)).clamp(-1, 1)
        reward = 1.0 - (action - best).pow(2).sum(-1)
    rtg = torch.zeros_like(reward)
    running = torch.zeros(n_ep)
    for t in reversed(range(episode_len)):
        running = reward[:, t] + gamma * running
        rtg[:, t] = running
    last = torch.zeros(n_ep, episode_len, 1, dtype=torch.bool)
    last[:, -1] = True
    episode = torch.arange(n_ep).unsqueeze(1).expand(n_ep, episode_len)
    flat = TensorDict(
        {
            "observation": s,
            "action": action,
            "episode": episode,
            "return_to_go": rtg.unsqueeze(-1),
            "next": {
                "observation": s_next,
                "reward": reward.unsqueeze(-1),
                "done": last.clone(),
                "terminated": last.clone(),
                "truncated": torch.zeros_like(last),
            },
        },
        [n_ep, episode_len],
    ).reshape(-1)[:n]
    if discrete:
        action_spec = Categorical(out_dim)
    else:
        action_spec = Bounded(-torch.ones(out_dim), torch.ones(out_dim), (out_dim,))
    data = SimpleNamespace(
        observation_spec=Unbounded((obs_dim,)),
        action_spec=action_spec,
        action_space="discrete" if discrete else "continuous",
        td=flat,
    )
    return data, flat
