"""Behaviour cloning: TorchRL's ``BCLoss`` with an input check and a log-likelihood diagnostic."""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.objectives import BCLoss as _TorchRLBCLoss

from offline_plugins.objectives.common import DiagnosticsContract, HyperparameterError, check_batch_keys

__all__ = ["BCLoss"]

# TorchRL's test for a stochastic actor: it writes distribution parameters
_DISTRIBUTION_PARAMS = ("loc", "scale", "logits", "probs")
# TorchRL's test for class-index (discrete) expert actions
_INDEX_DTYPES = (torch.int32, torch.int64)


def _writes_distribution_params(actor) -> bool:
    return any(key in getattr(actor, "out_keys", ()) for key in _DISTRIBUTION_PARAMS)


class BCLoss(DiagnosticsContract, _TorchRLBCLoss):
    r"""Behaviour cloning (Pomerleau 1991; the BC baseline of Fujimoto & Gu 2021), TorchRL's loss.

    The loss is TorchRL's, chosen as TorchRL chooses it: with ``loss_function`` set, that
    regression (or cross-entropy) against the actor's written action; with
    ``loss_function=None``, a mean-squared error for a deterministic actor (TorchRL's
    ``Actor``) and :math:`-E[\log \pi(a|s)]` for a stochastic one (an actor writing
    ``loc``/``scale``/``logits``/``probs``). One case differs: class-index (integer) actions
    with a stochastic actor. TorchRL 0.14 sends them to a cross-entropy against the actor's
    *written* action, which a categorical policy (writing the sampled or argmax index) cannot
    satisfy; here the same cross-entropy is computed from the policy's distribution,
    :math:`-\log \pi(a|s)`, with TorchRL's ``pad_mask`` and collector-mask handling.

    Args:
        actor_network: the policy.

    Keyword Args:
        loss_function: ``"l2"``/``"mse"``, ``"l1"``, ``"smooth_l1"``, ``"cross_entropy"``, a
            callable ``(pred, target) -> loss``, or None (chosen from the actor, as above).
            Defaults to None (TorchRL's default).
        reduction (str): ``"mean"``, ``"sum"`` or ``"none"``. Defaults to ``"mean"``.
        diagnostics (bool): add ``log_prob_data_mean``, the mean log-likelihood of the data's
            actions under the policy (over the positions the loss counts), listed in
            ``out_keys`` after ``loss_bc``. Needs a stochastic actor. Off by default so that
            ``out_keys`` is TorchRL's ``["loss_bc"]`` and a keyword call returns the loss tensor
            alone, as TorchRL's does; for a stochastic actor it equals ``-loss_bc`` under
            ``"mean"`` reduction anyway. Defaults to False.

    There is no ``mc_diagnostics``: BC has no critic whose estimate a return could check.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.modules.networks import make_categorical_actor
        >>> loss = BCLoss(make_categorical_actor(3, 4, (8,)))
        >>> batch = TensorDict({"observation": torch.randn(5, 3), "action": torch.randint(4, (5,))}, [5])
        >>> loss(batch)["loss_bc"].shape
        torch.Size([])
        >>> loss.out_keys
        ['loss_bc']
        >>> loss(TensorDict({"observation": torch.randn(5, 3)}, [5]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        offline_plugins.objectives.common.MissingBatchKeyError: BCLoss: the batch has no key 'action';...
    """

    _unreduced_output_is_batched = False  # TorchRL's output has batch size [] under any reduction

    def __init__(
        self,
        actor_network,
        *,
        loss_function=None,
        reduction: Optional[str] = None,
        diagnostics: bool = False,
    ) -> None:
        if diagnostics and not _writes_distribution_params(actor_network):
            raise HyperparameterError(
                "BCLoss: diagnostics=True reports the data's log-likelihood, which needs a stochastic "
                f"actor (one writing one of {list(_DISTRIBUTION_PARAMS)}); got an actor writing "
                f"{list(getattr(actor_network, 'out_keys', []))}. Pass diagnostics=False"
            )
        self._init_diagnostics(diagnostics)
        super().__init__(actor_network, loss_function=loss_function, reduction=reduction)
        self._set_out_keys()

    def _torchrl_out_keys(self) -> list:
        return ["loss_bc"]

    def _diagnostic_keys(self) -> list:
        return ["log_prob_data_mean"]

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action], "BCLoss")
        log_prob = mask = None
        if (
            self.loss_function is None
            and tensordict.get(self.tensor_keys.action).dtype in _INDEX_DTYPES
            and _writes_distribution_params(self.actor_network)
        ):
            log_prob = self._data_log_prob(tensordict, grad=True)
            mask = self._pad_mask(tensordict, log_prob)
            out = TensorDict({"loss_bc": self._reduce_loss(-log_prob, tensordict=tensordict, mask=mask)})
        else:
            out = super().forward(tensordict)
        if self._emits_diagnostics():
            if log_prob is None:
                log_prob = self._data_log_prob(tensordict, grad=False)
                mask = self._pad_mask(tensordict, log_prob, per_position=True)
            mean = self._reduce_loss(log_prob.detach(), tensordict=tensordict, mask=mask, reduction="mean")
            out.set("log_prob_data_mean", mean)
        self._clear_weakrefs(tensordict, out, "actor_network_params")
        return out

    def _data_log_prob(self, tensordict: TensorDictBase, grad: bool) -> torch.Tensor:
        """``log pi(a|s)`` of the data's actions, from the actor's distribution."""
        action = tensordict.get(self.tensor_keys.action)
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()), self.actor_network_params.to_module(
            self.actor_network, preserve_module_state=False
        ):
            dist = self.actor_network.get_dist(tensordict.copy())
            if action.ndim > len(dist.batch_shape + dist.event_shape) and action.shape[-1] == 1:
                action = action.squeeze(-1)  # [*B, 1] class indices, as TorchRL's cross-entropy takes them
            return dist.log_prob(action)

    def _pad_mask(
        self, tensordict: TensorDictBase, loss: torch.Tensor, per_position: bool = False
    ) -> Optional[torch.Tensor]:
        """TorchRL's ``pad_mask`` handling: ``~pad``, refused when it is finer than the loss.

        With ``per_position`` (the diagnostic), a finer mask counts a position if any of its
        elements is not padding.
        """
        key = self.tensor_keys.pad_mask
        pad = None if key is None else tensordict.get(key, None)
        if pad is None:
            return None
        if pad.ndim > loss.ndim:
            if per_position:
                return (~pad).flatten(loss.ndim).any(-1)
            raise RuntimeError(
                f"pad_mask {key!r} has more dimensions ({pad.ndim}) than the computed loss ({loss.ndim}): "
                "per-element masking requires an elementwise loss (e.g. loss_function='l1'), not a "
                "distribution-based (NLL) or cross-entropy loss."
            )
        return ~pad
