"""Behaviour cloning: TorchRL's ``BCLoss`` with an input check and an action-error diagnostic."""

from __future__ import annotations

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.objectives import BCLoss as _TorchRLBCLoss

from offline_plugins.objectives.common import check_batch_keys

__all__ = ["BCLoss"]


class BCLoss(_TorchRLBCLoss):
    r"""Behaviour cloning (Pomerleau 1991; the BC baseline of Fujimoto & Gu 2021), TorchRL's loss.

    With ``loss_function="l2"`` and a deterministic actor: :math:`E[(\mu(s) - a)^2]`
    (TorchRL's code path, unchanged). With ``loss_function=None`` and a stochastic actor
    (one with ``get_dist``): :math:`-E[\log \pi(a|s)]`. TorchRL 0.14 sends integer
    actions to a cross-entropy against the actor's *written* action, which a
    categorical policy (writing the sampled index) cannot satisfy, so that case is
    computed here from the distribution; it is the same cross-entropy.

    Args:
        actor_network: the policy.

    Keyword Args:
        loss_function: ``"l2"``, ``"l1"``, ``"smooth_l1"`` or None (negative log-likelihood).
        **kwargs: passed to :class:`torchrl.objectives.BCLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.modules.networks import make_categorical_actor
        >>> loss = BCLoss(make_categorical_actor(3, 4, (8,)))
        >>> batch = TensorDict({"observation": torch.randn(5, 3), "action": torch.randint(4, (5,))}, [5])
        >>> loss(batch)["loss_bc"].shape
        torch.Size([])
        >>> loss(TensorDict({"observation": torch.randn(5, 3)}, [5]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        offline_plugins.objectives.common.MissingBatchKeyError: BCLoss: the batch has no key 'action';...
    """

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action], "BCLoss")
        if self.loss_function is not None or not hasattr(self.actor_network, "get_dist"):
            return super().forward(tensordict)
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            dist = self.actor_network.get_dist(tensordict.copy())
        log_prob = dist.log_prob(tensordict.get(self.tensor_keys.action))
        loss = self._reduce_loss(-log_prob, tensordict=tensordict)
        return TensorDict({"loss_bc": loss, "log_prob_data_mean": log_prob.detach().mean()})

