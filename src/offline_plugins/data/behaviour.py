"""Behaviour policies: the small networks that generate the recipe datasets.

A policy file ``policies/<env>.pt`` (written by ``scripts/train_behaviour.py`` of the repository)
holds the ``medium`` and ``expert`` actors of one training run, the snapshots taken
on the way to ``medium`` (from which ``medium-replay`` is regenerated), and the
random and expert reference returns. Acting is plain PyTorch on one observation at
a time, with an explicit :class:`torch.Generator`, so a dataset is a pure function
of its seed.

>>> import torch
>>> net = make_actor_net("sac", obs_dim=3, act_dim=1, hidden=(8, 8))
>>> policy = BehaviourPolicy("sac", net, low=[-2.0], high=[2.0], noise=1.0)
>>> g = torch.Generator().manual_seed(0)
>>> a = policy.act(torch.zeros(3), g)
>>> a.shape, bool((a.abs() <= 2).all())
(torch.Size([1]), True)
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch
from tensordict.nn import NormalParamExtractor
from torch import nn

from offline_plugins.data.errors import DatasetError

__all__ = [
    "POLICY_DIR",
    "policy_stem",
    "make_actor_net",
    "BehaviourPolicy",
    "RandomPolicy",
    "PolicyFile",
    "load_policy_file",
]

POLICY_DIR = Path(str(resources.files("offline_plugins.data") / "policies"))


def policy_stem(env_id: str) -> str:
    """File stem of an env's policy files: ``"Hopper-v5"`` -> ``"hopper-v5"``."""
    return env_id.lower().replace("/", "-")


def make_actor_net(kind: str, obs_dim: int, act_dim: int, hidden: Sequence[int]) -> nn.Sequential:
    """The actor MLP: ``sac`` gives (loc, scale) of a tanh-Gaussian; ``dqn`` gives Q-values."""
    layers: list[nn.Module] = []
    width = obs_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    if kind == "sac":
        layers += [nn.Linear(width, 2 * act_dim), NormalParamExtractor()]
    elif kind == "dqn":
        layers.append(nn.Linear(width, act_dim))
    else:
        raise ValueError(f"unknown behaviour policy kind {kind!r}; expected 'sac' or 'dqn'")
    return nn.Sequential(*layers)


class BehaviourPolicy:
    """Acts with a trained actor, one observation at a time.

    Args:
        kind: ``"sac"`` (tanh-Gaussian; the same map as TorchRL's ``TanhNormal``) or
            ``"dqn"`` (epsilon-greedy on Q-values).
        net: the network from :func:`make_actor_net`.
        low, high: action bounds (``sac`` only).
        noise: ``sac``: multiplies the Gaussian scale (1.0 samples the policy as trained,
            as D4RL did; 0.0 is the deterministic policy). ``dqn``: epsilon.
    """

    def __init__(self, kind: str, net: nn.Module, *, low=None, high=None, noise: float = 1.0):
        self.kind = kind
        self.net = net.eval()
        self.noise = float(noise)
        if kind == "sac":
            low_t = torch.as_tensor(low, dtype=torch.float32)
            high_t = torch.as_tensor(high, dtype=torch.float32)
            self._half = (high_t - low_t) / 2
            self._mid = (high_t + low_t) / 2

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Actions for observations ``[..., obs_dim]`` (float for ``sac``, int64 indices for ``dqn``)."""
        obs = obs.to(torch.float32)
        if self.kind == "sac":
            loc, scale = self.net(obs)
            eps = torch.randn(loc.shape, generator=generator)
            return torch.tanh(loc + self.noise * scale * eps) * self._half + self._mid
        q = self.net(obs)
        action = q.argmax(-1)
        if self.noise > 0:
            explore = torch.rand(action.shape, generator=generator) < self.noise
            random = torch.randint(q.shape[-1], action.shape, generator=generator)
            action = torch.where(explore, random, action)
        return action


class RandomPolicy:
    """Uniform random actions drawn from the generator (the ``random`` tier)."""

    def __init__(self, kind: str, *, low=None, high=None, n_actions: Optional[int] = None):
        self.kind = kind
        if kind == "sac":
            self.low = torch.as_tensor(low, dtype=torch.float32)
            self.high = torch.as_tensor(high, dtype=torch.float32)
        self.n_actions = n_actions

    def act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Actions for a batch of observations ``[..., obs_dim]`` (or one observation)."""
        batch = obs.shape[:-1]
        if self.kind == "sac":
            u = torch.rand(batch + self.low.shape, generator=generator)
            return self.low + u * (self.high - self.low)
        return torch.randint(self.n_actions, batch, generator=generator)


class PolicyFile:
    """The contents of one ``policies/<env>.pt`` and its ``.json`` card."""

    def __init__(self, payload: dict, card: dict, path: Path):
        self.payload = payload
        self.card = card
        self.path = path

    @property
    def kind(self) -> str:
        return self.payload["kind"]

    @property
    def ref_min_score(self) -> float:
        return float(self.card["random_return"])

    @property
    def ref_max_score(self) -> float:
        return float(self.card["expert_return"])

    def _net(self, state_dict: dict) -> nn.Module:
        p = self.payload
        net = make_actor_net(p["kind"], p["obs_dim"], p["act_dim"], p["hidden"])
        net.load_state_dict({k: v.float() for k, v in state_dict.items()})
        return net

    def policy(self, name: str) -> BehaviourPolicy:
        """The ``"medium"`` or ``"expert"`` behaviour policy."""
        return self._wrap(self._net(self.payload["policies"][name]))

    def _wrap(self, net: nn.Module) -> BehaviourPolicy:
        p = self.payload
        return BehaviourPolicy(p["kind"], net, low=p.get("action_low"), high=p.get("action_high"), noise=p["noise"])

    def random_policy(self) -> RandomPolicy:
        p = self.payload
        if p["kind"] == "sac":
            return RandomPolicy("sac", low=p["action_low"], high=p["action_high"])
        return RandomPolicy("dqn", n_actions=p["act_dim"])

    def replay_segments(self) -> list[tuple[int, object]]:
        """``[(env_steps, policy), ...]``: the training buffer up to the medium policy.

        The first segment is the random warm-up; each later one is the snapshot that was
        collecting data during that stretch of training.
        """
        segments = []
        for seg in self.payload["replay"]:
            sd = seg["policy"]
            policy = self.random_policy() if sd is None else self._wrap(self._net(sd))
            segments.append((int(seg["steps"]), policy))
        return segments


def load_policy_file(env_id: str, directory: Optional[Path] = None) -> PolicyFile:
    """Read the behaviour policies of ``env_id`` shipped in ``policies/``."""
    directory = Path(directory) if directory is not None else POLICY_DIR
    stem = policy_stem(env_id)
    pt, card = directory / f"{stem}.pt", directory / f"{stem}.json"
    if not pt.is_file() or not card.is_file():
        raise DatasetError(
            f"no behaviour policy for {env_id!r} in {directory} (expected {pt.name} and {card.name}); "
            f"train one from a checkout of offline-plugins with: python scripts/train_behaviour.py {env_id}"
        )
    payload = torch.load(pt, map_location="cpu", weights_only=True)
    return PolicyFile(payload, json.loads(card.read_text()), pt)
