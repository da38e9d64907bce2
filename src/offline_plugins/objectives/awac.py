"""AWAC as a TorchRL ``LossModule`` (TorchRL has none).

Nair, Gupta, Dalal & Levine 2020, "AWAC: Accelerating Online Reinforcement Learning
with Offline Datasets", arXiv:2006.09359.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDictBase, TensorDictParams
from tensordict.nn import ProbabilisticTensorDictSequential, TensorDictModule
from tensordict.utils import NestedKey
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.objectives.common import LossModule
from torchrl.objectives.utils import ValueEstimators, _vmap_func, distance_loss

from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import TD0TransitionLoss, TransitionKeys, advantage_diagnostics, check_range

__all__ = ["AWACLoss", "awac_weights"]


def awac_weights(advantage: torch.Tensor, beta: float | torch.Tensor, max_weight: float | torch.Tensor) -> torch.Tensor:
    r"""AWAC's regression weights :math:`\min(e^{A/\beta}, w_{max})`, detached.

    >>> awac_weights(torch.tensor([0.0, 1.0, 10.0]), 2.0, 100.0)
    tensor([  1.0000,   1.6487, 100.0000])
    """
    return torch.exp(advantage.detach() / beta).clamp_max(max_weight)


class AWACLoss(TD0TransitionLoss, LossModule):
    r"""Advantage-Weighted Actor-Critic (Nair et al. 2020, arXiv:2006.09359).

    Twin critics learn :math:`Q^\pi` by the usual Bellman backup with the next action
    drawn from the policy; the policy is a weighted maximum likelihood on the data's
    actions, the weight growing with the advantage:

    .. math::
        y = r + \gamma (1 - d) \min_i \bar Q_i(s', a'),\ a' \sim \pi(s');\quad
        L_Q = \sum_i E(Q_i(s, a) - y)^2 \\
        A(s, a) = \min_i Q_i(s, a) - \min_i Q_i(s, \tilde a),\ \tilde a \sim \pi(s);\quad
        L_\pi = -E[\min(e^{A/\beta}, w_{max}) \log \pi(a|s)]

    Args:
        actor_network: stochastic actor with ``get_dist`` (tanh-Gaussian).
        qvalue_network: ``Q(s, a)`` writing ``state_action_value``; ``num_qvalue_nets`` copies with targets.

    Keyword Args:
        beta (float): temperature :math:`\beta` > 0 (the paper's :math:`\lambda`). Defaults to 1.0.
        max_weight (float): :math:`w_{max}`, clip of the weights. Defaults to 100.
        num_qvalue_nets (int): critics. Defaults to 2.
        loss_function (str): critic regression loss. Defaults to ``"l2"``.
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``/``q_data_minus_mc`` (when the
            batch carries ``mc_return``, the data's Monte-Carlo return discounted at the loss's
            gamma), ``value_mean``, ``advantage_mean``, ``advantage_std``,
            ``advantage_weight_mean``, ``advantage_weight_clipped_frac``. Defaults to True.
        columns (DatasetColumns): fills the columns it holds (``mc_return``) into batches that
            lack them, by their storage ``index`` (:mod:`offline_plugins.objectives.columns`; the
            ``awac`` algorithm passes one at its ``gamma``). Defaults to None.

    Gradients: ``loss_qvalue`` reaches only the critics, ``loss_actor`` only the actor.

    Examples:
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic("tanh-gaussian")
        >>> loss = AWACLoss(actor, qvalue)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue']
    """

    @dataclass
    class _AcceptedKeys(TransitionKeys):
        """Keys the loss reads and writes: those of
        :class:`~offline_plugins.objectives.common.TransitionKeys`, and

        Attributes:
            state_action_value (NestedKey): what the critic writes. Defaults to ``"state_action_value"``.
        """

        state_action_value: NestedKey = "state_action_value"

    tensor_keys: _AcceptedKeys
    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.TD0
    out_keys = ["loss_actor", "loss_qvalue"]

    actor_network: ProbabilisticTensorDictSequential
    qvalue_network: TensorDictModule
    actor_network_params: TensorDictParams
    target_actor_network_params: TensorDictParams
    qvalue_network_params: TensorDictParams
    target_qvalue_network_params: TensorDictParams

    def __init__(
        self,
        actor_network: ProbabilisticTensorDictSequential,
        qvalue_network: TensorDictModule,
        *,
        beta: float = 1.0,
        max_weight: float = 100.0,
        num_qvalue_nets: int = 2,
        loss_function: str = "l2",
        diagnostics: bool = True,
        columns: Optional[DatasetColumns] = None,
    ) -> None:
        check_range("AWACLoss", "beta", beta, 0.0, None)
        check_range("AWACLoss", "max_weight", max_weight, 0.0, None)
        super().__init__()
        self.convert_to_functional(actor_network, "actor_network", create_target_params=False)
        self.convert_to_functional(qvalue_network, "qvalue_network", num_qvalue_nets, create_target_params=True)
        self.num_qvalue_nets = num_qvalue_nets
        self.loss_function = loss_function
        self.diagnostics = diagnostics
        self._set_columns(columns)
        self.register_buffer("beta", torch.tensor(float(beta)))
        self.register_buffer("max_weight", torch.tensor(float(max_weight)))
        self._vmap_qvalue = _vmap_func(self.qvalue_network, (None, 0), randomness=self.vmap_randomness)

    def _observation_keys(self) -> list:
        return self.actor_network.in_keys

    def _sample(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``a ~ pi(s)`` with the current policy, no gradient."""
        td = tensordict.select(*self.actor_network.in_keys, strict=False)
        with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM), self.actor_network_params.to_module(
            self.actor_network, preserve_module_state=False
        ):
            return self.actor_network.get_dist(td).sample()

    def _min_q(self, tensordict: TensorDictBase, action: torch.Tensor, params) -> torch.Tensor:
        td = tensordict.select(*self.qvalue_network.in_keys, strict=False)
        td.set(self.tensor_keys.action, action)
        return self._vmap_qvalue(td, params).get(self.tensor_keys.state_action_value).squeeze(-1).min(0).values

    def qvalue_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        with torch.no_grad():
            next_td = tensordict.get("next")
            next_value = self._min_q(next_td, self._sample(next_td), self.target_qvalue_network_params)
            target = self._td0_target(tensordict, next_value.unsqueeze(-1))
        q_td = tensordict.select(*self.qvalue_network.in_keys, strict=False)
        pred = self._vmap_qvalue(q_td, self.qvalue_network_params).get(keys.state_action_value).squeeze(-1)
        loss = distance_loss(pred, target.expand_as(pred), loss_function=self.loss_function).sum(0).mean()
        return loss, {"td_error": (pred.detach() - target).pow(2).max(0).values}

    def actor_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        with torch.no_grad():
            params = self.qvalue_network_params.detach()
            q_data = self._min_q(tensordict, tensordict.get(keys.action), params)
            value = self._min_q(tensordict, self._sample(tensordict), params)
            advantage = q_data - value
            weight = awac_weights(advantage, self.beta, self.max_weight)
        td = tensordict.select(*self.actor_network.in_keys, strict=False)
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            log_prob = self.actor_network.get_dist(td).log_prob(tensordict.get(keys.action))
        loss = -(weight * log_prob).mean()
        return loss, {"q_data": q_data, **advantage_diagnostics(value, advantage, weight, self.max_weight)}

    def _loss_terms(self, tensordict: TensorDictBase) -> tuple:
        loss_qvalue, meta_q = self.qvalue_loss(tensordict)
        loss_actor, meta_actor = self.actor_loss(tensordict)
        q_data = meta_actor.pop("q_data")
        return {"loss_actor": loss_actor, "loss_qvalue": loss_qvalue}, meta_q["td_error"], q_data, meta_actor
