"""CQL: TorchRL's ``CQLLoss`` / ``DiscreteCQLLoss`` with the conservative term corrected.

Both classes keep TorchRL's contract (constructor arguments, ``set_keys``, value
estimators, ``reduction``, ``deactivate_vmap``, ``[*B]`` batches with
``("collector", "mask")``, ``select_out_keys`` and keyword calls), so swapping TorchRL's
import for ours runs unchanged. Where ours differs it says so, and one argument gives
TorchRL's behaviour back:

========================  ==========================================  =================================
class                     what differs                                TorchRL's behaviour
========================  ==========================================  =================================
``CQLLoss``               the conservative term (below)               ``conservative_term="torchrl"``
``CQLLoss``               ``min_q_weight=5.0``, ``lagrange_thresh=5.0``, pass TorchRL's ``1.0``, ``0.0``,
                          ``loss_function="l2"`` (the paper's)        ``"smooth_l1"``
``CQLLoss``               with ``reduction="none"``, ``out_keys``     none needed: TorchRL's keyword
                          leaves out ``alpha``/``entropy``, which     call fails there;
                          TorchRL lists but does not return           ``scalar_output_mode="non_tensor"``
                                                                      lists and returns both
``DiscreteCQLLoss``       ``alpha`` weights ``loss_cql``              ``alpha=1.0`` (the default)
========================  ==========================================  =================================

Detached diagnostics (``diagnostics=True``, ``mc_diagnostics=True``) are opt-in: by
default ``out_keys``, ``in_keys`` and keyword calls are TorchRL's.

TorchRL 0.14's continuous conservative term departs from Kumar et al. 2020; ours
(``conservative_term="paper"``, the default) replaces that one method (``cql_loss``):

* the log-sum-exp runs, per state, over all ``3 * num_random`` sampled actions; TorchRL
  takes it over the 3 sources of each single sample (``logsumexp`` over the wrong axis),
  a different and much weaker push-down of the largest Q values;
* the next-state policy's actions are scored at the current state ``s``, as in the
  paper's code; TorchRL scores them at ``s'``;
* with ``with_lagrange=True`` the term is multiplied by the learned :math:`\\alpha'` (TorchRL
  learns it but never applies it, so the threshold had no effect on the critic), and
  ``loss_alpha_prime`` reads the gap detached, so summing every ``loss_*`` term and
  back-propagating once does not push the critic the wrong way.

``tests/test_objectives_offline.py`` checks that ours equals TorchRL's where the two
estimators coincide (one sample per source and ``s' = s``), and the per-state estimator
by hand; ``tests/test_conformance_cql.py`` checks TorchRL's contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.data.utils import _find_action_space
from torchrl.objectives import CQLLoss as _TorchRLCQLLoss
from torchrl.objectives import DiscreteCQLLoss as _TorchRLDiscreteCQLLoss

from offline_plugins.modules.networks import QValueNet
from offline_plugins.objectives import _fused
from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import DiagnosticsContract, MCReturnKey, check_range

__all__ = ["CQLLoss", "DiscreteCQLLoss"]


class CQLLoss(DiagnosticsContract, _TorchRLCQLLoss):
    r"""Conservative Q-Learning (Kumar et al. 2020, arXiv:2006.04779) on a SAC backbone.

    .. math::
        L_Q = L_{Bellman} + \sum_i \alpha' \left(w \left(E_s[\log \sum_a e^{Q_i(s,a)}] - E_{(s,a)\sim D}[Q_i(s,a)]\right) - \tau\right)

    with the log-sum-exp estimated, per state, by importance sampling over ``num_random``
    uniform, current-policy and next-policy actions (all scored at ``s``).
    :math:`\alpha' = 1` and :math:`\tau = 0` unless ``with_lagrange``, which learns
    :math:`\alpha'` by minimising ``loss_alpha_prime`` :math:`= -\alpha'(w \cdot \text{gap} - \tau)`.
    TorchRL's ``CQLLoss`` with :meth:`cql_loss` replaced (see the module docstring for why);
    the Bellman term, SAC actor and temperature are TorchRL's. Batches may have any batch
    shape ``[*B]`` (e.g. ``[B, T]`` from a collector, masked by ``("collector", "mask")``).

    Args:
        actor_network: tanh-Gaussian actor.
        qvalue_network: ``Q(s, a)``; two copies are trained.

    Keyword Args:
        min_q_weight (float): :math:`w` >= 0, the conservative weight (0 switches the term off,
            and ``cql_gap`` with it). Defaults to 5.0 (the paper's Gym value; TorchRL's default is 1.0).
        with_lagrange (bool): learn :math:`\alpha'` to hold the gap at ``lagrange_thresh``. Defaults to False.
        lagrange_thresh (float): :math:`\tau`. Defaults to 5.0 (TorchRL's default is 0.0).
        num_random (int): sampled actions per state for the log-sum-exp, >= 1. Defaults to 10.
        loss_function (str): Bellman regression loss. Defaults to ``"l2"`` (TorchRL's default
            is ``"smooth_l1"``).
        conservative_term (str): ``"paper"`` (default) for the estimator above, ``"torchrl"`` for
            TorchRL's ``cql_loss`` and ``alpha_prime_loss`` unchanged (its numbers exactly).
        diagnostics (bool): add detached ``q_data_mean`` (the smaller critic on the data's
            actions), ``cql_gap`` (log-sum-exp Q minus data Q, per critic, averaged; not with
            ``min_q_weight=0``, which switches the term off) and ``alpha_prime`` (with
            ``with_lagrange``), listed in ``out_keys`` after TorchRL's keys, so keyword calls
            and ``select_out_keys`` see them; no ``loss_*`` name changes. They cost nothing
            (they read what the loss computed); not returned with ``reduction="none"``. Off
            by default, so ``out_keys``, ``in_keys`` and keyword calls are TorchRL's; the
            ``cql`` algorithms turn them on. Defaults to False.
        mc_diagnostics (bool): with ``diagnostics``, also ``mc_return_mean`` (the batch's
            ``mc_return``: the data's Monte-Carlo return discounted at the loss's gamma, the
            quantity Q estimates) and ``q_data_minus_mc`` (``q_data_mean`` minus it), listed last;
            ``mc_return`` joins ``in_keys`` and a batch without it (after ``columns``) raises
            :class:`~offline_plugins.objectives.common.MissingBatchKeyError`. Defaults to False.
        columns (DatasetColumns): fills the columns it holds (``mc_return``) into batches that
            lack them, by their storage ``index``, before the batch's keys are checked
            (:mod:`offline_plugins.objectives.columns`; the ``cql`` algorithms pass one built
            with :func:`~offline_plugins.objectives.columns.discounted_returns` at their
            ``gamma``). Defaults to None: the batch carries what the loss reads.
        **kwargs: passed to :class:`torchrl.objectives.CQLLoss` (``alpha_init``,
            ``temperature`` > 0, ``max_q_backup``, ``deterministic_backup``, ``delay_actor``,
            ``delay_qvalue``, ``reduction``, ``deactivate_vmap``, ``scalar_output_mode``, ...).

    Examples:
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic()
        >>> loss = CQLLoss(actor, qvalue, with_lagrange=True, num_random=2, diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_actor_bc', 'loss_alpha', 'loss_alpha_prime', 'loss_cql', 'loss_qvalue']
        >>> loss.out_keys[-3:]  # after TorchRL's keys
        ['q_data_mean', 'cql_gap', 'alpha_prime']
        >>> set(out.keys()) == set(loss.out_keys)
        True
        >>> loss_qvalue, loss_cql = loss.select_out_keys("loss_qvalue", "loss_cql")(
        ...     observation=batch["observation"], action=batch["action"],
        ...     next_observation=batch["next", "observation"], next_reward=batch["next", "reward"],
        ...     next_done=batch["next", "done"], next_terminated=batch["next", "terminated"])
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLCQLLoss._AcceptedKeys):
        """TorchRL's CQL keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        qvalue_network,
        *,
        min_q_weight: float = 5.0,
        with_lagrange: bool = False,
        lagrange_thresh: float = 5.0,
        num_random: int = 10,
        loss_function: str = "l2",
        conservative_term: str = "paper",
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
        **kwargs,
    ) -> None:
        check_range("CQLLoss", "min_q_weight", min_q_weight, 0.0, None, low_inclusive=True)
        check_range("CQLLoss", "num_random", num_random, 1, None, low_inclusive=True)
        check_range("CQLLoss", "temperature", kwargs.get("temperature", 1.0), 0.0, None)
        if conservative_term not in ("paper", "torchrl"):
            raise ValueError(
                f"CQLLoss: conservative_term={conservative_term!r} is not one of 'paper', 'torchrl'; "
                "use 'torchrl' for TorchRL's cql_loss unchanged"
            )
        self._init_diagnostics(diagnostics, mc_diagnostics)
        self.conservative_term = conservative_term
        super().__init__(
            actor_network,
            qvalue_network,
            min_q_weight=min_q_weight,
            with_lagrange=with_lagrange,
            lagrange_thresh=lagrange_thresh,
            num_random=num_random,
            loss_function=loss_function,
            **kwargs,
        )
        # resolved here, not on first use, so a compiled loss sees a fixed attribute
        # (a lazily set one makes torch.compile recompile)
        self._q_chain = False
        self._critic_chain()
        self._set_out_keys()
        self._set_columns(columns)

    def _torchrl_out_keys(self) -> list:
        keys = ["loss_actor", "loss_actor_bc", "loss_qvalue", "loss_cql", "loss_alpha"]
        if self.reduction != "none" or self.scalar_output_mode == "non_tensor":
            keys += ["alpha", "entropy"]  # TorchRL lists them always, but returns them only so
        if self.with_lagrange:
            keys.append("loss_alpha_prime")
        return keys

    def _diagnostic_keys(self) -> list:
        # min_q_weight=0 (TorchRL accepts it) switches the conservative term off: no gap to report
        gap = ["cql_gap"] if self.min_q_weight > 0 else []
        return ["q_data_mean", *gap, *(["alpha_prime"] if self.with_lagrange else [])]

    @property
    def _alpha_prime(self) -> torch.Tensor:
        return self.log_alpha_prime.detach().exp().clamp_max(1e6)

    def _critic_chain(self):
        """The critics' Linear layers when they are our plain ``QValueNet`` MLPs (else None).

        The conservative term scores ``3 * num_random`` actions per state, 30x the
        batch: most of a CQL step. On that path the critics run straight from their
        stacked weights with the bias fused into the matmul (``addmm`` per critic on a
        CPU, one ``baddbmm`` on a GPU), not TorchRL's ``vmap`` (a ``bmm`` and a separate
        bias add per layer).
        """
        if self._q_chain is False:
            net = getattr(self.qvalue_network, "module", None)
            keys = self.qvalue_network.in_keys
            ok = (isinstance(net, QValueNet) and len(keys) == 2 and keys[1] == self.tensor_keys.action
                  and keys[0] in self.actor_network.in_keys)
            self._q_chain = _fused.linear_chain(net.net, self.qvalue_network) if ok else None
        return self._q_chain

    def cql_loss(self, tensordict: TensorDictBase):
        """The conservative term of Kumar et al. 2020 (their importance-sampled CQL(H)).

        Per state, one log-sum-exp over all ``3 * num_random`` sampled actions (uniform,
        current policy at ``s``, next-state policy), each corrected by its log-density, all
        evaluated at ``s``; minus the critic on the data's action. With
        ``conservative_term="torchrl"``, TorchRL's ``cql_loss``.
        """
        if self.conservative_term == "torchrl":
            return super().cql_loss(tensordict)
        keys = self.tensor_keys
        pred_q1 = tensordict.get(keys.pred_q1, None)
        pred_q2 = tensordict.get(keys.pred_q2, None)
        if pred_q1 is None or pred_q2 is None:
            raise KeyError("cql_loss reads the critics' predictions that q_loss writes: call q_loss first")
        n, shape = self.num_random, tensordict.shape
        batch = shape.numel()
        action = tensordict.get(keys.action)
        # random draws in TorchRL's order (uniform, current, next), so seeded runs compare
        random_actions = action.new_empty(batch * n, action.shape[-1]).uniform_(-1, 1)
        obs_td = tensordict.select(*self.actor_network.in_keys, strict=False)
        curr_td, curr_log_pi = self._get_policy_actions(obs_td.copy(), self.actor_network_params, num_actions=n)
        next_td, next_log_pi = self._get_policy_actions(
            tensordict.get("next").select(*self.actor_network.in_keys, strict=False).copy(),
            self.actor_network_params,
            num_actions=n,
        )
        # [*B[:-1], B[-1] * n] -> [prod(B) * n], each state's n draws contiguous
        curr_td, next_td = curr_td.reshape(-1), next_td.reshape(-1)
        # every sampled action is scored at the current state s (the paper's code does so for
        # the next-state policy's actions too)
        chain = self._critic_chain()
        if chain is not None:
            obs = curr_td.get(self.qvalue_network.in_keys[0])  # [batch * n, obs], each state n times
            sampled = torch.cat([random_actions, curr_td.get(keys.action), next_td.get(keys.action)], 0)
            x = torch.cat([obs.repeat(3, 1), sampled], -1)
            q_all = _fused.run_ensemble(_fused.chain_params(self.qvalue_network_params, chain), x,
                                        per_member=x.device.type == "cpu")
        else:
            q_td = torch.cat(
                [
                    curr_td.clone(False).set(keys.action, random_actions),
                    curr_td,
                    curr_td.clone(False).set(keys.action, next_td.get(keys.action)),
                ],
                0,
            ).select(*self.qvalue_network.in_keys, strict=False)
            q_all = self._vmap_qvalue_networkN0(q_td, self.qvalue_network_params).get(keys.state_action_value)
        q_random, q_curr, q_next = q_all.squeeze(-1).reshape(self.num_qvalue_nets, 3, batch, n).unbind(1)
        q_curr, q_next = self._policy_values(tensordict, q_curr, q_next)
        random_density = action.shape[-1] * math.log(0.5)
        cat_q = torch.cat(
            [
                q_random - random_density,
                q_next - next_log_pi.detach().reshape(batch, n),
                q_curr - curr_log_pi.detach().reshape(batch, n),
            ],
            -1,
        )  # [critics, batch, 3n]
        lse = torch.logsumexp(cat_q / self.temperature, dim=-1) * self.temperature
        pred = torch.stack([pred_q1, pred_q2]).reshape(self.num_qvalue_nets, batch)
        gaps = (self.min_q_weight * (lse - pred)).reshape(self.num_qvalue_nets, *shape)  # [critics, *B]
        tensordict.set(keys.cql_q1_loss, gaps[0])
        tensordict.set(keys.cql_q2_loss, gaps[1])
        loss = self._reduce_loss(gaps.sum(0), tensordict=tensordict)
        if self.with_lagrange:
            # two critics, each penalised by alpha' (gap_i - tau)
            loss = self._alpha_prime * (loss - 2 * self.target_action_gap)
        return loss, {}

    def _policy_values(self, tensordict: TensorDictBase, q_curr: torch.Tensor,
                       q_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The critics' values ``[critics, batch, num_random]`` of the current and next policy's
        actions as the log-sum-exp reads them; here unchanged (Cal-QL bounds them below)."""
        return q_curr, q_next

    def alpha_prime_loss(self, tensordict: TensorDictBase):
        if self.conservative_term == "torchrl":
            return super().alpha_prime_loss(tensordict)
        gaps = tensordict.select(self.tensor_keys.cql_q1_loss, self.tensor_keys.cql_q2_loss).detach()
        merged = tensordict.copy()
        merged.update(gaps)
        return super().alpha_prime_loss(merged)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.with_lagrange and self.reduction == "none":
            return self._per_sample_lagrange_forward(tensordict)
        return self._diagnosed_forward(tensordict)

    def _per_sample_lagrange_forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """``with_lagrange=True, reduction="none"``: the same terms as TorchRL's ``forward``, with the
        :math:`\\alpha'` loss per sample, :math:`-\\tfrac12 \\alpha' ((g_{1,i} - \\tau) + (g_{2,i} - \\tau))`,
        whose batch mean is the reduced loss. TorchRL's ``forward`` takes that mean itself and then
        cannot put the scalar into a per-sample TensorDict (its own class raises there too)."""
        self._check_batch(tensordict)
        keys = self.tensor_keys
        q_loss, metadata = self.q_loss(tensordict)
        cql_loss, _ = self.cql_loss(tensordict)
        n = tensordict.batch_size.numel()
        # TorchRL's conservative term writes [B, B] gaps ([B] minus [B, 1]): each row's mean is that sample's
        g1, g2 = (tensordict.get(k).detach().reshape(n, -1).mean(-1) for k in (keys.cql_q1_loss, keys.cql_q2_loss))
        alpha_prime = torch.clamp_max(self.log_alpha_prime.exp(), max=1e6)
        alpha_prime_loss = -0.5 * alpha_prime * ((g1 - self.target_action_gap) + (g2 - self.target_action_gap))
        loss_actor_bc, _ = self.actor_bc_loss(tensordict)
        loss_actor, actor_metadata = self.actor_loss(tensordict)
        loss_alpha, _ = self.alpha_loss(actor_metadata, mask_tensordict=tensordict)
        tensordict.set(keys.priority, metadata.pop("td_error").detach().max(0).values)
        out = TensorDict({"loss_actor": loss_actor, "loss_actor_bc": loss_actor_bc, "loss_qvalue": q_loss,
                          "loss_cql": cql_loss, "loss_alpha": loss_alpha,
                          "loss_alpha_prime": alpha_prime_loss.reshape(tensordict.batch_size)},
                         batch_size=tensordict.batch_size)
        if self.scalar_output_mode == "non_tensor":
            out.set_non_tensor("alpha", self._alpha)
            out.set_non_tensor("entropy", -actor_metadata.get(keys.log_prob).detach().mean())
        if self._emits_diagnostics():
            with torch.no_grad():
                out.update(self._diagnose(tensordict))
        return out

    def _diagnose(self, tensordict: TensorDictBase) -> dict:
        keys = self.tensor_keys
        q_data = torch.minimum(tensordict.get(keys.pred_q1), tensordict.get(keys.pred_q2)).squeeze(-1)
        out = {"q_data_mean": q_data.mean()}
        if self.min_q_weight > 0:
            gap = (tensordict.get(keys.cql_q1_loss) + tensordict.get(keys.cql_q2_loss)) / (2 * self.min_q_weight)
            out["cql_gap"] = gap.mean().detach()
        if self.with_lagrange:
            out["alpha_prime"] = self._alpha_prime
        return {**out, **self._mc_diagnostics(q_data, tensordict, None)}


def _infer_action_space(value_network):
    """The action space TorchRL would read from the network's spec, else the space a
    ``QValueActor`` was built with (``QValueActor(net, action_space="categorical")`` has no
    action spec, and TorchRL's inference raises on it); None when neither is known."""
    spec = getattr(value_network, "spec", None)
    if spec is not None:
        try:
            return _find_action_space(spec)
        except (ValueError, KeyError, TypeError):
            pass
    space = getattr(value_network, "action_space", None)
    return space if isinstance(space, str) else None


class DiscreteCQLLoss(DiagnosticsContract, _TorchRLDiscreteCQLLoss):
    r"""Discrete CQL(H) (Kumar et al. 2020) on a DQN backbone, TorchRL's loss with a weight.

    .. math::
        L = \tfrac12 E[(Q(s,a) - r - \gamma \max_{a'} \bar Q(s',a'))^2]
            + \alpha\, E[\log\sum_{a} e^{Q(s,a)} - Q(s, a_{data})]

    TorchRL's ``loss_cql`` has no weight (:math:`\alpha = 1`); ours multiplies it by
    ``alpha``, so with ``alpha=1.0`` (the default) the two agree exactly. Batches may have
    any batch shape ``[*B]``.

    Args:
        value_network: a ``QValueActor`` (reads ``observation``, writes ``action_value``,
            ``chosen_action_value`` and the greedy ``action``).

    Keyword Args:
        alpha (float): conservative weight :math:`\alpha` >= 0. Defaults to 1.0.
        action_space: ``"categorical"`` (int64 indices), ``"one-hot"``, or a spec. Defaults to
            None: read from the network's action spec, as TorchRL does, else from the space
            a ``QValueActor`` was built with.
        diagnostics (bool): add detached ``q_data_mean`` and ``cql_gap``, listed in
            ``out_keys`` after TorchRL's two (see :class:`CQLLoss`). Defaults to False.
        mc_diagnostics (bool): as :class:`CQLLoss`. Defaults to False.
        columns (DatasetColumns): as :class:`CQLLoss`. Defaults to None.
        **kwargs: passed to :class:`torchrl.objectives.DiscreteCQLLoss` (``loss_function``,
            ``delay_value``, ``reduction``).

    ``out_keys`` is TorchRL's ``["loss_qvalue", "loss_cql"]`` (then the diagnostics, when on);
    like TorchRL's, ``forward`` also returns the metadata ``td_error``, ``pred_value`` and
    ``target_value``, which a keyword call leaves out.

    Examples:
        >>> import torch
        >>> from offline_plugins.objectives.common import random_transitions
        >>> from torchrl.modules import QValueActor
        >>> from offline_plugins.modules.networks import mlp
        >>> qnet = QValueActor(mlp(3, 4, (8,)), in_keys=["observation"], action_space="categorical")
        >>> loss = DiscreteCQLLoss(qnet, alpha=2.0)
        >>> loss.action_space
        'categorical'
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = random_transitions(torch.randint(4, (5,)), obs_dim=3)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_cql', 'loss_qvalue']
        >>> loss.out_keys
        ['loss_qvalue', 'loss_cql']
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLDiscreteCQLLoss._AcceptedKeys):
        """TorchRL's discrete CQL keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        value_network,
        *,
        alpha: float = 1.0,
        action_space=None,
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
        **kwargs,
    ) -> None:
        check_range("DiscreteCQLLoss", "alpha", alpha, 0.0, None, low_inclusive=True)
        if action_space is None:
            action_space = _infer_action_space(value_network)
        self._init_diagnostics(diagnostics, mc_diagnostics)
        super().__init__(value_network, action_space=action_space, **kwargs)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self._set_out_keys()
        self._set_columns(columns)

    def _torchrl_out_keys(self) -> list:
        return ["loss_qvalue", "loss_cql"]

    def _diagnostic_keys(self) -> list:
        return ["q_data_mean", "cql_gap"]

    def cql_loss(self, tensordict: TensorDictBase):
        loss, metadata = super().cql_loss(tensordict)
        return self.alpha * loss, metadata

    def _observation_keys(self) -> list:
        return self.value_network.in_keys

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._diagnosed_forward(tensordict)

    def _diagnose(self, tensordict: TensorDictBase) -> dict:
        q_all = tensordict.get(self.tensor_keys.pred_val)
        action = tensordict.get(self.tensor_keys.action)
        if self.action_space == "categorical":
            q_data = q_all.gather(-1, action.long().reshape(*q_all.shape[:-1], 1)).squeeze(-1)
        else:
            q_data = (q_all * action.to(q_all.dtype)).sum(-1)
        out = {"q_data_mean": q_data.mean(), "cql_gap": (torch.logsumexp(q_all, -1) - q_data).mean()}
        return {**out, **self._mc_diagnostics(q_data, tensordict, None)}
