"""TD3+BC: TorchRL's ``TD3BCLoss`` with input checks and the over-estimation diagnostic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.objectives import TD3BCLoss as _TorchRLTD3BCLoss
from torchrl.objectives.utils import distance_loss

from offline_plugins.modules.networks import QValueNet, ScaledTanh
from offline_plugins.objectives import _fused
from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import DiagnosticsContract, MCReturnKey, check_range

__all__ = ["TD3BCLoss"]

#: what TorchRL's ``TD3BCLoss.forward`` returns, in the order of its ``out_keys``
_TORCHRL_OUT_KEYS = (
    "loss_actor",
    "loss_qvalue",
    "bc_loss",
    "lmbd",
    "pred_value",
    "state_action_value_actor",
    "next_state_value",
    "target_value",
)



def _squash(squash, x: torch.Tensor) -> torch.Tensor:
    """The actor's ``ScaledTanh`` with its bounds where ``x`` is (a copy of the loss moved by ``.to()`` keeps
    the module its plan cached, whose bounds stay behind)."""
    return squash.center.to(x.device) + squash.half_range.to(x.device) * torch.tanh(x)

class TD3BCLoss(_fused.FusedPath, DiagnosticsContract, _TorchRLTD3BCLoss):
    r"""TD3+BC (Fujimoto & Gu 2021, arXiv:2106.06860), TorchRL's loss with diagnostics.

    .. math::
        L_\pi = -\lambda\, E[Q_1(s, \mu(s))] + E[(\mu(s) - a)^2],\quad
        \lambda = \alpha / E|Q_1(s, \mu(s))|

    and TD3's clipped double-Q critic with target-policy smoothing. The loss terms are
    TorchRL's, unchanged; the actor is meant to step every ``policy_freq`` = 2 critic steps.

    Args:
        actor_network: deterministic actor writing ``"action"``.
        qvalue_network: ``Q(s, a)``; ``num_qvalue_nets`` copies are trained.

    Keyword Args:
        action_spec: the ``Bounded`` action spec (clips the smoothed target action).
        alpha (float): :math:`\alpha` >= 0, as TorchRL accepts (0 leaves the actor pure behaviour
            cloning while the critic still trains). Defaults to 2.5.
        policy_noise (float): target smoothing noise std, in action units. Defaults to 0.2.
        noise_clip (float): its clip. Defaults to 0.5.
        loss_function (str): critic regression loss. Defaults to ``"l2"`` (the paper's).
        diagnostics (bool): add ``q_data_mean``, the ensemble minimum on the data's actions,
            detached and averaged over the positions the loss counts (a collector or padding
            mask excludes the rest), listed in ``out_keys`` after TorchRL's. Off by default so
            that ``out_keys``, ``in_keys`` and what a keyword call returns are TorchRL's; the
            ``td3-bc`` algorithm turns them on (they are free: they read the critic's
            prediction on the data). Defaults to False.
        mc_diagnostics (bool): with ``diagnostics``, also ``mc_return_mean`` (the batch's
            ``mc_return``: the data's Monte-Carlo return discounted at the loss's gamma, the
            quantity Q estimates) and ``q_data_minus_mc`` (``q_data_mean`` minus it): the
            over-estimation the paper's constraint exists to stop. Listed last; ``mc_return``
            joins ``in_keys`` (a keyword call passes ``mc_return=`` and gets all eleven values),
            and a batch without it (after ``columns``) raises
            :class:`~offline_plugins.objectives.common.MissingBatchKeyError`. Defaults to False.
        columns (DatasetColumns): fills the columns it holds into batches that lack them, by
            their storage ``index``, before the batch's keys are checked
            (:mod:`offline_plugins.objectives.columns`; the ``td3-bc`` algorithm passes
            ``mc_return`` from :func:`~offline_plugins.objectives.columns.discounted_returns` at
            its ``gamma``). Defaults to None: the batch carries what the loss reads.
        fused (bool): compute both terms straight from the parameters (the ensemble as one
            batched matmul per layer, only the first critic for the actor term) where that is
            exactly TorchRL's computation: the networks are the plain MLPs of
            :mod:`offline_plugins.modules.networks`, the value estimator is TorchRL's plain
            TD(0) (any ``gamma``), ``actor_loss``/``qvalue_loss`` are not overridden and the
            batch has no loss mask or priority weights. Otherwise (TD(1), TD(lambda), a
            subclass's own ``qvalue_loss``, ...; checked on every call, so a later
            ``make_value_estimator`` counts) TorchRL's code runs. Same values and random draws
            as TorchRL's either way (tested). Defaults to True.
        **kwargs: passed to :class:`torchrl.objectives.TD3BCLoss`.

    Examples:
        >>> import torch
        >>> from offline_plugins.objectives.common import toy_actor_critic
        >>> actor, qvalue, spec, batch = toy_actor_critic("deterministic", mc_return=torch.randn(4, 1))
        >>> loss = TD3BCLoss(actor, qvalue, action_spec=spec, diagnostics=True, mc_diagnostics=True)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue']
        >>> loss.out_keys[-3:]
        ['q_data_mean', 'mc_return_mean', 'q_data_minus_mc']
        >>> set(out.keys()) == set(loss.out_keys)
        True
        >>> sorted(k for k in loss.loss_terms(batch, ["loss_qvalue"]).keys() if k.startswith("loss_"))
        ['loss_qvalue']
    """

    @dataclass
    class _AcceptedKeys(MCReturnKey, _TorchRLTD3BCLoss._AcceptedKeys):
        """TorchRL's TD3+BC keys, then ``mc_return`` (:class:`~offline_plugins.objectives.common.MCReturnKey`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    _unreduced_output_is_batched = False  # TorchRL's output has batch size [] under any reduction
    _fused_torchrl = _TorchRLTD3BCLoss
    _fused_methods = ("actor_loss", "qvalue_loss")

    def __init__(
        self,
        actor_network,
        qvalue_network,
        *,
        action_spec=None,
        alpha: float = 2.5,
        policy_noise: float = 0.2,
        noise_clip: float = 0.5,
        loss_function: str = "l2",
        diagnostics: bool = False,
        mc_diagnostics: bool = False,
        columns: Optional[DatasetColumns] = None,
        fused: bool = True,
        **kwargs,
    ) -> None:
        check_range("TD3BCLoss", "alpha", alpha, 0.0, None, low_inclusive=True)
        check_range("TD3BCLoss", "policy_noise", policy_noise, 0.0, None, low_inclusive=True)
        check_range("TD3BCLoss", "noise_clip", noise_clip, 0.0, None, low_inclusive=True)
        self._init_diagnostics(diagnostics, mc_diagnostics)
        super().__init__(
            actor_network,
            qvalue_network,
            action_spec=action_spec,
            alpha=alpha,
            policy_noise=policy_noise,
            noise_clip=noise_clip,
            loss_function=loss_function,
            **kwargs,
        )
        self._set_out_keys()
        self._set_columns(columns)
        self._init_fused(fused)

    def _torchrl_out_keys(self) -> list:
        return list(_TORCHRL_OUT_KEYS)

    def _diagnostic_keys(self) -> list:
        return ["q_data_mean"]

    def _fused_value(self) -> tuple:
        return None, self.tensor_keys.state_action_value

    def _fused_plan(self):
        """What the fused path needs, or None when the networks are not our plain MLPs."""
        if self.reduction != "mean" or self.num_qvalue_nets < 1 or self.use_prioritized_weights is True:
            return None
        actor = self.actor_network
        seq = getattr(actor, "module", None)
        q_net = getattr(self.qvalue_network, "module", None)
        if (
            not isinstance(seq, torch.nn.Sequential)
            or len(seq) != 2
            or not isinstance(seq[1], ScaledTanh)
            or not isinstance(q_net, QValueNet)
            or len(actor.in_keys) != 1
            or list(actor.out_keys) != [self.tensor_keys.action]
        ):
            return None
        plan = {
            "actor": _fused.linear_chain(seq[0], actor),
            "squash": seq[1],
            "q": _fused.linear_chain(q_net.net, self.qvalue_network),
            "obs": actor.in_keys[0],
        }
        if plan["actor"] is None or plan["q"] is None:
            return None
        return plan

    def _fused_forward(self, tensordict: TensorDictBase, actor: bool = True) -> TensorDictBase:
        plan, keys = self._plan, self.tensor_keys
        batch_shape = tensordict.shape  # the maths runs on the flattened batch; outputs take this shape back
        flat, obs, action, next_obs, reward, not_terminal = _fused.transition(tensordict, keys, plan["obs"])
        squash = plan["squash"]
        q_layers = _fused.chain_params(self.qvalue_network_params, plan["q"])
        terms = {}

        if actor:
            # actor term: Q_1 with frozen critic parameters, as TorchRL's actor_loss
            pi = _squash(squash, _fused.run_chain(_fused.chain_params(self.actor_network_params, plan["actor"]), obs))
            q1_layers = [(w[0].detach(), b[0].detach()) for w, b in q_layers]
            q_pi = _fused.run_chain(q1_layers, torch.cat([obs, pi], -1)).squeeze(-1)
            bc_loss = torch.nn.functional.mse_loss(pi, action)
            lmbd = self.alpha / q_pi.abs().mean().detach()
            terms = {
                "loss_actor": (-lmbd * q_pi).mean() + bc_loss,
                "bc_loss": bc_loss.detach(),
                "lmbd": lmbd,
                "state_action_value_actor": q_pi.detach().reshape(batch_shape),
            }

        # critic term; the noise is drawn first, as TorchRL does, so seeded runs match
        noise = (torch.randn_like(action) * self.policy_noise).clamp(-self.noise_clip, self.noise_clip)
        with torch.no_grad():
            next_pi = _squash(
                squash, _fused.run_chain(_fused.chain_params(self.target_actor_network_params, plan["actor"]), next_obs)
            )
            next_action = (next_pi + noise).clamp(self.min_action, self.max_action)
            q_next = _fused.run_ensemble(
                _fused.chain_params(self.target_qvalue_network_params, plan["q"]), torch.cat([next_obs, next_action], -1)
            ).squeeze(-1).min(0).values
            gamma = _fused.td0_discount(self.value_estimator, flat, reward)
            target = reward + gamma * not_terminal * q_next
        q = _fused.run_ensemble(q_layers, torch.cat([obs, action], -1)).squeeze(-1)
        loss_qvalue = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0).mean()
        tensordict.set(keys.priority, (q.detach() - target).pow(2).max(0).values.reshape(batch_shape))
        return TensorDict(
            {
                **terms,
                "loss_qvalue": loss_qvalue,
                "pred_value": q.detach().reshape(-1, *batch_shape),
                "next_state_value": q_next.reshape(batch_shape),
                "target_value": target.reshape(batch_shape),
            }
        )

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._forward(tensordict, actor=True)

    def loss_terms(self, tensordict: TensorDictBase, keys) -> TensorDictBase:
        """The output of :meth:`forward` restricted to the ``loss_*`` terms in ``keys`` (and
        their diagnostics), for a trainer that knows which terms it will step.

        Without ``"loss_actor"`` the actor's forward and its pass through the critic are
        skipped: on TD3's critic-only steps (``policy_freq - 1`` of every ``policy_freq``) that
        is the work TorchRL's ``sota-implementations/td3_bc`` loop and d3rlpy skip too. The
        random draws are the same either way (the actor term draws none), so a run that asks
        for every term and one that asks only for the due ones follow the same trajectory.
        Where TorchRL's code runs instead of the fused path (see ``fused``; prioritised
        weights) every term is computed.
        The class example shows a critic-only call.
        """
        return self._forward(tensordict, actor="loss_actor" in keys)

    def _forward(self, tensordict: TensorDictBase, actor: bool) -> TensorDictBase:
        keys = self.tensor_keys
        self._check_batch(tensordict)
        # prioritised-replay weights and loss masks are TorchRL's business: its code applies them
        weighted = tensordict.get(keys.priority_weight, None) is not None
        if weighted or self._fused_blocker() is not None or _fused.loss_mask_present(self, tensordict):
            out = super().forward(tensordict)
        else:
            out = self._fused_forward(tensordict, actor=actor)
        if self._emits_diagnostics():
            out.update(self._q_diagnostics(out.get("pred_value"), tensordict))
        return out

    @torch.no_grad()
    def _q_diagnostics(self, pred_value: torch.Tensor, tensordict: TensorDictBase) -> dict:
        """The ``diagnostics`` entries, over the positions the loss's reduction counts."""
        q_data = pred_value.min(0).values
        valid = self._counted_positions(tensordict, q_data)
        if valid is not None:
            q_data = q_data[valid]
        return {"q_data_mean": q_data.mean(), **self._mc_diagnostics(q_data, tensordict, valid)}
