"""IQL: TorchRL's ``IQLLoss`` / ``DiscreteIQLLoss`` plus input checks and diagnostics.

The loss terms are TorchRL's, unchanged (``tests/test_objectives_offline.py`` and
``tests/test_objectives_fused.py`` check they agree with TorchRL's on the same networks
and batch, for every value estimator). What we add: a
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
from torchrl.objectives.utils import distance_loss

from offline_plugins.objectives import _fused
from offline_plugins.objectives.common import (
    advantage_diagnostics,
    check_batch_keys,
    check_range,
    data_q_diagnostics,
    transition_keys,
)

__all__ = ["IQLLoss", "DiscreteIQLLoss"]


class _IQLDiagnosticsMixin:
    """Adds checks and ``q_data_mean``/``value_mean``/``advantage_*`` to TorchRL's IQL forward."""

    def _init_checks(self, expectile: float, temperature: float, diagnostics: bool) -> None:
        name = type(self).__name__
        check_range(name, "expectile", expectile, 0.0, 1.0)
        check_range(name, "temperature", temperature, 0.0, None, low_inclusive=True)
        self.diagnostics = diagnostics

    def _required_keys(self) -> list:
        return transition_keys(self.actor_network.in_keys, self.tensor_keys)

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
        out.update(advantage_diagnostics(value, advantage, weight, 100))
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
            ``advantage_std``, ``advantage_weight_mean``, ``advantage_weight_clipped_frac``.
            Free on the fused path; one extra no-grad critic and value pass otherwise.
            Defaults to True.
        fused (bool): compute the three terms in one pass straight from the parameters
            (the target critics run once, not twice; the ensemble is one batched matmul per
            layer; the tanh-Gaussian density in closed form) where that is exactly TorchRL's
            computation: the networks are the plain MLPs of
            :mod:`offline_plugins.modules.networks`, the value estimator is TorchRL's plain
            TD(0) (any ``gamma``), ``actor_loss``/``qvalue_loss``/``value_loss`` are not
            overridden and the batch has no loss mask. Otherwise (TD(1), TD(lambda), a
            subclass's own ``qvalue_loss``, ...; checked on every call, so a later
            ``make_value_estimator`` counts) TorchRL's code runs. The values equal TorchRL's
            either way (tested). Defaults to True.
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
        fused: bool = True,
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
        self._plan = self._fused_plan() if fused else None
        self._no_plan = _fused.no_plan_reason(fused)

    def _fused_blocker(self):
        """Why this call runs TorchRL's code, not the fused path; None when the fused path is exact."""
        if self._plan is None:
            return self._no_plan
        return _fused.torchrl_blocker(
            self,
            _TorchRLIQLLoss,
            ("actor_loss", "qvalue_loss", "value_loss"),
            value_network=self.value_network,
            value_key=self.tensor_keys.value,
        )

    def _fused_plan(self):
        """What the fused path needs, or None when the networks are not our plain MLPs."""
        from torchrl.modules import TanhNormal

        from offline_plugins.modules.networks import QValueNet

        if self.reduction != "mean" or self.num_qvalue_nets < 2:
            return None
        actor = self.actor_network
        try:
            head, dist_module = actor.module[0], actor.module[-1]
            seq = head.module
            q_net = self.qvalue_network.module
            v_net = self.value_network.module
        except (AttributeError, IndexError, TypeError):
            return None
        kwargs = getattr(dist_module, "distribution_kwargs", {}) or {}
        if (
            getattr(dist_module, "distribution_class", None) is not TanhNormal
            or kwargs.get("tanh_loc", False)
            or not isinstance(seq, torch.nn.Sequential)
            or len(seq) != 2
            or not isinstance(q_net, QValueNet)
            or list(head.in_keys) != list(self.value_network.in_keys)
            or len(head.in_keys) != 1
        ):
            return None
        plan = {
            "actor": _fused.linear_chain(seq[0], actor),
            "extractor": seq[1],
            "q": _fused.linear_chain(q_net.net, self.qvalue_network),
            "v": _fused.linear_chain(v_net, self.value_network),
            "obs": head.in_keys[0],
        }
        if any(plan[k] is None for k in ("actor", "q", "v")):
            return None
        low, high = kwargs.get("low", -1.0), kwargs.get("high", 1.0)
        self.register_buffer("_fused_low", torch.as_tensor(low, dtype=torch.float32).clone())
        self.register_buffer("_fused_high", torch.as_tensor(high, dtype=torch.float32).clone())
        return plan

    def _fused_forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        plan, keys = self._plan, self.tensor_keys
        tensordict, obs, action, next_obs, reward, not_terminal = _fused.transition(tensordict, keys, plan["obs"])
        obs_action = torch.cat([obs, action], -1)
        v_layers = _fused.chain_params(self.value_network_params, plan["v"])
        kept = ("next", *self.actor_network.in_keys, keys.action)  # what TorchRL's qvalue_loss hands its estimator
        with torch.no_grad():
            q_target = _fused.run_ensemble(
                _fused.chain_params(self.target_qvalue_network_params, plan["q"]), obs_action
            ).squeeze(-1)
            min_q = q_target.min(0).values
            v_next = _fused.run_chain([(w.detach(), b.detach()) for w, b in v_layers], next_obs).squeeze(-1)
            gamma = _fused.td0_discount(self.value_estimator, tensordict, reward, kept)
            target = reward + gamma * not_terminal * v_next
        value = _fused.run_chain(v_layers, obs).squeeze(-1)
        diff = min_q - value
        loss_value = self.loss_value_diff(diff, self.expectile).mean()
        q = _fused.run_ensemble(_fused.chain_params(self.qvalue_network_params, plan["q"]), obs_action).squeeze(-1)
        loss_qvalue = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0).mean()
        loc, scale = plan["extractor"](_fused.run_chain(_fused.chain_params(self.actor_network_params, plan["actor"]), obs))
        log_prob = _fused.tanh_normal_log_prob(loc, scale, action, self._fused_low, self._fused_high)
        advantage = diff.detach()
        weight = torch.exp(advantage * self.temperature).clamp_max(100)
        loss_actor = -(weight * log_prob).mean()
        tensordict.set(keys.priority, (q.detach() - target).pow(2).max(0).values)
        out = TensorDict(
            {
                "loss_actor": loss_actor,
                "loss_qvalue": loss_qvalue,
                "loss_value": loss_value,
                "entropy": -log_prob.detach().mean(),
            }
        )
        if self.diagnostics:
            out.update(data_q_diagnostics(min_q, tensordict, keys.return_to_go))
            out.update(advantage_diagnostics(value.detach(), advantage, weight, 100))
        return out

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self._fused_blocker() is not None:
            return super().forward(tensordict)
        check_batch_keys(tensordict, self._required_keys(), type(self).__name__)
        if _fused.loss_mask_present(self, tensordict):
            return super().forward(tensordict)
        return self._fused_forward(tensordict)


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
