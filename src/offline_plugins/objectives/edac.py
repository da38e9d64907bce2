"""SAC-N and EDAC: SAC with a large critic ensemble, and EDAC's gradient-diversity term.

An, Moon, Kim & Song 2021, "Uncertainty-Based Offline Reinforcement Learning with
Diversified Q-Ensemble", arXiv:2110.01548. SAC-N is TorchRL's ``SACLoss`` with
``num_qvalue_nets=N``: its N critics are one set of stacked parameters run by ``torch.vmap``
(TorchRL's ``_vmap_qnetworkN0``), and both the actor and the target take the ensemble's
minimum, as the paper's SAC-N. TorchRL has no EDAC; :class:`EDACLoss` is :class:`SACNLoss`
with one more term, ``loss_diversity``.

Differences from TorchRL's ``SACLoss`` (each restored by an argument):

==========================  ===========================================  ==========================
what                        ours                                         TorchRL's
==========================  ===========================================  ==========================
``num_qvalue_nets``         10 (the paper's and CORL's N)                ``num_qvalue_nets=2``
``loss_function``           ``"l2"`` (the paper's MSE)                   ``loss_function="smooth_l1"``
==========================  ===========================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.objectives import SACLoss as _TorchRLSACLoss
from torchrl.objectives.utils import _vmap_func, distance_loss

from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import DiagnosticsContract, MCReturnKey, check_range

__all__ = ["SACNLoss", "EDACLoss", "diversity_penalty"]


def diversity_penalty(grads: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    r"""EDAC's ensemble similarity per sample, from the critics' action gradients.

    ``grads`` ``[N, *B, A]``: :math:`g_i = \nabla_a Q_i(s, a)`. Returns ``[*B]``:

    .. math::
        \frac{1}{N - 1} \sum_{i \ne j} \langle \hat g_i, \hat g_j \rangle,
        \quad \hat g_i = g_i / (\lVert g_i \rVert + \epsilon)

    (An et al. 2021; CORL's ``edac.py`` normalises by :math:`N - 1` and uses the same :math:`\epsilon`).

    >>> g = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])  # N=3, B=1, A=2
    >>> diversity_penalty(g)  # pairs (0,1) and (1,0) are aligned: 2 / (3 - 1)
    tensor([1.])
    """
    n = grads.shape[0]
    if n < 2:
        raise ValueError(f"diversity_penalty: needs at least 2 critics, got {n}")
    unit = grads / (grads.norm(dim=-1, keepdim=True) + eps)
    total = unit.sum(0)  # sum_i g_i
    # sum_{i != j} <g_i, g_j> = |sum_i g_i|^2 - sum_i |g_i|^2: O(N) instead of the N x N Gram matrix
    return (total.pow(2).sum(-1) - unit.pow(2).sum(-1).sum(0)) / (n - 1)


class SACNLoss(DiagnosticsContract, _TorchRLSACLoss):
    r"""SAC-N (An et al. 2021, arXiv:2110.01548): SAC with N critics and the ensemble minimum.

    .. math::
        L_Q = \sum_{i=1}^N E\big[(Q_i(s, a) - r - \gamma (1 - d)
              (\min_j \bar Q_j(s', a') - \alpha \log \pi(a'|s')))^2\big],\quad a' \sim \pi(s')

    .. math::
        L_\pi = E[\alpha \log \pi(\tilde a|s) - \min_j Q_j(s, \tilde a)],\quad \tilde a \sim \pi(s)

    and SAC's temperature loss. The terms are TorchRL's (``actor_loss``, ``_compute_target_v2``,
    ``_alpha_loss``); the critic term runs the ensemble on per-critic copies of the batch
    (``_vmap_qnetwork00``) so that a subclass can differentiate each critic with respect to its
    own copy of the action (:class:`EDACLoss`).

    Args:
        actor_network: a tanh-Gaussian ``ProbabilisticActor``.
        qvalue_network: ``Q(s, a)``; ``num_qvalue_nets`` copies with independent initial weights.

    Keyword Args:
        num_qvalue_nets (int): N >= 2. Defaults to 10 (CORL's ``sac_n.py`` and ``edac.py``).
        loss_function (str): critic regression loss. Defaults to ``"l2"``.
        diagnostics (bool): add ``q_data_mean`` (the ensemble minimum on the data's actions) and
            ``q_data_std`` (the ensemble's standard deviation there, averaged: the uncertainty the
            minimum penalises), listed in ``out_keys`` after TorchRL's. Defaults to False.
        mc_diagnostics (bool): with ``diagnostics``, the Monte-Carlo pair ``mc_return_mean`` (the
            batch's ``mc_return``: the data's Monte-Carlo return discounted at the loss's gamma)
            and ``q_data_minus_mc`` (see
            :class:`~offline_plugins.objectives.common.DiagnosticsContract`). Defaults to False.
        columns (DatasetColumns): fills the columns it holds (``mc_return``) into batches that
            lack them, by their storage ``index``, before the batch's keys are checked
            (:mod:`offline_plugins.objectives.columns`). Defaults to None.
        **kwargs: passed to :class:`torchrl.objectives.SACLoss` (``alpha_init``,
            ``target_entropy``, ``action_spec``, ``reduction``...). SAC v1 (a value network)
            is not supported.

    Examples:
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic()
        >>> loss = SACNLoss(actor, qvalue, num_qvalue_nets=5, diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_alpha', 'loss_qvalue']
        >>> loss.out_keys
        ['loss_actor', 'loss_qvalue', 'loss_alpha', 'alpha', 'entropy', 'q_data_mean', 'q_data_std']
        >>> loss.qvalue_network_params["module", "net", "0", "weight"].shape  # one stacked ensemble
        torch.Size([5, 8, 5])
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLSACLoss._AcceptedKeys):
        """TorchRL's SAC keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        qvalue_network,
        *,
        num_qvalue_nets: int = 10,
        loss_function: str = "l2",
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
        **kwargs,
    ) -> None:
        check_range(type(self).__name__, "num_qvalue_nets", num_qvalue_nets, 2, None, low_inclusive=True)
        if kwargs.get("value_network") is not None:
            raise ValueError(f"{type(self).__name__}: SAC v1 (a value_network) is not supported; drop value_network")
        self._init_diagnostics(diagnostics, mc_diagnostics)
        super().__init__(actor_network, qvalue_network, num_qvalue_nets=int(num_qvalue_nets),
                         loss_function=loss_function, **kwargs)
        self._set_out_keys()
        self._set_columns(columns)

    def _make_vmap(self):
        super()._make_vmap()
        # per-critic inputs (TorchRL builds this one only for SAC v1)
        self._vmap_qnetwork00 = _vmap_func(self.qvalue_network, randomness=self.vmap_randomness,
                                           pseudo_vmap=self.deactivate_vmap)

    def _torchrl_out_keys(self) -> list:
        keys = ["loss_actor", "loss_qvalue", "loss_alpha"]
        if self.reduction != "none" or self.scalar_output_mode == "non_tensor":
            keys += ["alpha", "entropy"]
        return keys + self._extra_loss_keys()

    def _extra_loss_keys(self) -> list:
        """Loss terms a subclass adds after TorchRL's (EDAC: ``loss_diversity``)."""
        return []

    def _diagnostic_keys(self) -> list:
        return ["q_data_mean", "q_data_std"]

    def _observation_keys(self) -> list:
        return self.actor_network.in_keys

    def _data_q(self, tensordict: TensorDictBase, action: torch.Tensor) -> torch.Tensor:
        """``[N, *B]`` critic values of the batch's states at ``action`` ``[N, *B, A]`` (one copy per critic)."""
        td = tensordict.select(*self.qvalue_network.in_keys, strict=False).expand(
            self.num_qvalue_nets, *tensordict.batch_size).clone(False)
        td.set(self.tensor_keys.action, action)
        return self._vmap_qnetwork00(td, self.qvalue_network_params).get(self.tensor_keys.state_action_value).squeeze(-1)

    def _critic_terms(self, tensordict: TensorDictBase, target: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The critic's ``loss_*`` terms, unreduced ``[*B]``, and the ensemble's data values ``[N, *B]``."""
        action = tensordict.get(self.tensor_keys.action)
        q = self._data_q(tensordict, action.expand(self.num_qvalue_nets, *action.shape))
        loss = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0)
        return {"loss_qvalue": loss}, q

    def qvalue_loss(self, tensordict: TensorDictBase):
        """The critic terms, reduced, and ``td_error`` and ``pred_value``."""
        weights = self._maybe_get_priority_weight(tensordict)
        target = self._compute_target_v2(tensordict)
        terms, q = self._critic_terms(tensordict, target)
        terms = {k: self._reduce_loss(v, tensordict=tensordict, weights=weights) for k, v in terms.items()}
        return terms, {"td_error": (q.detach() - target).abs().max(0).values, "pred_value": q.detach()}

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._check_batch(tensordict)
        critic_terms, metadata = self.qvalue_loss(tensordict)
        loss_actor, metadata_actor = self.actor_loss(tensordict)
        weights = self._maybe_get_priority_weight(tensordict)
        loss_alpha = self._reduce_loss(self._alpha_loss(log_prob=metadata_actor["log_prob"]), tensordict=tensordict,
                                       weights=weights)
        tensordict.set(self.tensor_keys.priority, metadata["td_error"])
        terms = {"loss_actor": loss_actor, "loss_qvalue": critic_terms.pop("loss_qvalue"), "loss_alpha": loss_alpha}
        entropy = -metadata_actor["log_prob"]
        if self.reduction == "none":
            out = TensorDict({**terms, **critic_terms}, batch_size=tensordict.batch_size)
            if self.scalar_output_mode == "non_tensor":
                out.set_non_tensor("alpha", self._alpha)
                out.set_non_tensor("entropy", entropy.detach().mean())
        else:
            out = TensorDict({**terms, "alpha": self._alpha, "entropy": entropy.detach().mean(), **critic_terms})
        if self._emits_diagnostics():
            out.update(self._q_diagnostics(metadata["pred_value"], tensordict))
        return out

    @torch.no_grad()
    def _q_diagnostics(self, pred_value: torch.Tensor, tensordict: TensorDictBase) -> dict:
        q_min, q_std = pred_value.min(0).values, pred_value.std(0)
        valid = self._counted_positions(tensordict, q_min)
        if valid is not None:
            q_min, q_std = q_min[valid], q_std[valid]
        return {"q_data_mean": q_min.mean(), "q_data_std": q_std.mean(),
                **self._mc_diagnostics(q_min, tensordict, valid)}


class EDACLoss(SACNLoss):
    r"""EDAC (An et al. 2021, arXiv:2110.01548): SAC-N plus the ensemble gradient-diversity term.

    .. math::
        L_{div} = \eta\, E_{(s,a) \sim D}\Big[\frac{1}{N-1} \sum_{i \ne j}
                  \langle \hat g_i, \hat g_j \rangle\Big],\quad
        \hat g_i = \frac{\nabla_a Q_i(s, a)}{\lVert \nabla_a Q_i(s, a) \rVert + \epsilon}

    returned as its own term ``loss_diversity`` (listed after TorchRL's keys), which the
    critics minimise with ``loss_qvalue``. Each critic is differentiated with respect to its
    own copy of the data's action, in the same vmapped forward that gives ``loss_qvalue``.

    Keyword Args:
        eta (float): :math:`\eta` >= 0. Defaults to 1.0 (CORL's ``edac.py``, and its Hopper config).
        **kwargs: as :class:`SACNLoss`.

    Examples:
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic()
        >>> loss = EDACLoss(actor, qvalue, num_qvalue_nets=4)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_alpha', 'loss_diversity', 'loss_qvalue']
    """

    def __init__(self, actor_network, qvalue_network, *, eta: float = 1.0, **kwargs) -> None:
        check_range("EDACLoss", "eta", eta, 0.0, None, low_inclusive=True)
        super().__init__(actor_network, qvalue_network, **kwargs)
        self.register_buffer("eta", torch.tensor(float(eta)))

    def _extra_loss_keys(self) -> list:
        return ["loss_diversity"]

    def _q_and_grads(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """The ensemble's values ``[N, *B]`` on the data's action and their action gradients
        ``[N, *B, A]`` (a graph through both, for the critics' update)."""
        action = tensordict.get(self.tensor_keys.action)
        copies = action.detach().expand(self.num_qvalue_nets, *action.shape).clone().requires_grad_(True)
        with torch.enable_grad():
            q = self._data_q(tensordict, copies)
            grads, = torch.autograd.grad(q.sum(), copies, create_graph=True)
        return q, grads

    def _critic_terms(self, tensordict: TensorDictBase, target: torch.Tensor) -> tuple[dict, torch.Tensor]:
        q, grads = self._q_and_grads(tensordict)
        loss = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0)
        return {"loss_qvalue": loss, "loss_diversity": self.eta * diversity_penalty(grads)}, q

    def diversity_loss(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``loss_diversity`` alone, reduced (:math:`\\eta` included)."""
        _, grads = self._q_and_grads(tensordict)
        return self._reduce_loss(self.eta * diversity_penalty(grads), tensordict=tensordict)
