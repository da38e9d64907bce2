"""Small stand-ins for the training-shell tests: a synthetic Pendulum-like dataset
with the ``OfflineData`` attributes the shell uses, and a tiny TD3+BC built from
TorchRL's ``TD3BCLoss`` (two optimiser groups, a delayed actor, a ``SoftUpdate``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from offline_plugins.config import config_field
from offline_plugins.plugins.registry import AlgorithmSpec


class FakeOfflineData:
    """``n`` transitions of a Pendulum-shaped task; the action is a fixed tanh-linear map of the state."""

    action_space = "continuous"
    env_id = "Pendulum-v1"
    ref_min_score = -1500.0
    ref_max_score = -150.0

    def __init__(self, n: int = 512, seed: int = 0, episode_len: int = 32, env_steps: int = 20, nan_reward: bool = False):
        from torchrl.data import Bounded, Unbounded

        g = torch.Generator().manual_seed(seed)
        obs = torch.randn(n, 3, generator=g) * 2.0 + 1.0
        w = torch.tensor([[0.5], [-1.0], [0.3]])
        action = torch.tanh(obs @ w) * 2.0
        reward = -(obs**2).sum(-1, keepdim=True) / 10
        if nan_reward:
            reward[:] = float("nan")
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[episode_len - 1 :: episode_len] = True
        self.dataset_id = "fake/pendulum-v0"
        self.env_steps = env_steps
        self.td = TensorDict(
            {
                "observation": obs,
                "action": action,
                "episode": torch.arange(n) // episode_len,
                "next": {
                    "observation": torch.randn(n, 3, generator=g),
                    "reward": reward,
                    "done": done,
                    "terminated": torch.zeros(n, 1, dtype=torch.bool),
                    "truncated": done.clone(),
                },
            },
            batch_size=[n],
        )
        self.observation_spec = Unbounded(shape=(3,))
        self.action_spec = Bounded(-2.0, 2.0, shape=(1,))
        self.obs_loc = obs.mean(0)
        self.obs_scale = obs.std(0)

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs - self.obs_loc.to(obs.device)) / self.obs_scale.to(obs.device)

    def state_dict(self) -> dict:
        return {"obs_loc": self.obs_loc.clone(), "obs_scale": self.obs_scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.obs_loc, self.obs_scale = state["obs_loc"].clone(), state["obs_scale"].clone()

    def normalized_score(self, returns):
        return 100.0 * (np.asarray(returns) - self.ref_min_score) / (self.ref_max_score - self.ref_min_score)

    def replay_buffer(self, batch_size, *, sampler="random", slice_len=None, seed=None, device=None):
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

        td = self.td.clone()
        td["observation"] = self.normalize(td["observation"])
        td["next", "observation"] = self.normalize(td["next", "observation"])
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(len(td), device=device or "cpu"), batch_size=batch_size)
        rb.extend(td)
        return rb

    def make_env(self, **kw):
        return gym.make("Pendulum-v1", max_episode_steps=self.env_steps)


class _Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


@dataclass
class TinyTD3BCConfig:
    lr: float = config_field(3e-3, "learning rate of both optimisers")
    hidden: int = config_field(16, "hidden width")
    tau: float = config_field(0.05, "Polyak rate")
    actor_every: int = config_field(2, "actor step period")
    batch_size: int = config_field(32, "transitions per step")
    normalize_observations: bool = config_field(True, "standardise observations")


def build_tiny_td3bc(config: TinyTD3BCConfig, data):
    from torchrl.modules import MLP, ValueOperator
    from torchrl.objectives import SoftUpdate, TD3BCLoss

    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup

    actor = TensorDictModule(
        nn.Sequential(MLP(in_features=3, out_features=1, num_cells=[config.hidden]), nn.Tanh(), _Scale(2.0)),
        ["observation"],
        ["action"],
    )
    q = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[config.hidden]), in_keys=["observation", "action"])
    loss = TD3BCLoss(actor, q, action_spec=data.action_spec)
    loss.make_value_estimator(gamma=0.9)
    return AlgorithmParts(
        loss=loss,
        policy=actor,
        optimizers=[
            OptimizerGroup("critic", list(loss.qvalue_network_params.parameters()), config.lr, ("loss_qvalue",)),
            OptimizerGroup(
                "actor", list(loss.actor_network_params.parameters()), config.lr, ("loss_actor",), every=config.actor_every
            ),
        ],
        target_updater=SoftUpdate(loss, tau=config.tau),
    )


TINY_SPEC = AlgorithmSpec(
    name="tiny-td3bc",
    summary="TorchRL's TD3BCLoss with tiny networks (tests only)",
    family="offline-rl",
    data="transitions",
    loss="torchrl.objectives:TD3BCLoss",
    build=build_tiny_td3bc,
    config=TinyTD3BCConfig,
    action_spaces=("continuous",),
)

DISCRETE_SPEC = dataclasses.replace(
    TINY_SPEC,
    name="tiny-discrete",
    summary="a discrete-action algorithm (tests only)",
    loss="torchrl.objectives:DQNLoss",
    action_spaces=("discrete",),
)


def module_params(module) -> dict[str, torch.Tensor]:
    """The loss module's parameters and buffers (targets included), by name."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
