"""Flow Q-learning: a flow-matching behaviour policy, a one-step policy distilled from it toward high Q, critics.

Park, Li & Levine 2025, "Flow Q-Learning", arXiv:2502.02538. TorchRL added an ``FQLLoss``
after the 0.14.1 we are on; ours keeps its contract (constructor, keys, ``out_keys``, the
entries ``forward`` returns, TD(0) only, reductions, masks and priority weights), and adds
what our other offline losses have: input checks that name the key, opt-in diagnostics and
``columns``. Where it differs: the distillation distance is taken in units of half the
action range (the same as TorchRL's for actions in [-1, 1]), and the actions are clipped to
the policies' bounds rather than to [-1, 1] (docs/algorithms/fql.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule, dispatch
from tensordict.utils import NestedKey
from torchrl.objectives.common import LossModule
from torchrl.objectives.utils import ValueEstimators, _vmap_func

from offline_plugins.modules.flow import FlowMatchingPolicy, OneStepPolicy
from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import (
    DiagnosticsContract,
    HyperparameterError,
    TransitionKeys,
    check_batch_keys,
    check_range,
    make_td0_value_estimator,
    td0_value_estimator_keys,
)

__all__ = ["FQLLoss"]

#: TorchRL's ``FQLLoss.out_keys``
_TORCHRL_OUT_KEYS = ("loss_flow", "loss_actor", "loss_qvalue")
_Q_AGGREGATIONS = ("mean", "min")


class FQLLoss(DiagnosticsContract, LossModule):
    r"""Flow Q-learning (Park, Li & Levine 2025, arXiv:2502.02538).

    Three terms, each reaching only its own network. The behaviour flow :math:`v(s, x, t)` is
    fit to the data's actions by flow matching; the one-step policy :math:`\mu(s, z)` maximises
    Q while staying near the flow's action from the same noise; the critics regress on a TD(0)
    target at the one-step policy's next action:

    .. math::
        L_{flow} = E\,\tfrac{1}{d}\lVert v(s, x_t, t) - (a - x_0)\rVert^2,\quad
            x_0 \sim N(0, I),\ t \sim U(0, 1),\ x_t = (1 - t) x_0 + t a \\
        L_\mu = E\big[\alpha\, \tfrac{1}{d}\lVert (\mu(s, z) - \mathrm{sg}[f(s, z)]) / h\rVert^2
            - \lambda\, \tfrac{1}{n}\textstyle\sum_i Q_i(s, \mathrm{clip}(\mu(s, z)))\big],\quad z \sim N(0, I) \\
        L_Q = E\,\tfrac{1}{n}\textstyle\sum_i (Q_i(s, a) - y)^2,\quad
            y = r + \gamma (1 - d_{term})\, \mathrm{agg}_i \bar Q_i(s', \mathrm{clip}(\mu(s', z')))

    where :math:`f(s, z)` is the flow's Euler integration from :math:`z` (its ``num_steps``,
    the paper's ``flow_steps``) clipped to the bounds, :math:`d` the action dimension,
    :math:`h` half the action range, :math:`\lambda = 1 / E|Q|` (detached) with
    ``normalize_q_loss`` else 1, and :math:`\mathrm{agg}` the mean or the minimum over the
    ``n`` target critics. The actor's Q term always averages the critics, as the paper's code.

    Args:
        flow_policy (FlowMatchingPolicy): the behaviour flow
            (:func:`~offline_plugins.modules.flow.make_flow_policy`); its first ``in_key`` is
            the observation it reads.
        actor_network (OneStepPolicy): the one-step policy
            (:func:`~offline_plugins.modules.flow.make_one_step_policy`); the action bounds are its.
        qvalue_network (TensorDictModule or list of them): ``Q(s, a)`` writing
            ``state_action_value``; one is copied ``num_qvalue_nets`` times (re-initialised), a
            list gives the critics themselves. Only the critics have target parameters
            (stepped outside the loss by TorchRL's ``SoftUpdate``).

    Keyword Args:
        num_qvalue_nets (int): critics. Defaults to 2.
        alpha (float): :math:`\alpha` >= 0, the distillation weight. Defaults to 10.0 (the paper
            code's default; it tunes it per environment: ``FQL_OGBENCH_ALPHA`` in
            :mod:`offline_plugins.algorithms.fql`).
        q_aggregation (str): ``"mean"`` or ``"min"`` over the target critics. Defaults to ``"mean"``.
        normalize_q_loss (bool): divide the Q term by the detached mean :math:`|Q|`. Defaults to False.
        reduction (str): ``"none"``, ``"mean"`` or ``"sum"`` over the batch; the action
            coordinates and the critics are averaged first. Defaults to ``"mean"``.
        diagnostics (bool): add, detached and averaged over the positions the loss counts,
            ``q_data_mean`` (the critics' mean on the data's actions), ``q_policy_mean`` (on the
            one-step policy's), ``distill_mse`` (the distillation distance) and
            ``actor_data_mse`` (the one-step policy's distance to the data's action, in the
            same units), listed in ``out_keys`` after TorchRL's. Not with ``reduction="none"``.
            Defaults to False, so that ``out_keys`` are TorchRL's.
        mc_diagnostics (bool): with ``diagnostics``, also ``mc_return_mean`` and
            ``q_data_minus_mc`` from the batch's ``mc_return`` (the data's return discounted at
            the loss's gamma), which then joins ``in_keys``. Defaults to False.
        columns (DatasetColumns): fills the columns it holds (``mc_return``) into batches that
            lack them, by their storage ``index``. Defaults to None.

    ``forward`` returns ``loss_flow``, ``loss_actor``, ``loss_qvalue`` and, as TorchRL's,
    the per-sample ``distillation_loss``, ``q_loss`` and ``target_value`` (detached, not in
    ``out_keys``), and writes the largest squared TD error over the critics at ``td_error``.

    Examples:
        >>> import torch
        >>> from torchrl.data import Bounded
        >>> from offline_plugins.modules.flow import make_flow_policy, make_one_step_policy, make_fql_qvalue
        >>> from offline_plugins.objectives.common import random_transitions
        >>> spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        >>> loss = FQLLoss(make_flow_policy(3, spec, (8,), num_steps=3), make_one_step_policy(3, spec, (8,)),
        ...                make_fql_qvalue(3, 2, (8,)), alpha=3.0)
        >>> loss = loss.make_value_estimator(gamma=0.99)
        >>> out = loss(random_transitions(spec.rand((4,)), obs_dim=3))
        >>> loss.out_keys, out["distillation_loss"].shape
        (['loss_flow', 'loss_actor', 'loss_qvalue'], torch.Size([4]))
    """

    @dataclass
    class _AcceptedKeys(TransitionKeys):
        """Keys the loss reads and writes (rename them with ``set_keys``): ``action``, ``reward``,
        ``done``, ``terminated``, ``priority`` (TorchRL's) and ``mc_return`` (the diagnostics'), from
        :class:`~offline_plugins.objectives.common.TransitionKeys`, and TorchRL's two below. The
        observation keys are the networks' ``in_keys``.

        Attributes:
            value (NestedKey): what the critics write. Defaults to ``"state_action_value"``.
            priority_weight (NestedKey): importance weights of a prioritised buffer, applied when
                present. Defaults to ``"priority_weight"``.
        """

        value: NestedKey = "state_action_value"
        priority_weight: NestedKey = "priority_weight"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    default_value_estimator = ValueEstimators.TD0

    flow_policy: FlowMatchingPolicy
    actor_network: OneStepPolicy
    qvalue_network: TensorDictModule
    flow_policy_params: TensorDictParams
    actor_network_params: TensorDictParams
    qvalue_network_params: TensorDictParams
    target_flow_policy_params: TensorDictParams
    target_actor_network_params: TensorDictParams
    target_qvalue_network_params: TensorDictParams

    def __init__(
        self,
        flow_policy: FlowMatchingPolicy,
        actor_network: OneStepPolicy,
        qvalue_network: TensorDictModule | list[TensorDictModule],
        *,
        num_qvalue_nets: int = 2,
        alpha: float = 10.0,
        q_aggregation: str = "mean",
        normalize_q_loss: bool = False,
        reduction: str = "mean",
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
    ) -> None:
        for name, module, cls, maker in (("flow_policy", flow_policy, FlowMatchingPolicy, "make_flow_policy"),
                                         ("actor_network", actor_network, OneStepPolicy, "make_one_step_policy")):
            if not isinstance(module, cls):
                raise TypeError(f"FQLLoss: {name} must be a {cls.__name__}, got {type(module).__name__}; build "
                                f"one with offline_plugins.modules.flow.{maker}")
        check_range("FQLLoss", "alpha", alpha, 0.0, None, low_inclusive=True)
        check_range("FQLLoss", "num_qvalue_nets", num_qvalue_nets, 1, None, low_inclusive=True)
        if q_aggregation not in _Q_AGGREGATIONS:
            raise HyperparameterError(f"FQLLoss: q_aggregation={q_aggregation!r} must be 'mean' or 'min'")
        if reduction not in ("none", "mean", "sum"):
            raise HyperparameterError(f"FQLLoss: reduction={reduction!r} must be 'none', 'mean' or 'sum'")
        self._init_diagnostics(diagnostics, mc_diagnostics)
        super().__init__()
        low, high = actor_network.module.low, actor_network.module.high
        self.convert_to_functional(flow_policy, "flow_policy")
        self.convert_to_functional(actor_network, "actor_network")
        self.convert_to_functional(qvalue_network, "qvalue_network", int(num_qvalue_nets), create_target_params=True)
        self.num_qvalue_nets = int(num_qvalue_nets)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.register_buffer("action_low", low.detach().clone())
        self.register_buffer("action_high", high.detach().clone())
        self.register_buffer("action_scale", ((high - low) / 2).detach().clamp_min(1e-6))
        self.q_aggregation = q_aggregation
        self.normalize_q_loss = bool(normalize_q_loss)
        self.reduction = reduction
        self._make_vmap()
        self._set_out_keys()
        self._set_columns(columns)

    def _make_vmap(self) -> None:
        self._vmap_qvalue = _vmap_func(self.qvalue_network, (None, 0), randomness=self.vmap_randomness)

    def _torchrl_out_keys(self) -> list:
        return list(_TORCHRL_OUT_KEYS)

    def _diagnostic_keys(self) -> list:
        return ["q_data_mean", "q_policy_mean", "distill_mse", "actor_data_mse"]

    def _observation_keys(self) -> list:
        return [self.actor_network.in_keys[0]]

    @property
    def in_keys(self) -> list:
        """TorchRL's order: the action, the networks' observations, then the ``"next"`` entries."""
        keys = self.tensor_keys
        obs = [self.flow_policy.in_keys[0], self.actor_network.in_keys[0]]
        current = [keys.action, *obs, *self.qvalue_network.in_keys]
        following = [("next", k) for k in [obs[1], *self.qvalue_network.in_keys] if k != keys.action]
        following += [("next", keys.reward), ("next", keys.done), ("next", keys.terminated)]
        if self._emits_mc():
            following.append(keys.mc_return)
        return list(dict.fromkeys(current + following))

    @in_keys.setter
    def in_keys(self, values) -> None:
        self._in_keys = values

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        td0_value_estimator_keys(self, self.tensor_keys.value)

    def make_value_estimator(self, value_type=None, **hyperparams) -> "FQLLoss":
        """TD(0), the only estimator (another raises ``NotImplementedError``, as TorchRL's); returns the loss."""
        value_type, hp = self._prepare_value_estimator_kwargs(value_type, **hyperparams)
        if value_type is not None:
            make_td0_value_estimator(self, value_type, self.tensor_keys.value, **hp)
        self._forward_value_estimator_keys()
        return self

    def _reduce(self, loss: torch.Tensor, tensordict: TensorDictBase, reduction: Optional[str] = None) -> torch.Tensor:
        """TorchRL's reduction with the batch's loss masks and priority weights."""
        return self._reduce_loss(loss, tensordict, reduction=reduction,
                                 weights=self._maybe_get_priority_weight(tensordict))

    def _critics(self, tensordict: TensorDictBase, action: Optional[torch.Tensor], params) -> torch.Tensor:
        """``[n, *B]``: every critic on ``tensordict``'s inputs, at ``action`` when given."""
        td = tensordict.select(*self.qvalue_network.in_keys, strict=False)
        if action is not None:
            td.set(self.tensor_keys.action, action)
        return self._vmap_qvalue(td, params).get(self.tensor_keys.value).squeeze(-1)

    def _clip(self, action: torch.Tensor) -> torch.Tensor:
        return torch.clamp(action, self.action_low.to(action), self.action_high.to(action))

    def flow_loss(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Flow matching of the velocity field on the data's actions (straight paths from the noise)."""
        action = tensordict.get(self.tensor_keys.action)
        noise = torch.randn_like(action)
        time = torch.rand_like(action[..., :1])
        interpolated = (1 - time) * noise + time * action
        observation = tensordict.get(self.flow_policy.in_keys[0])
        with self.flow_policy_params.to_module(self.flow_policy):
            velocity = self.flow_policy.module.velocity(observation, interpolated, time)
        return self._reduce((velocity - (action - noise)).pow(2).mean(-1), tensordict)

    def flow_actions(self, observation: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The flow's clipped Euler sample from ``noise``, without gradients: the distillation target."""
        with torch.no_grad(), self.flow_policy_params.to_module(self.flow_policy):
            return self.flow_policy.module(observation, noise)

    def actor_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        """:math:`\\alpha` times the distillation distance minus the (normalised) mean critic value."""
        keys = self.tensor_keys
        data_action = tensordict.get(keys.action)
        noise = torch.randn_like(data_action)
        target = self.flow_actions(tensordict.get(self.flow_policy.in_keys[0]), noise)
        with self.actor_network_params.to_module(self.actor_network):
            action = self.actor_network.module(tensordict.get(self.actor_network.in_keys[0]), noise, clamp=False)
        distillation = ((action - target) / self.action_scale).pow(2).mean(-1)
        clipped = self._clip(action)
        # the critics' weights are frozen here; the gradient reaches the action
        qvalue = self._critics(tensordict, clipped, self.qvalue_network_params.detach()).mean(0)
        q_loss = -qvalue
        if self.normalize_q_loss:
            scale = self._reduce(qvalue.detach().abs(), tensordict, reduction="mean")
            q_loss = q_loss / scale.clamp_min(torch.finfo(qvalue.dtype).eps)
        loss = self._reduce(self.alpha * distillation + q_loss, tensordict)
        metadata = {"distillation_loss": distillation.detach(), "q_loss": q_loss.detach()}
        if self._emits_diagnostics():
            with torch.no_grad():
                gap = ((clipped - data_action) / self.action_scale).pow(2).mean(-1)
                metadata["_diagnostics"] = {"q_policy_mean": qvalue, "distill_mse": distillation,
                                            "actor_data_mse": gap}
        return loss, metadata

    def qvalue_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        """Squared error to the TD(0) target at the one-step policy's next action, averaged over the critics."""
        keys = self.tensor_keys
        td = tensordict.clone(False)
        with torch.no_grad():
            next_td = td.get("next")
            with self.actor_network_params.to_module(self.actor_network):
                next_action = self.actor_network.module(next_td.get(self.actor_network.in_keys[0]))
            next_q = self._critics(next_td, self._clip(next_action), self.target_qvalue_network_params)
            next_value = next_q.mean(0) if self.q_aggregation == "mean" else next_q.min(0).values
            td.set(("next", keys.value), next_value.unsqueeze(-1))
            target = self.value_estimator.value_estimate(td).squeeze(-1)
        prediction = self._critics(td, None, self.qvalue_network_params)
        error = (prediction - target).pow(2)
        loss = self._reduce(error.mean(0), tensordict)
        return loss, {"td_error": error.detach().max(0).values, "target_value": target,
                      "_q_data": prediction.detach().mean(0)}

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        self._fill_columns(tensordict)
        self._check_diagnostic_keys(tensordict)
        check_batch_keys(tensordict, self.in_keys, type(self).__name__)

    @torch.no_grad()
    def _diagnose(self, tensordict: TensorDictBase, q_data: torch.Tensor, per_sample: dict) -> dict:
        """The ``diagnostics`` entries: means over the positions the loss counts."""
        out = {"q_data_mean": self._reduce_loss(q_data, tensordict, reduction="mean")}
        out.update({k: self._reduce_loss(v, tensordict, reduction="mean") for k, v in per_sample.items()})
        valid = self._counted_positions(tensordict, q_data)
        out.update(self._mc_diagnostics(q_data if valid is None else q_data[valid], tensordict, valid))
        return out

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._check_batch(tensordict)
        loss_flow = self.flow_loss(tensordict)
        loss_actor, actor_metadata = self.actor_loss(tensordict)
        loss_qvalue, critic_metadata = self.qvalue_loss(tensordict)
        tensordict.set(self.tensor_keys.priority, critic_metadata.pop("td_error"))
        q_data, per_sample = critic_metadata.pop("_q_data"), actor_metadata.pop("_diagnostics", None)
        out = TensorDict({"loss_flow": loss_flow, "loss_actor": loss_actor, "loss_qvalue": loss_qvalue,
                          **actor_metadata, **critic_metadata})
        if per_sample is not None:
            out.update(self._diagnose(tensordict, q_data, per_sample))
        self._clear_weakrefs(tensordict, out, "flow_policy_params", "actor_network_params",
                             "qvalue_network_params", "target_qvalue_network_params")
        return out
