"""TD3+BC: TorchRL's ``TD3BCLoss`` with input checks and the over-estimation diagnostic."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from tensordict import TensorDict
from torchrl.objectives import TD3BCLoss as _TorchRLTD3BCLoss
from torchrl.objectives.utils import distance_loss

from offline_plugins.objectives import _fused
from offline_plugins.objectives.common import check_batch_keys, check_range, data_q_diagnostics, transition_keys

__all__ = ["TD3BCLoss"]


class TD3BCLoss(_TorchRLTD3BCLoss):
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
        alpha (float): :math:`\alpha` > 0. Defaults to 2.5.
        policy_noise (float): target smoothing noise std, in action units. Defaults to 0.2.
        noise_clip (float): its clip. Defaults to 0.5.
        loss_function (str): critic regression loss. Defaults to ``"l2"`` (the paper's).
        diagnostics (bool): add ``q_data_mean`` (ensemble minimum on dataset actions) and,
            with ``return_to_go`` in the batch, ``mc_return_mean`` and ``q_data_minus_mc``.
            Free: it reads the critic's prediction. Defaults to True.
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
        >>> from tensordict import TensorDict
        >>> from torchrl.data import Bounded
        >>> from offline_plugins.modules.networks import make_deterministic_actor, make_qvalue
        >>> spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        >>> loss = TD3BCLoss(make_deterministic_actor(3, spec, (8,)), make_qvalue(3, 2, (8,)), action_spec=spec)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = TensorDict({"observation": torch.randn(4, 3), "action": spec.rand((4,)),
        ...     ("next", "observation"): torch.randn(4, 3), ("next", "reward"): torch.randn(4, 1),
        ...     ("next", "done"): torch.zeros(4, 1, dtype=torch.bool),
        ...     ("next", "terminated"): torch.zeros(4, 1, dtype=torch.bool),
        ...     "return_to_go": torch.randn(4, 1)}, [4])
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue']
        >>> "q_data_minus_mc" in out.keys()
        True
        >>> sorted(k for k in loss.loss_terms(batch, ["loss_qvalue"]).keys() if k.startswith("loss_"))
        ['loss_qvalue']
    """

    @dataclass
    class _AcceptedKeys(_TorchRLTD3BCLoss._AcceptedKeys):
        """TorchRL's TD3+BC keys, plus ``return_to_go`` (defaults to ``"return_to_go"``): the data's
        Monte-Carlo discounted return, read only for diagnostics."""

        return_to_go: NestedKey = "return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

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
        diagnostics: bool = True,
        fused: bool = True,
        **kwargs,
    ) -> None:
        check_range("TD3BCLoss", "alpha", alpha, 0.0, None)
        check_range("TD3BCLoss", "policy_noise", policy_noise, 0.0, None, low_inclusive=True)
        check_range("TD3BCLoss", "noise_clip", noise_clip, 0.0, None, low_inclusive=True)
        self.diagnostics = diagnostics
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
        self._plan = self._fused_plan() if fused else None
        self._no_plan = _fused.no_plan_reason(fused)

    def _fused_blocker(self):
        """Why this call runs TorchRL's code, not the fused path; None when the fused path is exact."""
        if self._plan is None:
            return self._no_plan
        return _fused.torchrl_blocker(
            self,
            _TorchRLTD3BCLoss,
            ("actor_loss", "qvalue_loss"),
            value_network=None,
            value_key=self.tensor_keys.state_action_value,
        )

    def _fused_plan(self):
        """What the fused path needs, or None when the networks are not our plain MLPs."""
        from offline_plugins.modules.networks import QValueNet, ScaledTanh

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
        tensordict, obs, action, next_obs, reward, not_terminal = _fused.transition(tensordict, keys, plan["obs"])
        squash = plan["squash"]
        q_layers = _fused.chain_params(self.qvalue_network_params, plan["q"])
        terms = {}

        if actor:
            # actor term: Q_1 with frozen critic parameters, as TorchRL's actor_loss
            pi = squash(_fused.run_chain(_fused.chain_params(self.actor_network_params, plan["actor"]), obs))
            q1_layers = [(w[0].detach(), b[0].detach()) for w, b in q_layers]
            q_pi = _fused.run_chain(q1_layers, torch.cat([obs, pi], -1)).squeeze(-1)
            bc_loss = torch.nn.functional.mse_loss(pi, action)
            lmbd = self.alpha / q_pi.abs().mean().detach()
            terms = {
                "loss_actor": (-lmbd * q_pi).mean() + bc_loss,
                "bc_loss": bc_loss.detach(),
                "lmbd": lmbd,
                "state_action_value_actor": q_pi.detach(),
            }

        # critic term; the noise is drawn first, as TorchRL does, so seeded runs match
        noise = (torch.randn_like(action) * self.policy_noise).clamp(-self.noise_clip, self.noise_clip)
        with torch.no_grad():
            next_pi = squash(
                _fused.run_chain(_fused.chain_params(self.target_actor_network_params, plan["actor"]), next_obs)
            )
            next_action = (next_pi + noise).clamp(self.min_action, self.max_action)
            q_next = _fused.run_ensemble(
                _fused.chain_params(self.target_qvalue_network_params, plan["q"]), torch.cat([next_obs, next_action], -1)
            ).squeeze(-1).min(0).values
            gamma = _fused.td0_discount(self.value_estimator, tensordict, reward)
            target = reward + gamma * not_terminal * q_next
        q = _fused.run_ensemble(q_layers, torch.cat([obs, action], -1)).squeeze(-1)
        loss_qvalue = distance_loss(q, target.expand_as(q), loss_function=self.loss_function).sum(0).mean()
        tensordict.set(keys.priority, (q.detach() - target).pow(2).max(0).values)
        return TensorDict(
            {
                **terms,
                "loss_qvalue": loss_qvalue,
                "pred_value": q.detach(),
                "next_state_value": q_next,
                "target_value": target,
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
        check_batch_keys(tensordict, transition_keys(self.actor_network.in_keys, keys), "TD3BCLoss")
        # prioritised-replay weights and loss masks are TorchRL's business: its code applies them
        weighted = tensordict.get(keys.priority_weight, None) is not None
        if weighted or self._fused_blocker() is not None or _fused.loss_mask_present(self, tensordict):
            out = super().forward(tensordict)
        else:
            out = self._fused_forward(tensordict, actor=actor)
        if self.diagnostics and self.reduction != "none":
            with torch.no_grad():
                q_data = out.get("pred_value").min(0).values
                out.update(data_q_diagnostics(q_data, tensordict, keys.return_to_go))
        return out
