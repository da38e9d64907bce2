"""Advantage-weighted regression (AWR) as a TorchRL loss module."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule


class AWRLoss(LossModule):
    """Advantage-weighted regression: weighted behaviour cloning with weights exp(A / beta).

    Peng, Kumar, Zhang, Levine 2019, "Advantage-Weighted Regression: Simple and
    Scalable Off-Policy Reinforcement Learning", arXiv:1910.00177. Offline, the return
    ``R`` of each step is the data's Monte-Carlo return-to-go; the value ``V(s)``
    regresses onto it and the advantage is ``A = R - V(s)``.

    Args:
        actor_network: a probabilistic actor whose ``get_dist(td)`` gives pi(a|s).
        value_network: a module writing ``state_value`` from the observation.

    Keyword Args:
        beta (float): advantage temperature. Default 1.0 (the paper's 0.05 assumes
            rewards scaled to a small range).
        max_weight (float): clip of exp(A / beta). Default 20.0, as in the paper.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule, NormalParamExtractor, TensorDictSequential
        >>> from torchrl.modules import ProbabilisticActor, IndependentNormal
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), NormalParamExtractor())
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(net, ["observation"], ["loc", "scale"]),
        ...     in_keys=["loc", "scale"], distribution_class=IndependentNormal)
        >>> value = TensorDictModule(torch.nn.Linear(3, 1), ["observation"], ["state_value"])
        >>> loss = AWRLoss(actor, value, beta=1.0)
        >>> td = TensorDict({"observation": torch.randn(5, 3), "action": torch.randn(5, 2),
        ...                  "return_to_go": torch.randn(5, 1)}, [5])
        >>> out = loss(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_value']
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename them with ``set_keys``.

        Attributes:
            action (NestedKey): the data action. Defaults to ``"action"``.
            value (NestedKey): the value network's output. Defaults to ``"state_value"``.
            return_to_go (NestedKey): the Monte-Carlo return from this step.
                Defaults to ``"return_to_go"``.
        """

        action: NestedKey = "action"
        value: NestedKey = "state_value"
        return_to_go: NestedKey = "return_to_go"

    actor_network: TensorDictModule
    actor_network_params: TensorDictParams
    target_actor_network_params: TensorDictParams
    value_network: TensorDictModule
    value_network_params: TensorDictParams
    target_value_network_params: TensorDictParams
    tensor_keys: _AcceptedKeys
    default_keys = _AcceptedKeys
    out_keys = ["loss_actor", "loss_value", "advantage_mean", "weight_mean", "weight_clipped_frac"]

    def __init__(
        self,
        actor_network: TensorDictModule,
        value_network: TensorDictModule,
        *,
        beta: float = 1.0,
        max_weight: float = 20.0,
    ) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"AWRLoss: beta must be > 0, got {beta}")
        self.convert_to_functional(actor_network, "actor_network")
        self.convert_to_functional(value_network, "value_network")
        self.register_buffer("beta", torch.tensor(float(beta)))
        self.register_buffer("max_weight", torch.tensor(float(max_weight)))

    @property
    def in_keys(self):
        keys = [self.tensor_keys.action, self.tensor_keys.return_to_go]
        keys += list(self.actor_network.in_keys) + list(self.value_network.in_keys)
        return list(dict.fromkeys(keys))

    def _check(self, td: TensorDictBase) -> None:
        missing = [k for k in self.in_keys if k not in td.keys(include_nested=True)]
        if missing:
            raise KeyError(
                f"AWRLoss: the batch has no {missing}; it needs {self.in_keys} "
                "(return_to_go comes from offline_plugins' data loader)"
            )

    def value_loss(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression of V(s) onto the return; also returns the (detached) advantage."""
        with self.value_network_params.to_module(self.value_network):
            value = self.value_network(td.select(*self.value_network.in_keys).copy()).get(
                self.tensor_keys.value
            )
        ret = td.get(self.tensor_keys.return_to_go)
        advantage = (ret - value).detach()
        return 0.5 * (value - ret).pow(2).mean(), advantage

    def actor_loss(self, td: TensorDictBase, advantage: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """-E[min(exp(A / beta), max_weight) * log pi(a|s)]."""
        raw = torch.exp(advantage / self.beta)
        weight = raw.clamp(max=self.max_weight).squeeze(-1)
        with self.actor_network_params.to_module(self.actor_network):
            dist = self.actor_network.get_dist(td.select(*self.actor_network.in_keys).copy())
        log_prob = dist.log_prob(td.get(self.tensor_keys.action))
        info = {
            "weight_mean": weight.mean().detach(),
            "weight_clipped_frac": (raw.squeeze(-1) > self.max_weight).float().mean().detach(),
        }
        return -(weight * log_prob).mean(), info

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        self._check(tensordict)
        loss_value, advantage = self.value_loss(tensordict)
        loss_actor, info = self.actor_loss(tensordict, advantage)
        return TensorDict(
            {"loss_actor": loss_actor, "loss_value": loss_value, "advantage_mean": advantage.mean(), **info},
            batch_size=[],
        )
