"""MLP actors, critics and behaviour models for the offline-RL losses.

Every builder returns a tensordict module reading TED keys (``"observation"``,
``"action"``) so the result plugs straight into a TorchRL loss. Q ensembles are
built as one network and expanded by the loss (``convert_to_functional(...,
expand_dim=n)``), which stacks the copies' parameters and runs them with
``torch.vmap``.

>>> import torch
>>> from torchrl.data import Bounded
>>> from tensordict import TensorDict
>>> spec = Bounded(-2 * torch.ones(1), 2 * torch.ones(1), (1,))
>>> actor = make_tanh_gaussian_actor(3, spec, hidden=(8,))
>>> td = actor(TensorDict({"observation": torch.zeros(5, 3)}, [5]))
>>> td["action"].shape, bool(td["action"].abs().max() <= 2)
(torch.Size([5, 1]), True)
>>> make_qvalue(3, 1, hidden=(8,))(td)["state_action_value"].shape
torch.Size([5, 1])
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tensordict.nn import InteractionType, TensorDictModule
from torch import nn
from torchrl.data import Bounded
from torchrl.data import Categorical as CategoricalSpec
from torchrl.modules import Actor, NormalParamExtractor, ProbabilisticActor, TanhNormal, ValueOperator

__all__ = [
    "mlp",
    "QValueNet",
    "ScaledTanh",
    "ConditionalVAE",
    "BCQPerturbation",
    "make_qvalue",
    "make_value",
    "make_tanh_gaussian_actor",
    "make_deterministic_actor",
    "make_discrete_qvalue",
    "make_categorical_actor",
    "make_vae",
    "make_perturbation",
    "action_bounds",
    "layer_norm_mlp",
    "LayerNormQValueNet",
    "make_layer_norm_qvalue",
]


def mlp(in_features: int, out_features: int, hidden: Sequence[int] = (256, 256), activation=nn.ReLU) -> nn.Sequential:
    """``Linear -> activation`` per hidden width, then a linear head."""
    layers: list[nn.Module] = []
    last = in_features
    for width in hidden:
        layers += [nn.Linear(last, int(width)), activation()]
        last = int(width)
    layers.append(nn.Linear(last, out_features))
    return nn.Sequential(*layers)


def action_bounds(action_spec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` of a continuous action spec, as float tensors."""
    if not isinstance(action_spec, Bounded):
        raise TypeError(f"a continuous action spec must be torchrl.data.Bounded, got {type(action_spec).__name__}")
    return action_spec.space.low.float(), action_spec.space.high.float()


class QValueNet(nn.Module):
    """``Q(s, a) = MLP([s, a])``."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        self.net = mlp(obs_dim + action_dim, 1, hidden)

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([observation, action], -1))


class ScaledTanh(nn.Module):
    """Squashes to ``[low, high]`` with ``tanh``; the bounds are buffers so they follow ``.to()``."""

    def __init__(self, low: torch.Tensor, high: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("center", (high + low) / 2)
        self.register_buffer("half_range", (high - low) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.center + self.half_range * torch.tanh(x)


def make_qvalue(obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256)) -> ValueOperator:
    """Continuous critic reading ``observation``, ``action``; writes ``state_action_value`` [..., 1]."""
    return ValueOperator(QValueNet(obs_dim, action_dim, hidden), in_keys=["observation", "action"])


def make_value(obs_dim: int, hidden: Sequence[int] = (256, 256)) -> ValueOperator:
    """State value reading ``observation``; writes ``state_value`` [..., 1]."""
    return ValueOperator(mlp(obs_dim, 1, hidden), in_keys=["observation"], out_keys=["state_value"])


def make_tanh_gaussian_actor(
    obs_dim: int,
    action_spec: Bounded,
    hidden: Sequence[int] = (256, 256),
    *,
    scale_lb: float = 1e-4,
) -> ProbabilisticActor:
    """Tanh-Gaussian policy squashed into the spec's bounds.

    The actor samples only when asked (``set_exploration_type(RANDOM)``, which the
    losses do); by default it returns the distribution's deterministic action, so
    the same module is the evaluation policy.
    """
    low, high = action_bounds(action_spec)
    action_dim = low.numel()
    net = nn.Sequential(mlp(obs_dim, 2 * action_dim, hidden), NormalParamExtractor(scale_lb=scale_lb))
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        module,
        in_keys=["loc", "scale"],
        spec=action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": low, "high": high},
        default_interaction_type=InteractionType.DETERMINISTIC,
        return_log_prob=False,
    )


def make_deterministic_actor(obs_dim: int, action_spec: Bounded, hidden: Sequence[int] = (256, 256)) -> Actor:
    """``a = center + half_range * tanh(MLP(s))`` (TD3, BC with an L2 loss)."""
    low, high = action_bounds(action_spec)
    net = nn.Sequential(mlp(obs_dim, low.numel(), hidden), ScaledTanh(low, high))
    return Actor(net, in_keys=["observation"], out_keys=["action"], spec=action_spec)


def make_discrete_qvalue(obs_dim: int, num_actions: int, hidden: Sequence[int] = (256, 256)) -> TensorDictModule:
    """``Q(s, .)`` for every action: reads ``observation``, writes ``state_action_value`` [..., n]."""
    return TensorDictModule(mlp(obs_dim, num_actions, hidden), in_keys=["observation"], out_keys=["state_action_value"])


def make_categorical_actor(obs_dim: int, num_actions: int, hidden: Sequence[int] = (256, 256)) -> ProbabilisticActor:
    """Categorical policy over ``num_actions``; writes an int64 ``action`` (argmax unless sampling)."""
    module = TensorDictModule(mlp(obs_dim, num_actions, hidden), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        spec=CategoricalSpec(num_actions),
        distribution_class=torch.distributions.Categorical,
        default_interaction_type=InteractionType.DETERMINISTIC,
        return_log_prob=False,
    )


class ConditionalVAE(nn.Module):
    """BCQ's generative model of the behaviour policy, ``a ~ D(s, z)``, ``z ~ E(s, a)``.

    Fujimoto et al. 2019, arXiv:1812.02900: the latent is clipped to ``[-0.5, 0.5]``
    when decoding from the prior, so samples stay where the data is dense.

    ``forward(observation, action)`` returns ``(reconstruction, mean, std)``.
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        low: torch.Tensor,
        high: torch.Tensor,
        hidden: Sequence[int] = (750, 750),
        latent_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.latent_dim = int(latent_dim or 2 * action_dim)
        self.encoder = mlp(obs_dim + action_dim, 2 * self.latent_dim, hidden)
        self.decoder = nn.Sequential(mlp(obs_dim + self.latent_dim, action_dim, hidden), ScaledTanh(low, high))

    def forward(self, observation: torch.Tensor, action: torch.Tensor):
        mean, log_std = self.encoder(torch.cat([observation, action], -1)).chunk(2, -1)
        # the paper's clamp keeps the KL term finite early in training
        std = log_std.clamp(-4.0, 15.0).exp()
        z = mean + std * torch.randn_like(std)
        return self.decode(observation, z), mean, std

    def decode(self, observation: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        if z is None:
            shape = (*observation.shape[:-1], self.latent_dim)
            z = torch.randn(shape, device=observation.device, dtype=observation.dtype).clamp(-0.5, 0.5)
        return self.decoder(torch.cat([observation, z], -1))


class BCQPerturbation(nn.Module):
    """``xi(s, a) = clip(a + phi * half_range * tanh(MLP([s, a])), low, high)``."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        low: torch.Tensor,
        high: torch.Tensor,
        hidden: Sequence[int] = (400, 300),
        phi: float = 0.05,
    ) -> None:
        super().__init__()
        self.net = mlp(obs_dim + action_dim, action_dim, hidden)
        self.register_buffer("low", low.clone())
        self.register_buffer("high", high.clone())
        self.register_buffer("phi", torch.as_tensor(float(phi)))

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        half_range = (self.high - self.low) / 2
        delta = self.phi * half_range * torch.tanh(self.net(torch.cat([observation, action], -1)))
        return torch.maximum(torch.minimum(action + delta, self.high), self.low)


def make_vae(obs_dim: int, action_spec: Bounded, hidden: Sequence[int] = (750, 750)) -> TensorDictModule:
    """:class:`ConditionalVAE` reading ``observation``, ``action``; writes ``vae_action``, ``vae_mean``, ``vae_std``."""
    low, high = action_bounds(action_spec)
    vae = ConditionalVAE(obs_dim, low.numel(), low, high, hidden)
    return TensorDictModule(vae, in_keys=["observation", "action"], out_keys=["vae_action", "vae_mean", "vae_std"])


def make_perturbation(
    obs_dim: int, action_spec: Bounded, hidden: Sequence[int] = (400, 300), phi: float = 0.05
) -> TensorDictModule:
    """:class:`BCQPerturbation` reading ``observation``, ``action``; writes ``perturbed_action``."""
    low, high = action_bounds(action_spec)
    net = BCQPerturbation(obs_dim, low.numel(), low, high, hidden, phi)
    return TensorDictModule(net, in_keys=["observation", "action"], out_keys=["perturbed_action"])


def layer_norm_mlp(in_features: int, out_features: int, hidden: Sequence[int] = (256, 256, 256)) -> nn.Sequential:
    """``Linear -> ReLU -> LayerNorm`` per hidden width, then a linear head: ReBRAC's critic
    (Tarasov et al. 2023, arXiv:2305.09836, Sec. 3; CORL's ``rebrac.py`` puts the norm after
    the activation)."""
    layers: list[nn.Module] = []
    last = in_features
    for width in hidden:
        layers += [nn.Linear(last, int(width)), nn.ReLU(), nn.LayerNorm(int(width))]
        last = int(width)
    layers.append(nn.Linear(last, out_features))
    return nn.Sequential(*layers)


class LayerNormQValueNet(nn.Module):
    """``Q(s, a) = layer_norm_mlp([s, a])``."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256, 256)) -> None:
        super().__init__()
        self.net = layer_norm_mlp(obs_dim + action_dim, 1, hidden)

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([observation, action], -1))


def make_layer_norm_qvalue(obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256, 256)) -> ValueOperator:
    """:func:`make_qvalue` with a LayerNorm after every hidden activation (:class:`LayerNormQValueNet`).

    >>> q = make_layer_norm_qvalue(3, 1, hidden=(8, 8))
    >>> sum(isinstance(m, nn.LayerNorm) for m in q.modules())
    2
    """
    return ValueOperator(LayerNormQValueNet(obs_dim, action_dim, hidden), in_keys=["observation", "action"])
