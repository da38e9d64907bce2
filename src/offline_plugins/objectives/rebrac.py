"""ReBRAC: TD3+BC with a behaviour penalty in the actor and in the critic's target.

TorchRL has no ReBRAC; ours is a subclass of our :class:`~offline_plugins.objectives.td3_bc.TD3BCLoss`
that replaces its two terms (``actor_loss``, ``qvalue_loss``) and keeps the rest of its
contract (keys, ``out_keys``, value estimators, reductions, ``[*B]`` batches, keyword calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.envs.utils import step_mdp
from torchrl.objectives.utils import distance_loss

from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import check_batch_keys, check_range
from offline_plugins.objectives.td3_bc import TD3BCLoss

__all__ = ["ReBRACLoss"]


class ReBRACLoss(TD3BCLoss):
    r"""ReBRAC (Tarasov, Kurenkov, Nikulin & Kolesnikov 2023, arXiv:2305.09836).

    .. math::
        L_\pi = E\big[\beta_1 \lVert \mu(s) - a \rVert^2 - \lambda \min_i Q_i(s, \mu(s))\big],
        \quad \lambda = 1 / E|\min_i Q_i(s, \mu(s))|

    .. math::
        y = r + \gamma (1 - d) \big(\min_i \bar Q_i(s', \tilde a') - \beta_2 \lVert \tilde a' - a'\rVert^2\big),
        \quad \tilde a' = \mathrm{clip}(\bar\mu(s') + \epsilon)

    where :math:`a'` is the data's action at the next step (``("next", "action")``), and
    the critics regress on :math:`y` (squared error summed over the ensemble, as CORL's
    ``rebrac.py``). The penalties are taken on actions rescaled to ``[-1, 1]`` (divided by
    the spec's half range), the space the paper's :math:`\beta` values were tuned in.
    Where the batch's next action is NaN (the data has none: the episode ended) the critic
    penalty is 0.

    Args:
        actor_network: deterministic actor writing ``"action"``.
        qvalue_network: ``Q(s, a)`` (the paper's has LayerNorm:
            :func:`~offline_plugins.modules.networks.make_layer_norm_qvalue`).

    Keyword Args:
        action_spec: the ``Bounded`` action spec.
        actor_bc_coef (float): :math:`\beta_1` >= 0. Defaults to 1.0 (CORL's ``rebrac.py``;
            the paper tunes it per dataset, e.g. 0.01 on hopper-medium).
        critic_bc_coef (float): :math:`\beta_2` >= 0. Defaults to 1.0 (the same).
        normalize_q (bool): divide the Q term by :math:`E|Q|` (:math:`\lambda`); else
            :math:`\lambda = 1`. Defaults to True.
        policy_noise, noise_clip (float): target smoothing, in action units. Default to 0.2, 0.5.
        loss_function (str): critic regression loss. Defaults to ``"l2"``.
        columns (DatasetColumns): fills ``("next", "action")`` (and, for ``mc_diagnostics``,
            ``mc_return``) into batches that lack them, by their storage ``index``
            (:mod:`offline_plugins.objectives.columns`); the ``rebrac`` algorithm passes one
            built from the dataset. Defaults to None: the batch must carry the keys.
        diagnostics, mc_diagnostics (bool): as :class:`TD3BCLoss`.
        **kwargs: passed to :class:`TD3BCLoss` (``num_qvalue_nets``, ``reduction``...).

    ``out_keys`` are TD3+BC's: ``bc_loss`` is the mean actor penalty and ``lmbd`` is
    :math:`\lambda`. The actor's weight ``alpha`` of TD3+BC is not used.

    Examples:
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic("deterministic", layer_norm=True)
        >>> loss = ReBRACLoss(actor, qvalue, action_spec=spec, diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch["next", "action"] = spec.rand((4,))
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue']
        >>> ("next", "action") in loss.in_keys
        True
        >>> loss.loss_terms(batch, ["loss_qvalue"]).get("loss_actor", None) is None  # critic-only step
        True
    """

    @dataclass
    class _AcceptedKeys(TD3BCLoss._AcceptedKeys):
        """TD3+BC's keys; the data's next action is read at ``("next", action)``."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        qvalue_network,
        *,
        action_spec=None,
        actor_bc_coef: float = 1.0,
        critic_bc_coef: float = 1.0,
        normalize_q: bool = True,
        policy_noise: float = 0.2,
        noise_clip: float = 0.5,
        loss_function: str = "l2",
        columns: Optional[DatasetColumns] = None,
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        **kwargs,
    ) -> None:
        check_range("ReBRACLoss", "actor_bc_coef", actor_bc_coef, 0.0, None, low_inclusive=True)
        check_range("ReBRACLoss", "critic_bc_coef", critic_bc_coef, 0.0, None, low_inclusive=True)
        super().__init__(
            actor_network,
            qvalue_network,
            action_spec=action_spec,
            policy_noise=policy_noise,
            noise_clip=noise_clip,
            loss_function=loss_function,
            diagnostics=diagnostics,
            mc_diagnostics=mc_diagnostics,
            columns=columns,
            fused=False,
            **kwargs,
        )
        self.register_buffer("actor_bc_coef", torch.tensor(float(actor_bc_coef)))
        self.register_buffer("critic_bc_coef", torch.tensor(float(critic_bc_coef)))
        self.register_buffer("action_scale", ((self.max_action - self.min_action) / 2).clamp_min(1e-6))
        self.normalize_q = bool(normalize_q)

    def _set_in_keys(self):
        super()._set_in_keys()
        next_action = ("next", self.tensor_keys.action)
        if next_action not in self._in_keys:
            self._in_keys.append(next_action)

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        super()._check_batch(tensordict)  # fills the columns first
        check_batch_keys(tensordict, [("next", self.tensor_keys.action)], type(self).__name__)

    def _penalty(self, action: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Squared distance summed over the action's last dim, in ``[-1, 1]`` units."""
        return ((action - reference) / self.action_scale).pow(2).sum(-1)

    def _ensemble_q(self, td: TensorDictBase, params) -> torch.Tensor:
        """``[num_qvalue_nets, *B]`` values of ``td``'s action under each critic."""
        expanded = td.select(*self.qvalue_network.in_keys, strict=False).expand(self.num_qvalue_nets, *td.batch_size)
        return self._vmap_qvalue_network00(expanded, params).get(self.tensor_keys.state_action_value).squeeze(-1)

    def actor_loss(self, tensordict: TensorDictBase):
        """:math:`\\beta_1` times the actor's distance to the data's action, minus :math:`\\lambda` times the ensemble minimum."""
        keys = self.tensor_keys
        weights = self._maybe_get_priority_weight(tensordict)
        td_actor = tensordict.select(*self.actor_network.in_keys, strict=False)
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            td_actor = self.actor_network(td_actor)
        q_pi = self._ensemble_q(td_actor, self._cached_detach_qvalue_network_params).min(0).values
        penalty = self._penalty(td_actor.get(keys.action), tensordict.get(keys.action))
        lmbd = 1.0 / q_pi.abs().mean().detach().clamp_min(1e-6) if self.normalize_q else torch.ones_like(q_pi[..., 0].mean())
        loss = self._reduce_loss(self.actor_bc_coef * penalty - lmbd * q_pi, tensordict=tensordict, weights=weights)
        return loss, {"state_action_value_actor": q_pi.detach(), "bc_loss": penalty.mean().detach(), "lmbd": lmbd}

    def qvalue_loss(self, tensordict: TensorDictBase):
        """TD3's clipped double-Q regression on a target that subtracts :math:`\\beta_2` times the
        target policy's distance to the data's next action."""
        keys = self.tensor_keys
        weights = self._maybe_get_priority_weight(tensordict)
        tensordict = tensordict.clone(False)
        action = tensordict.get(keys.action)
        noise = (torch.randn_like(action) * self.policy_noise).clamp(-self.noise_clip, self.noise_clip)
        with torch.no_grad():
            next_td = step_mdp(tensordict).select(*self.actor_network.in_keys, strict=False)
            with self.target_actor_network_params.to_module(self.actor_network, preserve_module_state=False):
                next_td = self.actor_network(next_td)
            next_action = (next_td.get(keys.action) + noise).clamp(self.min_action, self.max_action)
            next_td.set(keys.action, next_action)
            q_next = self._ensemble_q(next_td, self.target_qvalue_network_params).min(0).values
            penalty = self._penalty(next_action, tensordict.get(("next", keys.action)))
            penalty = torch.where(torch.isnan(penalty), torch.zeros_like(penalty), penalty)
            next_value = q_next - self.critic_bc_coef * penalty
            tensordict.set(("next", keys.state_action_value), next_value.unsqueeze(-1))
            target = self.value_estimator.value_estimate(tensordict).squeeze(-1)
        q = self._ensemble_q(tensordict, self.qvalue_network_params)
        loss = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0)
        loss = self._reduce_loss(loss, tensordict=tensordict, weights=weights)
        return loss, {
            "td_error": (q - target).pow(2),
            "next_state_value": next_value,
            "pred_value": q.detach(),
            "target_value": target,
        }

    def _forward(self, tensordict: TensorDictBase, actor: bool) -> TensorDictBase:
        self._check_batch(tensordict)
        loss_qvalue, metadata = self.qvalue_loss(tensordict)
        tensordict.set(self.tensor_keys.priority, metadata.pop("td_error").detach().max(0)[0])
        terms = {"loss_qvalue": loss_qvalue, **metadata}
        if actor:  # a critic-only step (``loss_terms`` without loss_actor) skips the actor's forward
            loss_actor, metadata_actor = self.actor_loss(tensordict)
            terms = {"loss_actor": loss_actor, **terms, **metadata_actor}
        out = TensorDict(terms)
        if self._emits_diagnostics():
            out.update(self._q_diagnostics(out.get("pred_value"), tensordict))
        return out

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._forward(tensordict, actor=True)
