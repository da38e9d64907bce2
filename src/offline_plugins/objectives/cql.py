"""CQL: TorchRL's ``CQLLoss`` / ``DiscreteCQLLoss`` with the conservative term corrected.

TorchRL 0.14's continuous ``CQLLoss`` departs from Kumar et al. 2020 in its conservative
term; ours replaces that one method (``cql_loss``) and keeps the rest (Bellman term, SAC
actor and temperature) unchanged:

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
by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import CQLLoss as _TorchRLCQLLoss
from torchrl.objectives import DiscreteCQLLoss as _TorchRLDiscreteCQLLoss

from offline_plugins.objectives import _fused
from offline_plugins.objectives.common import check_batch_keys, check_range, data_q_diagnostics, transition_keys

__all__ = ["CQLLoss", "DiscreteCQLLoss"]


class CQLLoss(_TorchRLCQLLoss):
    r"""Conservative Q-Learning (Kumar et al. 2020, arXiv:2006.04779) on a SAC backbone.

    .. math::
        L_Q = L_{Bellman} + \sum_i \alpha' \left(w \left(E_s[\log \sum_a e^{Q_i(s,a)}] - E_{(s,a)\sim D}[Q_i(s,a)]\right) - \tau\right)

    with the log-sum-exp estimated, per state, by importance sampling over ``num_random``
    uniform, current-policy and next-policy actions (all scored at ``s``).
    :math:`\alpha' = 1` and :math:`\tau = 0` unless ``with_lagrange``, which learns
    :math:`\alpha'` by minimising ``loss_alpha_prime`` :math:`= -\alpha'(w \cdot \text{gap} - \tau)`.
    TorchRL's ``CQLLoss`` with :meth:`cql_loss` replaced (see the module docstring for why);
    the Bellman term, SAC actor and temperature are TorchRL's.

    Args:
        actor_network: tanh-Gaussian actor.
        qvalue_network: ``Q(s, a)``; two copies are trained.

    Keyword Args:
        min_q_weight (float): :math:`w`, the conservative weight. Defaults to 5.0 (the paper's Gym value).
        with_lagrange (bool): learn :math:`\alpha'` to hold the gap at ``lagrange_thresh``. Defaults to False.
        lagrange_thresh (float): :math:`\tau`. Defaults to 5.0.
        num_random (int): sampled actions per state for the log-sum-exp. Defaults to 10.
        loss_function (str): Bellman regression loss. Defaults to ``"l2"``.
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``/``q_data_minus_mc`` (with
            ``return_to_go``), ``cql_gap`` (log-sum-exp Q minus data Q, per critic, averaged) and
            ``alpha_prime``. Free: it reads what the loss computed. Defaults to True.
        **kwargs: passed to :class:`torchrl.objectives.CQLLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import Bounded
        >>> from offline_plugins.modules.networks import make_tanh_gaussian_actor, make_qvalue
        >>> spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        >>> loss = CQLLoss(make_tanh_gaussian_actor(3, spec, (8,)), make_qvalue(3, 2, (8,)),
        ...                with_lagrange=True, num_random=2)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = TensorDict({"observation": torch.randn(4, 3), "action": spec.rand((4,)),
        ...     ("next", "observation"): torch.randn(4, 3), ("next", "reward"): torch.randn(4, 1),
        ...     ("next", "done"): torch.zeros(4, 1, dtype=torch.bool),
        ...     ("next", "terminated"): torch.zeros(4, 1, dtype=torch.bool)}, [4])
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_actor_bc', 'loss_alpha', 'loss_alpha_prime', 'loss_cql', 'loss_qvalue']
        >>> "cql_gap" in out.keys()
        True
    """

    @dataclass
    class _AcceptedKeys(_TorchRLCQLLoss._AcceptedKeys):
        """TorchRL's CQL keys, plus ``return_to_go`` (defaults to ``"return_to_go"``): the data's
        Monte-Carlo discounted return, read only for diagnostics."""

        return_to_go: NestedKey = "return_to_go"

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
        diagnostics: bool = True,
        **kwargs,
    ) -> None:
        check_range("CQLLoss", "min_q_weight", min_q_weight, 0.0, None)
        check_range("CQLLoss", "num_random", num_random, 1, None, low_inclusive=True)
        check_range("CQLLoss", "temperature", kwargs.get("temperature", 1.0), 0.0, None)
        self.diagnostics = diagnostics
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
            from offline_plugins.modules.networks import QValueNet

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
        evaluated at ``s``; minus the critic on the data's action.
        """
        keys = self.tensor_keys
        pred_q1 = tensordict.get(keys.pred_q1)
        pred_q2 = tensordict.get(keys.pred_q2)
        if pred_q1 is None or pred_q2 is None:
            raise KeyError("cql_loss reads the critics' predictions that q_loss writes: call q_loss first")
        n, batch = self.num_random, tensordict.shape[-1]
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
        pred = torch.stack([pred_q1, pred_q2]).squeeze(-1)
        gaps = self.min_q_weight * (lse - pred)  # [critics, batch]
        tensordict.set(keys.cql_q1_loss, gaps[0])
        tensordict.set(keys.cql_q2_loss, gaps[1])
        loss = self._reduce_loss(gaps.sum(0), tensordict=tensordict)
        if self.with_lagrange:
            # two critics, each penalised by alpha' (gap_i - tau)
            loss = self._alpha_prime * (loss - 2 * self.target_action_gap)
        return loss, {}

    def alpha_prime_loss(self, tensordict: TensorDictBase):
        gaps = tensordict.select(self.tensor_keys.cql_q1_loss, self.tensor_keys.cql_q2_loss).detach()
        merged = tensordict.copy()
        merged.update(gaps)
        return super().alpha_prime_loss(merged)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        keys = self.tensor_keys
        check_batch_keys(tensordict, transition_keys(self.actor_network.in_keys, keys), "CQLLoss")
        out = super().forward(tensordict)
        if self.diagnostics and self.reduction != "none":
            with torch.no_grad():
                q1 = tensordict.get(keys.pred_q1).squeeze(-1)
                q2 = tensordict.get(keys.pred_q2).squeeze(-1)
                out.update(data_q_diagnostics(torch.minimum(q1, q2), tensordict, keys.return_to_go))
                gap = (tensordict.get(keys.cql_q1_loss) + tensordict.get(keys.cql_q2_loss)) / (2 * self.min_q_weight)
                out.set("cql_gap", gap.mean().detach())
                if self.with_lagrange:
                    out.set("alpha_prime", self._alpha_prime)
        return out


class DiscreteCQLLoss(_TorchRLDiscreteCQLLoss):
    r"""Discrete CQL(H) (Kumar et al. 2020) on a DQN backbone, TorchRL's loss with a weight.

    .. math::
        L = \tfrac12 E[(Q(s,a) - r - \gamma \max_{a'} \bar Q(s',a'))^2]
            + \alpha\, E[\log\sum_{a} e^{Q(s,a)} - Q(s, a_{data})]

    TorchRL's ``loss_cql`` has no weight (:math:`\alpha = 1`); ours multiplies it by
    ``alpha``, so with ``alpha=1.0`` the two agree exactly. Actions are int64
    indices (``action_space="categorical"``).

    Args:
        value_network: a ``QValueActor`` (reads ``observation``, writes ``action_value``,
            ``chosen_action_value`` and the greedy ``action``).

    Keyword Args:
        alpha (float): conservative weight :math:`\alpha` > 0. Defaults to 1.0.
        action_space: ``"categorical"`` (default) or ``"one-hot"``.
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``/``q_data_minus_mc`` and
            ``cql_gap``. Defaults to True.
        **kwargs: passed to :class:`torchrl.objectives.DiscreteCQLLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.modules import QValueActor
        >>> from offline_plugins.modules.networks import mlp
        >>> qnet = QValueActor(mlp(3, 4, (8,)), in_keys=["observation"], action_space="categorical")
        >>> loss = DiscreteCQLLoss(qnet, alpha=2.0)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = TensorDict({"observation": torch.randn(5, 3), "action": torch.randint(4, (5,)),
        ...     ("next", "observation"): torch.randn(5, 3), ("next", "reward"): torch.randn(5, 1),
        ...     ("next", "done"): torch.zeros(5, 1, dtype=torch.bool),
        ...     ("next", "terminated"): torch.zeros(5, 1, dtype=torch.bool)}, [5])
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_cql', 'loss_qvalue']
    """

    @dataclass
    class _AcceptedKeys(_TorchRLDiscreteCQLLoss._AcceptedKeys):
        """TorchRL's discrete CQL keys, plus ``return_to_go`` (defaults to ``"return_to_go"``)."""

        return_to_go: NestedKey = "return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        value_network,
        *,
        alpha: float = 1.0,
        action_space="categorical",
        diagnostics: bool = True,
        **kwargs,
    ) -> None:
        check_range("DiscreteCQLLoss", "alpha", alpha, 0.0, None, low_inclusive=True)
        super().__init__(value_network, action_space=action_space, **kwargs)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.diagnostics = diagnostics

    def cql_loss(self, tensordict: TensorDictBase):
        loss, metadata = super().cql_loss(tensordict)
        return self.alpha * loss, metadata

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        keys = self.tensor_keys
        check_batch_keys(tensordict, transition_keys(self.value_network.in_keys, keys), "DiscreteCQLLoss")
        loss_qvalue, metadata = self.value_loss(tensordict)
        loss_cql, _ = self.cql_loss(tensordict)
        out = TensorDict({"loss_qvalue": loss_qvalue, "loss_cql": loss_cql, **metadata}, batch_size=[])
        if self.diagnostics and self.reduction != "none":
            with torch.no_grad():
                q_all = tensordict.get(keys.pred_val)
                action = tensordict.get(keys.action)
                if self.action_space == "categorical":
                    q_data = q_all.gather(-1, action.long().reshape(*q_all.shape[:-1], 1)).squeeze(-1)
                else:
                    q_data = (q_all * action.to(q_all.dtype)).sum(-1)
                out.update(data_q_diagnostics(q_data, tensordict, keys.return_to_go))
                out.set("cql_gap", (torch.logsumexp(q_all, -1) - q_data).mean())
        return out
