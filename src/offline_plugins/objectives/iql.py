"""IQL: TorchRL's ``IQLLoss`` / ``DiscreteIQLLoss`` plus input checks and diagnostics.

The loss terms are TorchRL's, unchanged (``tests/test_objectives_iql.py`` checks
they agree with TorchRL's on the same networks and batch). What we add: a
:class:`~offline_plugins.errors.UserError` for bad hyperparameters and missing batch
keys, and the value/advantage statistics the offline diagnostics need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import DiscreteIQLLoss as _TorchRLDiscreteIQLLoss
from torchrl.objectives import IQLLoss as _TorchRLIQLLoss

from offline_plugins.objectives.common import check_batch_keys, check_range, data_q_diagnostics

__all__ = ["IQLLoss", "DiscreteIQLLoss"]


class _IQLDiagnosticsMixin:
    """Adds checks and ``q_data_mean``/``value_mean``/``advantage_*`` to TorchRL's IQL forward."""

    def _init_checks(self, expectile: float, temperature: float, diagnostics: bool) -> None:
        name = type(self).__name__
        check_range(name, "expectile", expectile, 0.0, 1.0)
        check_range(name, "temperature", temperature, 0.0, None, low_inclusive=True)
        self.diagnostics = diagnostics

    def _required_keys(self) -> list:
        keys = self.tensor_keys
        return [
            *self.actor_network.in_keys,
            keys.action,
            ("next", keys.reward),
            ("next", keys.done),
            ("next", keys.terminated),
            *[("next", k) for k in self.actor_network.in_keys],
        ]

    def _chosen_q(self, state_action_value: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return state_action_value.squeeze(-1)

    @torch.no_grad()
    def _diagnose(self, tensordict: TensorDictBase) -> dict:
        td_q = tensordict.select(*self.qvalue_network.in_keys, strict=False)
        td_q = self._vmap_qvalue_networkN0(td_q, self.target_qvalue_network_params)
        q = self._chosen_q(td_q.get(self.tensor_keys.state_action_value), tensordict.get(self.tensor_keys.action))
        min_q = q.min(0).values
        td_v = tensordict.select(*self.value_network.in_keys, strict=False)
        with self.value_network_params.to_module(self.value_network, preserve_module_state=False):
            self.value_network(td_v)
        value = td_v.get(self.tensor_keys.value).squeeze(-1)
        advantage = min_q - value
        weight = torch.exp(advantage * self.temperature).clamp_max(100)
        out = data_q_diagnostics(min_q, tensordict, self.tensor_keys.return_to_go)
        out.update(
            value_mean=value.mean(),
            advantage_mean=advantage.mean(),
            advantage_std=advantage.std(),
            advantage_weight_mean=weight.mean(),
            advantage_weight_clipped_frac=(weight >= 100).float().mean(),
        )
        return out

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, self._required_keys(), type(self).__name__)
        out = super().forward(tensordict)
        if self.diagnostics and self.reduction != "none":
            out.update(self._diagnose(tensordict))
        return out


class IQLLoss(_IQLDiagnosticsMixin, _TorchRLIQLLoss):
    r"""Implicit Q-Learning (Kostrikov et al. 2022, arXiv:2110.06169), TorchRL's loss with diagnostics.

    .. math::
        L_V = E[|\tau - 1(u<0)| u^2],\ u = \min_i \bar Q_i(s,a) - V(s); \quad
        L_Q = E[(Q(s,a) - r - \gamma V(s'))^2]; \quad
        L_\pi = -E[\min(e^{\beta(\bar Q - V)}, 100) \log\pi(a|s)]

    Args:
        actor_network: stochastic actor (``get_dist``), e.g.
            :func:`~offline_plugins.modules.networks.make_tanh_gaussian_actor`.
        qvalue_network: ``Q(s, a)`` writing ``"state_action_value"``; copied
            ``num_qvalue_nets`` times.
        value_network: ``V(s)`` writing ``"state_value"``.

    Keyword Args:
        expectile (float): :math:`\tau` in (0, 1). Defaults to 0.7 (the paper's MuJoCo value).
        temperature (float): inverse temperature :math:`\beta` >= 0. Defaults to 3.0.
        num_qvalue_nets (int): critics in the ensemble. Defaults to 2.
        loss_function (str): Q regression loss. Defaults to ``"l2"`` (the paper's).
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``, ``q_data_minus_mc``
            (when the batch has ``return_to_go``), ``value_mean``, ``advantage_mean``,
            ``advantage_std``, ``advantage_weight_mean``, ``advantage_weight_clipped_frac``;
            costs one extra no-grad critic and value pass. Defaults to True.
        **kwargs: passed to :class:`torchrl.objectives.IQLLoss`.

    The extra key ``return_to_go`` (Monte-Carlo discounted return) is read when present.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import Bounded
        >>> from offline_plugins.modules.networks import make_tanh_gaussian_actor, make_qvalue, make_value
        >>> spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        >>> loss = IQLLoss(make_tanh_gaussian_actor(3, spec, (8,)), make_qvalue(3, 2, (8,)), make_value(3, (8,)))
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = TensorDict({"observation": torch.randn(4, 3), "action": spec.rand((4,)),
        ...     ("next", "observation"): torch.randn(4, 3), ("next", "reward"): torch.randn(4, 1),
        ...     ("next", "done"): torch.zeros(4, 1, dtype=torch.bool),
        ...     ("next", "terminated"): torch.zeros(4, 1, dtype=torch.bool)}, [4])
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue', 'loss_value']
        >>> "advantage_mean" in out.keys()
        True
        >>> IQLLoss(make_tanh_gaussian_actor(3, spec, (8,)), make_qvalue(3, 2, (8,)), make_value(3, (8,)),
        ...         expectile=1.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        offline_plugins.objectives.common.HyperparameterError: IQLLoss: expectile=1.5 is outside (0, 1); ...
    """

    @dataclass
    class _AcceptedKeys(_TorchRLIQLLoss._AcceptedKeys):
        """TorchRL's IQL keys, plus ``return_to_go`` (defaults to ``"return_to_go"``): the data's
        Monte-Carlo discounted return, read only for diagnostics."""

        return_to_go: NestedKey = "return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        qvalue_network,
        value_network,
        *,
        expectile: float = 0.7,
        temperature: float = 3.0,
        num_qvalue_nets: int = 2,
        loss_function: str = "l2",
        diagnostics: bool = True,
        **kwargs,
    ) -> None:
        self._init_checks(expectile, temperature, diagnostics)
        super().__init__(
            actor_network,
            qvalue_network,
            value_network,
            expectile=expectile,
            temperature=temperature,
            num_qvalue_nets=num_qvalue_nets,
            loss_function=loss_function,
            **kwargs,
        )


class DiscreteIQLLoss(_IQLDiagnosticsMixin, _TorchRLDiscreteIQLLoss):
    r"""Discrete-action IQL (Kostrikov et al. 2022), TorchRL's ``DiscreteIQLLoss`` with diagnostics.

    Actions are int64 indices (``action_space="categorical"``), as our data layer stores
    them; no one-hot conversion is needed.

    Args:
        actor_network: categorical actor, e.g.
            :func:`~offline_plugins.modules.networks.make_categorical_actor`.
        qvalue_network: ``Q(s, .)`` writing ``"state_action_value"`` of shape ``[..., n]``.
        value_network: ``V(s)`` writing ``"state_value"``.

    Keyword Args:
        expectile, temperature, num_qvalue_nets, loss_function, diagnostics: as :class:`IQLLoss`.
        action_space: ``"categorical"`` (int indices, default) or ``"one-hot"``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.modules.networks import make_categorical_actor, make_discrete_qvalue, make_value
        >>> loss = DiscreteIQLLoss(make_categorical_actor(3, 4, (8,)), make_discrete_qvalue(3, 4, (8,)),
        ...                        make_value(3, (8,)))
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = TensorDict({"observation": torch.randn(5, 3), "action": torch.randint(4, (5,)),
        ...     ("next", "observation"): torch.randn(5, 3), ("next", "reward"): torch.randn(5, 1),
        ...     ("next", "done"): torch.zeros(5, 1, dtype=torch.bool),
        ...     ("next", "terminated"): torch.zeros(5, 1, dtype=torch.bool)}, [5])
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue', 'loss_value']
    """

    @dataclass
    class _AcceptedKeys(_TorchRLDiscreteIQLLoss._AcceptedKeys):
        """TorchRL's discrete IQL keys, plus ``return_to_go`` (defaults to ``"return_to_go"``)."""

        return_to_go: NestedKey = "return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        qvalue_network,
        value_network,
        *,
        action_space="categorical",
        expectile: float = 0.7,
        temperature: float = 3.0,
        num_qvalue_nets: int = 2,
        loss_function: str = "l2",
        diagnostics: bool = True,
        **kwargs,
    ) -> None:
        self._init_checks(expectile, temperature, diagnostics)
        super().__init__(
            actor_network,
            qvalue_network,
            value_network,
            action_space=action_space,
            expectile=expectile,
            temperature=temperature,
            num_qvalue_nets=num_qvalue_nets,
            loss_function=loss_function,
            **kwargs,
        )

    def _chosen_q(self, state_action_value: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        if self.action_space == "categorical":
            index = action.long().unsqueeze(-1).expand(state_action_value.shape[0], *action.shape, 1)
            return state_action_value.gather(-1, index).squeeze(-1)
        return (state_action_value * action.to(state_action_value.dtype)).sum(-1)


# silence "unused" linters: TensorDict is re-exported for doctest users building batches
_ = TensorDict
