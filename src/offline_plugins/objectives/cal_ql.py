"""Cal-QL: CQL whose push-down on the policy's actions stops at the data's Monte-Carlo return.

Nakamoto, Zhai, Singh, Sobol Mark, Ma, Finn, Kumar & Levine 2023, "Cal-QL: Calibrated
Offline RL Pre-Training for Efficient Online Fine-Tuning", arXiv:2303.05479. TorchRL has no
Cal-QL; :class:`CalQLLoss` is our :class:`~offline_plugins.objectives.cql.CQLLoss` (and so
TorchRL's contract) with its conservative term bounded and one key more, ``mc_return``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey

from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import check_batch_keys
from offline_plugins.objectives.cql import CQLLoss

__all__ = ["CalQLLoss"]


class CalQLLoss(CQLLoss):
    r"""Cal-QL (Nakamoto et al. 2023, arXiv:2303.05479): CQL with a calibrated conservative term.

    In CQL's log-sum-exp, the critics' values of the current and next policy's sampled
    actions are replaced by :math:`\max(Q_i(s, a^\pi), V^\mu(s))`, where :math:`V^\mu(s)` is
    the discounted Monte-Carlo return of the behaviour data from ``s`` (``mc_return``): the
    term stops pushing a policy action's value down once it is at the data's return, so the
    learned Q stays calibrated (an upper bound of the behaviour value, a lower bound of the
    policy's). Uniform actions are not bounded, as in the paper's code (and d3rlpy's
    ``CalQL``). Everything else is :class:`~offline_plugins.objectives.cql.CQLLoss`.

    Args:
        actor_network, qvalue_network: as :class:`CQLLoss`.

    Keyword Args:
        columns (DatasetColumns): fills ``mc_return`` into batches that lack it by their
            storage ``index`` (the ``cal-ql`` algorithm builds one with
            :func:`~offline_plugins.objectives.columns.discounted_returns` at its ``gamma``).
            Defaults to None: the batch must carry ``mc_return``. As :class:`CQLLoss`'s.
        **kwargs: as :class:`CQLLoss` (``min_q_weight`` 5.0, ``num_random`` 10, ...).
            ``conservative_term="torchrl"`` is refused: the bound is defined on the paper's term.

    Reads ``mc_return`` ``[*B, 1]`` (``set_keys(mc_return=...)`` renames it); it joins
    ``in_keys``, so a keyword call passes ``mc_return=``. Its diagnostic ``calql_bound_frac``
    (with ``diagnostics=True``, after CQL's) is the fraction of the bounded policy values that
    the bound raised. With ``mc_diagnostics=True`` the Monte-Carlo pair reads the same
    ``mc_return`` as the bound.

    Examples:
        >>> import torch
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic(mc_return=torch.full((4, 1), 1e3))
        >>> loss = CalQLLoss(actor, qvalue, num_random=2, diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> float(out["calql_bound_frac"])  # a return far above Q: every policy value is raised
        1.0
        >>> "mc_return" in loss.in_keys
        True
    """

    @dataclass
    class _AcceptedKeys(CQLLoss._AcceptedKeys):
        """CQL's keys, ``mc_return`` among them (:class:`~offline_plugins.objectives.common.MCReturnKey`):
        here the bound as well as the diagnostics' return.

        Attributes:
            mc_return (NestedKey): the data's Monte-Carlo return from the state discounted at the
                loss's gamma, ``[*B, 1]``. Defaults to ``"mc_return"``.
        """

        mc_return: NestedKey = "mc_return"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(self, actor_network, qvalue_network, *, columns: Optional[DatasetColumns] = None, **kwargs) -> None:
        if kwargs.get("conservative_term", "paper") != "paper":
            raise ValueError("CalQLLoss: conservative_term must be 'paper'; the Cal-QL bound is defined on the paper's "
                             "importance-sampled term (use CQLLoss for TorchRL's)")
        super().__init__(actor_network, qvalue_network, columns=columns, **kwargs)

    def _diagnostic_keys(self) -> list:
        return [*super()._diagnostic_keys(), "calql_bound_frac"]

    @property
    def in_keys(self) -> list:
        keys = list(super().in_keys)
        if self.tensor_keys.mc_return not in keys:
            keys.append(self.tensor_keys.mc_return)
        return keys

    @in_keys.setter
    def in_keys(self, values) -> None:
        self._in_keys = values

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        super()._check_batch(tensordict)  # fills the columns first
        check_batch_keys(tensordict, [self.tensor_keys.mc_return], type(self).__name__)

    def _policy_values(self, tensordict: TensorDictBase, q_curr: torch.Tensor,
                       q_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cal-QL: the policy's values no lower than the data's return from ``s`` (``mc_return``);
        the share of them the bound raised is the ``calql_bound_frac`` diagnostic."""
        batch = q_curr.shape[1]
        bound = tensordict.get(self.tensor_keys.mc_return).to(q_curr.dtype).reshape(1, batch, 1)
        self._bound_frac = torch.cat([q_curr < bound, q_next < bound], -1).float().mean().detach()
        return torch.maximum(q_curr, bound), torch.maximum(q_next, bound)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._diagnosed_forward(tensordict)

    def _diagnose(self, tensordict: TensorDictBase) -> dict:
        out = super()._diagnose(tensordict)
        out["calql_bound_frac"] = self._bound_frac
        return out
