"""IQL: TorchRL's ``IQLLoss`` / ``DiscreteIQLLoss`` plus input checks and diagnostics.

The loss terms are TorchRL's, unchanged (``tests/test_objectives_offline.py`` and
``tests/test_objectives_fused.py`` check they agree with TorchRL's on the same networks
and batch, for every value estimator), and so is the module contract: ``out_keys``,
``select_out_keys``, keyword calls, ``set_keys``, reductions, N-D and masked batches,
``state_dict`` (``tests/test_conformance_iql.py``). What we add: a
:class:`~offline_plugins.errors.UserError` for bad hyperparameters and missing batch
keys, the value/advantage statistics the offline diagnostics need, paper defaults, and
a fused fast path. Each difference has an argument that gives TorchRL's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.data import Composite
from torchrl.data.utils import _find_action_space
from torchrl.modules import TanhNormal
from torchrl.objectives import DiscreteIQLLoss as _TorchRLDiscreteIQLLoss
from torchrl.objectives import IQLLoss as _TorchRLIQLLoss
from torchrl.objectives.utils import distance_loss

from offline_plugins.modules.networks import QValueNet
from offline_plugins.objectives import _fused
from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import DiagnosticsContract, MCReturnKey, advantage_diagnostics, check_range

__all__ = ["IQLLoss", "DiscreteIQLLoss"]

#: what TorchRL's IQL ``forward`` returns, in the order of its ``out_keys``
_TORCHRL_OUT_KEYS = ("loss_actor", "loss_qvalue", "loss_value", "entropy")
_DIAGNOSTIC_KEYS = (
    "q_data_mean",
    "value_mean",
    "advantage_mean",
    "advantage_std",
    "advantage_weight_mean",
    "advantage_weight_clipped_frac",
)
_MAX_WEIGHT = 100  # TorchRL's clamp of exp(beta * A)


class _IQLCommon(DiagnosticsContract):
    """What both IQL losses add to TorchRL's: range checks and the value/advantage diagnostics."""

    _expectile_max_inclusive: bool  # whether the subclass's TorchRL loss takes expectile = 1

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
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
        check_hyperparameters: bool = True,
        **kwargs,
    ) -> None:
        if check_hyperparameters:
            self._init_checks(expectile, temperature, expectile_max_inclusive=self._expectile_max_inclusive)
        self._init_diagnostics(diagnostics, mc_diagnostics)
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
        self._set_out_keys()
        self._set_columns(columns)

    def _init_checks(self, expectile: float, temperature: float, *, expectile_max_inclusive: bool) -> None:
        name = type(self).__name__
        check_range(name, "expectile", expectile, 0.0, 1.0, high_inclusive=expectile_max_inclusive)
        check_range(name, "temperature", temperature, 0.0, None, low_inclusive=True)

    def _torchrl_out_keys(self) -> list:
        keys = list(_TORCHRL_OUT_KEYS)
        if self.reduction == "none" and getattr(self, "scalar_output_mode", None) != "non_tensor":
            keys.remove("entropy")  # TorchRL drops it from the output (but not from its out_keys)
        return keys

    def _diagnostic_keys(self) -> list:
        return list(_DIAGNOSTIC_KEYS)

    def _chosen_q(self, state_action_value: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return state_action_value.squeeze(-1)

    def _diagnostics(self, min_q: torch.Tensor, value: torch.Tensor, tensordict: TensorDictBase) -> dict:
        """The ``diagnostics`` entries, averaged over the positions the loss's reduction counts.

        ``min_q``/``value``: the target-ensemble minimum on the data's actions and ``V(s)``,
        shaped like the batch; ``tensordict``: the batch (its mask and ``mc_return``).
        """
        min_q, value = min_q.detach(), value.detach()
        valid = self._counted_positions(tensordict, min_q)
        if valid is not None:
            min_q, value = min_q[valid], value[valid]
        advantage = min_q - value
        weight = torch.exp(advantage * self.temperature).clamp_max(_MAX_WEIGHT)
        out = {"q_data_mean": min_q.mean()}
        out.update(advantage_diagnostics(value, advantage, weight, _MAX_WEIGHT))
        out.update(self._mc_diagnostics(min_q, tensordict, valid))
        return out

    @torch.no_grad()
    def _diagnose(self, tensordict: TensorDictBase) -> dict:
        td_q = tensordict.select(*self.qvalue_network.in_keys, strict=False)
        td_q = self._vmap_qvalue_networkN0(td_q, self.target_qvalue_network_params)
        q = self._chosen_q(td_q.get(self.tensor_keys.state_action_value), tensordict.get(self.tensor_keys.action))
        td_v = tensordict.select(*self.value_network.in_keys, strict=False)
        with self.value_network_params.to_module(self.value_network, preserve_module_state=False):
            self.value_network(td_v)
        value = td_v.get(self.tensor_keys.value).squeeze(-1)
        return self._diagnostics(q.min(0).values, value, tensordict)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._diagnosed_forward(tensordict)


class IQLLoss(_fused.FusedPath, _IQLCommon, _TorchRLIQLLoss):
    r"""Implicit Q-Learning (Kostrikov et al. 2022, arXiv:2110.06169), TorchRL's loss with diagnostics.

    .. math::
        L_V = E[|\tau - 1(u<0)| u^2],\ u = \min_i \bar Q_i(s,a) - V(s); \quad
        L_Q = E[(Q(s,a) - r - \gamma V(s'))^2]; \quad
        L_\pi = -E[\min(e^{\beta(\bar Q - V)}, 100) \log\pi(a|s)]

    A drop-in for :class:`torchrl.objectives.IQLLoss`: same arguments, keys, outputs and
    ``state_dict``. Where the defaults differ (the paper's hyperparameters, range checks)
    the argument named below gives TorchRL's behaviour.

    Args:
        actor_network: stochastic actor (``get_dist``), e.g.
            :func:`~offline_plugins.modules.networks.make_tanh_gaussian_actor`.
        qvalue_network: ``Q(s, a)`` writing ``"state_action_value"``; copied
            ``num_qvalue_nets`` times.
        value_network: ``V(s)`` writing ``"state_value"``.

    Keyword Args:
        expectile (float): :math:`\tau` in (0, 1]; 1 is the in-support maximum the paper's
            :math:`\tau \to 1` limit approaches. Defaults to 0.7 (the paper's MuJoCo value;
            TorchRL's is 0.5).
        temperature (float): inverse temperature :math:`\beta` >= 0. Defaults to 3.0 (the
            paper's; TorchRL's is 1.0).
        num_qvalue_nets (int): critics in the ensemble. Defaults to 2.
        loss_function (str): Q regression loss. Defaults to ``"l2"`` (the paper's; TorchRL's
            is ``"smooth_l1"``).
        diagnostics (bool): add ``q_data_mean`` (the target ensemble's minimum on the data's
            actions), ``value_mean``, ``advantage_mean``, ``advantage_std``,
            ``advantage_weight_mean`` and ``advantage_weight_clipped_frac``, detached and
            averaged over the positions the loss counts (a collector or padding mask excludes
            the rest), listed in ``out_keys`` after TorchRL's four, so keyword calls return them
            too. Free on the fused path (one no-grad critic and value pass otherwise); not
            returned with ``reduction="none"``, whose per-element output has no room for batch
            statistics. Off by default, so ``out_keys``, ``in_keys`` and keyword calls are
            TorchRL's; the ``iql`` algorithms turn them on. Defaults to False.
        mc_diagnostics (bool): with ``diagnostics``, also ``mc_return_mean`` (the batch's
            ``mc_return``: the data's Monte-Carlo return discounted at the loss's gamma) and
            ``q_data_minus_mc`` (``q_data_mean`` minus it: the over-estimation), listed last.
            ``mc_return`` then joins ``in_keys`` (a keyword call passes ``mc_return=``), and a
            batch without it (after ``columns``) raises
            :class:`~offline_plugins.objectives.common.MissingBatchKeyError`. The ``iql``
            algorithms turn it on when the dataset has stored episodes. Defaults to False.
        columns (DatasetColumns): fills the columns it holds into batches that lack them, by
            their storage ``index``, before the batch's keys are checked
            (:class:`~offline_plugins.objectives.columns.DatasetColumns`; the ``iql`` algorithms
            pass ``mc_return`` from :func:`~offline_plugins.objectives.columns.discounted_returns`
            at their ``gamma``). Defaults to None: the batch carries what the loss reads.
        check_hyperparameters (bool): raise :class:`~offline_plugins.objectives.common.HyperparameterError`
            (a ``ValueError``) for ``expectile`` outside (0, 1] or a negative ``temperature``,
            where the value regression or the advantage weights lose their meaning.
            ``False`` passes any value to TorchRL, which checks none. Defaults to True.
        fused (bool): compute the three terms in one pass straight from the parameters
            (the target critics run once, not twice; the ensemble is one batched matmul per
            layer; the tanh-Gaussian density in closed form) where that is exactly TorchRL's
            computation: the networks are the plain MLPs of
            :mod:`offline_plugins.modules.networks`, the value estimator is TorchRL's plain
            TD(0) (any ``gamma``), ``actor_loss``/``qvalue_loss``/``value_loss`` are not
            overridden and the batch has no loss mask. Otherwise (TD(1), TD(lambda), a
            subclass's own ``qvalue_loss``, ...; checked on every call, so a later
            ``make_value_estimator`` counts) TorchRL's code runs. The values, and what is
            written back into the batch (``td_error``, ``_log_prob``), equal TorchRL's either
            way (tested); ``fused=False`` runs TorchRL's code always. Defaults to True.
        **kwargs: passed to :class:`torchrl.objectives.IQLLoss` (``reduction``,
            ``separate_losses``, ``deactivate_vmap``, ``scalar_output_mode``, ...).

    The extra key ``mc_return`` (``set_keys(mc_return=...)``) is read only with
    ``mc_diagnostics=True``: the data's Monte-Carlo return from each step discounted at the
    loss's gamma, :math:`\sum_k \gamma^k r_{t+k}` to the episode's end, the quantity ``Q``
    estimates for the behaviour policy, so ``q_data_minus_mc`` compares like with like (the
    data layer's ``return_to_go`` is undiscounted and is not it).

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.networks import make_value
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic()
        >>> loss = IQLLoss(actor, qvalue, make_value(3, (8,)))
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> loss.out_keys  # TorchRL's
        ['loss_actor', 'loss_qvalue', 'loss_value', 'entropy']
        >>> loss_actor, loss_value = loss.select_out_keys("loss_actor", "loss_value")(
        ...     observation=batch["observation"], action=batch["action"],
        ...     next_observation=batch["next", "observation"], next_reward=batch["next", "reward"],
        ...     next_done=batch["next", "done"], next_terminated=batch["next", "terminated"])
        >>> loss = IQLLoss(actor, qvalue, make_value(3, (8,)), diagnostics=True, mc_diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> loss.out_keys[3:6], loss.out_keys[-2:]  # TorchRL's, the diagnostics, the Monte-Carlo pair
        (['entropy', 'q_data_mean', 'value_mean'], ['mc_return_mean', 'q_data_minus_mc'])
        >>> loss(batch)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        offline_plugins.objectives.common.MissingBatchKeyError: IQLLoss: the batch has no key 'mc_return', ...
        >>> batch["mc_return"] = torch.randn(4, 1)
        >>> list(loss(batch).keys()) == loss.out_keys
        True
        >>> IQLLoss(actor, qvalue, make_value(3, (8,)),
        ...         expectile=1.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        offline_plugins.objectives.common.HyperparameterError: IQLLoss: expectile=1.5 is outside (0, 1]; ...
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLIQLLoss._AcceptedKeys):
        """TorchRL's IQL keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    _expectile_max_inclusive = True
    _fused_torchrl = _TorchRLIQLLoss
    _fused_methods = ("actor_loss", "qvalue_loss", "value_loss")

    def __init__(self, actor_network, qvalue_network, value_network, *, fused: bool = True, **kwargs) -> None:
        # the other keyword arguments (expectile, temperature, ...): _IQLCommon's, documented above
        super().__init__(actor_network, qvalue_network, value_network, **kwargs)
        self._init_fused(fused)

    def _fused_value(self) -> tuple:
        return self.value_network, self.tensor_keys.value

    def _fused_plan(self):
        """What the fused path needs, or None when the networks are not our plain MLPs."""
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
        # Not persistent: derived from the actor, and TorchRL's IQLLoss has no such entries, so a
        # state_dict loads both ways between ours and TorchRL's.
        self.register_buffer("_fused_low", torch.as_tensor(low, dtype=torch.float32).clone(), persistent=False)
        self.register_buffer("_fused_high", torch.as_tensor(high, dtype=torch.float32).clone(), persistent=False)
        self.register_load_state_dict_pre_hook(_drop_fused_bounds)
        return plan

    def _fused_forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        plan, keys = self._plan, self.tensor_keys
        source = tensordict  # what TorchRL writes td_error and the log-prob into, at its batch shape
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
        weight = torch.exp(diff.detach() * self.temperature).clamp_max(_MAX_WEIGHT)
        loss_actor = -(weight * log_prob).mean()
        source.set(keys.priority, (q.detach() - target).pow(2).max(0).values.reshape(source.batch_size))
        source.set(keys.log_prob, log_prob.detach().reshape(source.batch_size))
        out = TensorDict(
            {
                "loss_actor": loss_actor,
                "loss_qvalue": loss_qvalue,
                "loss_value": loss_value,
                "entropy": -log_prob.detach().mean(),
            }
        )
        if self._emits_diagnostics():
            out.update(self._diagnostics(min_q, value, tensordict))
        return out

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self._fused_blocker() is not None:
            return super().forward(tensordict)
        self._check_batch(tensordict)
        if _fused.loss_mask_present(self, tensordict):
            return super().forward(tensordict)
        return self._fused_forward(tensordict)


def _drop_fused_bounds(module, state_dict, prefix, *args) -> None:
    # checkpoints written before the bounds became non-persistent still hold them
    for name in ("_fused_low", "_fused_high"):
        state_dict.pop(prefix + name, None)


def _actor_action_space(actor) -> Optional[str]:
    """``"categorical"``/``"one_hot"``/... from the actor's action spec; None when it has none."""
    spec = getattr(actor, "spec", None)
    if isinstance(spec, Composite):
        leaves = {k: spec[k] for k in spec.keys(True, True) if spec[k] is not None}
        spec = leaves.get("action", next(iter(leaves.values())) if len(leaves) == 1 else None)
    if spec is None:
        return None
    try:
        return _find_action_space(spec)
    except (ValueError, KeyError):
        return None


class DiscreteIQLLoss(_IQLCommon, _TorchRLDiscreteIQLLoss):
    r"""Discrete-action IQL (Kostrikov et al. 2022), TorchRL's ``DiscreteIQLLoss`` with diagnostics.

    A drop-in for :class:`torchrl.objectives.DiscreteIQLLoss`, as :class:`IQLLoss` is for
    TorchRL's ``IQLLoss``.

    Args:
        actor_network: categorical actor, e.g.
            :func:`~offline_plugins.modules.networks.make_categorical_actor`.
        qvalue_network: ``Q(s, .)`` writing ``"state_action_value"`` of shape ``[..., n]``.
        value_network: ``V(s)`` writing ``"state_value"``.

    Keyword Args:
        action_space: ``"categorical"`` (int indices, as our data layer stores them),
            ``"one-hot"``, or a spec. Defaults to None: read from the actor's action spec
            (``Categorical`` or ``OneHot``), so the default fits the actor; an actor without a
            spec gets TorchRL's default (a warning, then ``"one-hot"``). TorchRL's None is
            ``"one-hot"`` whatever the actor: pass ``action_space="one-hot"`` for that.
        expectile (float): :math:`\tau` in (0, 1), as TorchRL's discrete loss requires.
            Defaults to 0.7.
        temperature, num_qvalue_nets, loss_function, diagnostics, mc_diagnostics, columns,
            check_hyperparameters: as :class:`IQLLoss`.
        **kwargs: passed to :class:`torchrl.objectives.DiscreteIQLLoss`.

    Examples:
        >>> import torch
        >>> from offline_plugins.objectives.common import random_transitions
        >>> from offline_plugins.modules.networks import make_categorical_actor, make_discrete_qvalue, make_value
        >>> loss = DiscreteIQLLoss(make_categorical_actor(3, 4, (8,)), make_discrete_qvalue(3, 4, (8,)),
        ...                        make_value(3, (8,)))
        >>> loss.action_space  # from the actor's Categorical spec
        'categorical'
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = random_transitions(torch.randint(4, (5,)), obs_dim=3)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue', 'loss_value']
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLDiscreteIQLLoss._AcceptedKeys):
        """TorchRL's discrete IQL keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    _expectile_max_inclusive = False

    def __init__(self, actor_network, qvalue_network, value_network, *, action_space=None, **kwargs) -> None:
        # the other keyword arguments (expectile, temperature, ...): _IQLCommon's, documented above
        if action_space is None:
            action_space = _actor_action_space(actor_network)
        super().__init__(actor_network, qvalue_network, value_network, action_space=action_space, **kwargs)

    def _chosen_q(self, state_action_value: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        if self.action_space == "categorical":
            index = action.long().unsqueeze(-1).expand(state_action_value.shape[0], *action.shape, 1)
            return state_action_value.gather(-1, index).squeeze(-1)
        return (state_action_value * action.to(state_action_value.dtype)).sum(-1)
