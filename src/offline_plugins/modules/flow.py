"""The networks of flow Q-learning: a flow-matching behaviour policy, its one-step distillation, a GELU critic.

Park, Li & Levine 2025, "Flow Q-Learning", arXiv:2502.02538. The classes follow the
contract of the ones TorchRL added with its ``FQLLoss`` (torchrl >= 0.15,
``torchrl.modules.FlowMatchingPolicy`` / ``OneStepPolicy``; we are on 0.14.1, which has
neither): a tensor-only model (:class:`FlowMatchingModel`, :class:`OneStepModel`) with
``forward(observation, noise=None)``, wrapped in a ``TensorDictModule`` that reads
``"observation"`` and writes ``"action"``. Both sample their Gaussian noise when none is
given, whatever the exploration type: the paper's agent acts with a fresh noise draw at
evaluation too (its ``sample_actions`` ignores the temperature); pass the noise for
repeatable actions.

>>> import torch
>>> from tensordict import TensorDict
>>> from torchrl.data import Bounded
>>> spec = Bounded(-2 * torch.ones(2), 2 * torch.ones(2), (2,))
>>> flow, actor = make_flow_policy(3, spec, (8,), num_steps=4), make_one_step_policy(3, spec, (8,))
>>> td = TensorDict({"observation": torch.zeros(5, 3)}, [5])
>>> flow(td.clone())["action"].shape, bool(actor(td)["action"].abs().max() <= 2)
(torch.Size([5, 2]), True)
>>> make_fql_qvalue(3, 2, (8,))(td)["state_action_value"].shape
torch.Size([5, 1])
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import ValueOperator

from offline_plugins.modules.networks import action_bounds

__all__ = [
    "fql_mlp",
    "ConcatMLP",
    "FlowMatchingModel",
    "OneStepModel",
    "FlowMatchingPolicy",
    "OneStepPolicy",
    "make_flow_policy",
    "make_one_step_policy",
    "make_fql_qvalue",
]

Bound = Union[float, torch.Tensor]


def fql_mlp(in_features: int, out_features: int, hidden: Sequence[int], *, layer_norm: bool = False) -> nn.Sequential:
    """``Linear -> GELU`` (``-> LayerNorm`` with ``layer_norm``) per hidden width, then a linear head.

    The reference code's ``MLP`` (seohongpark/fql ``utils/networks.py``): GELU activations, the
    norm after the activation, weights initialised by variance scaling 1.0 over the average fan,
    uniform (Xavier uniform), biases at zero.

    >>> net = fql_mlp(3, 1, (4, 4), layer_norm=True)
    >>> [type(m).__name__ for m in net][:3], float(net[0].bias.detach().abs().sum())
    (['Linear', 'GELU', 'LayerNorm'], 0.0)
    """
    layers: list[nn.Module] = []
    for width in map(int, hidden):
        layers += [nn.Linear(in_features, width), nn.GELU(), *([nn.LayerNorm(width)] if layer_norm else [])]
        in_features = width
    layers.append(nn.Linear(in_features, out_features))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class ConcatMLP(nn.Module):
    """``net(cat(inputs, -1))``: a network on several tensors joined along their last dim (the critic's ``[s, a]``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat(inputs, -1))


class _Bounded(nn.Module):
    """Action bounds as buffers (they follow ``.to()``), and the Gaussian noise a policy starts from."""

    def __init__(self, action_dim: int, low: Bound, high: Bound) -> None:
        super().__init__()
        self.action_dim = int(action_dim)
        self.register_buffer("low", torch.as_tensor(low, dtype=torch.float32).clone())
        self.register_buffer("high", torch.as_tensor(high, dtype=torch.float32).clone())

    def clamp(self, action: torch.Tensor) -> torch.Tensor:
        return torch.clamp(action, self.low.to(action), self.high.to(action))

    def _noise(self, observation: torch.Tensor) -> torch.Tensor:
        return observation.new_empty((*observation.shape[:-1], self.action_dim)).normal_()


class FlowMatchingModel(_Bounded):
    """A velocity field ``v(s, x, t)`` and its Euler sampler.

    Args:
        velocity_network (nn.Module): maps ``cat(observation, x, t)`` to an action-sized velocity.
        action_dim (int): action coordinates.
        num_steps (int): Euler steps from ``t = 0`` to ``1``. Defaults to 10 (the paper's ``flow_steps``).

    Keyword Args:
        low, high (float or Tensor): action bounds the sample is clipped to. Default to -1 and 1.

    ``forward(observation, noise=None)`` integrates ``x <- x + v(s, x, k / K) / K`` for
    ``k = 0..K-1`` from ``x = noise`` (standard normal when None), the whole batch in each step,
    and clips the result to the bounds.

    >>> class Linear(nn.Module):  # v(s, x, t) = -x: x(1) = x(0) (1 - 1/K)^K under Euler
    ...     def forward(self, inputs):
    ...         return -inputs[..., 1:2]
    >>> model = FlowMatchingModel(Linear(), 1, num_steps=2, low=-9.0, high=9.0)
    >>> model(torch.zeros(1, 1), torch.tensor([[4.0]]))
    tensor([[1.]])
    """

    def __init__(self, velocity_network: nn.Module, action_dim: int, num_steps: int = 10, *,
                 low: Bound = -1.0, high: Bound = 1.0) -> None:
        if int(num_steps) < 1:
            raise ValueError(f"FlowMatchingModel: num_steps={num_steps} must be a whole number >= 1")
        super().__init__(action_dim, low, high)
        self.velocity_network = velocity_network
        self.num_steps = int(num_steps)

    def velocity(self, observation: torch.Tensor, action: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """``v(s, x_t, t)``, with ``time`` shaped ``[*B, 1]``."""
        return self.velocity_network(torch.cat((observation, action, time), -1))

    def forward(self, observation: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        action = self._noise(observation) if noise is None else noise
        steps = self.num_steps
        for k in range(steps):
            time = action.new_full((*action.shape[:-1], 1), k / steps)
            action = action + self.velocity(observation, action, time) / steps
        return self.clamp(action)


class OneStepModel(_Bounded):
    """The one-step policy ``mu(s, z)``: one network from observation and noise to action.

    Args:
        network (nn.Module): maps ``cat(observation, z)`` to an action, with no output squashing.
        action_dim (int): action coordinates.

    Keyword Args:
        low, high (float or Tensor): action bounds. Default to -1 and 1.

    ``forward(observation, noise=None, *, clamp=True)``: ``z`` standard normal when None; the
    action clipped to the bounds unless ``clamp=False`` (the distillation term reads it unclipped,
    as the paper's code does).
    """

    def __init__(self, network: nn.Module, action_dim: int, *, low: Bound = -1.0, high: Bound = 1.0) -> None:
        super().__init__(action_dim, low, high)
        self.network = network

    def forward(self, observation: torch.Tensor, noise: torch.Tensor | None = None, *,
                clamp: bool = True) -> torch.Tensor:
        noise = self._noise(observation) if noise is None else noise
        action = self.network(torch.cat((observation, noise), -1))
        return self.clamp(action) if clamp else action


class FlowMatchingPolicy(TensorDictModule):
    """A :class:`FlowMatchingModel` reading ``in_keys`` (the observation first; a second key, if
    given, is the noise) and writing ``out_keys`` (``"action"``)."""

    def __init__(self, module: FlowMatchingModel, in_keys=("observation",), out_keys=("action",)) -> None:
        if not isinstance(module, FlowMatchingModel):
            raise TypeError(f"FlowMatchingPolicy wraps a FlowMatchingModel, got {type(module).__name__}")
        super().__init__(module, in_keys=list(in_keys), out_keys=list(out_keys))


class OneStepPolicy(TensorDictModule):
    """A :class:`OneStepModel` reading ``in_keys`` (the observation first; a second key, if given, is
    the noise) and writing ``out_keys`` (``"action"``). FQL's evaluation policy."""

    def __init__(self, module: OneStepModel, in_keys=("observation",), out_keys=("action",)) -> None:
        if not isinstance(module, OneStepModel):
            raise TypeError(f"OneStepPolicy wraps a OneStepModel, got {type(module).__name__}")
        super().__init__(module, in_keys=list(in_keys), out_keys=list(out_keys))


def make_flow_policy(obs_dim: int, action_spec, hidden: Sequence[int] = (512,) * 4, *, num_steps: int = 10,
                     layer_norm: bool = False) -> FlowMatchingPolicy:
    """The behaviour flow ``v(s, x_t, t)``: :func:`fql_mlp` on ``[s, x_t, t]``, sampled in ``num_steps``
    Euler steps and clipped to the ``Bounded`` spec's bounds (the paper: 4 x 512, no LayerNorm)."""
    low, high = action_bounds(action_spec)
    n = low.numel()
    return FlowMatchingPolicy(FlowMatchingModel(fql_mlp(obs_dim + n + 1, n, hidden, layer_norm=layer_norm), n,
                                                num_steps, low=low, high=high))


def make_one_step_policy(obs_dim: int, action_spec, hidden: Sequence[int] = (512,) * 4, *,
                         layer_norm: bool = False) -> OneStepPolicy:
    """The one-step policy ``mu(s, z)``: :func:`fql_mlp` on ``[s, z]``, clipped to the spec's bounds
    (the paper: 4 x 512, no LayerNorm)."""
    low, high = action_bounds(action_spec)
    n = low.numel()
    return OneStepPolicy(OneStepModel(fql_mlp(obs_dim + n, n, hidden, layer_norm=layer_norm), n, low=low, high=high))


def make_fql_qvalue(obs_dim: int, action_dim: int, hidden: Sequence[int] = (512,) * 4, *,
                    layer_norm: bool = True) -> ValueOperator:
    """``Q(s, a)`` = :func:`fql_mlp` on ``[s, a]`` reading ``observation``, ``action`` and writing
    ``state_action_value`` (the paper: 4 x 512, GELU, LayerNorm)."""
    net = ConcatMLP(fql_mlp(obs_dim + action_dim, 1, hidden, layer_norm=layer_norm))
    return ValueOperator(net, in_keys=["observation", "action"])
