"""Decision Transformer loss: TorchRL's ``DTLoss`` with ``loss_*`` naming, input checks and diagnostics.

Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence
Modeling", arXiv:2106.01345. The term is TorchRL's (mean squared error between the
predicted and the data's actions over every window step); what we add is the
``loss_actor`` name our optimiser groups sum, a clear error for missing keys, and a
detached action-error diagnostic from the same forward pass.

>>> import torch
>>> from tensordict import TensorDict
>>> from offline_plugins.modules.sequence.decision_transformer import DecisionTransformerActor, DecisionTransformerNet
>>> net = DecisionTransformerNet(3, 1, embed_dim=16, num_layers=1, context_len=5)
>>> loss = DecisionTransformerLoss(DecisionTransformerActor(net, context_len=5))
>>> batch = TensorDict({"observation": torch.randn(10, 3), "action": torch.rand(10, 1),
...     "return_to_go": torch.randn(10, 1), "step_count": torch.arange(10).unsqueeze(-1)}, [10])
>>> out = loss(batch)
>>> sorted(out.keys()), out["loss_actor"].shape
(['action_abs_error', 'loss_actor'], torch.Size([]))
"""

from __future__ import annotations

from dataclasses import dataclass

from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives import DTLoss, OnlineDTLoss
from torchrl.objectives.utils import distance_loss

from offline_plugins.objectives.common import check_batch_keys

__all__ = ["DecisionTransformerLoss", "OnlineDecisionTransformerLoss"]


class DecisionTransformerLoss(DTLoss):
    """TorchRL's ``DTLoss``: regress the actions of trajectory windows, returning ``loss_actor``.

    Args:
        actor_network: reads a window batch and writes ``action_pred``
            (:class:`~offline_plugins.modules.sequence.decision_transformer.DecisionTransformerActor`).

    Keyword Args:
        loss_function: ``"l2"`` (the paper's), ``"l1"`` or ``"smooth_l1"``.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """

    @dataclass
    class _AcceptedKeys(DTLoss._AcceptedKeys):
        """Keys the loss reads; rename them with ``set_keys``.

        Attributes:
            action_target: the data's action. Defaults to ``"action"``.
            action_pred: the actor's predicted action. Defaults to ``"action_pred"``.
        """

        action_target: NestedKey = "action"
        action_pred: NestedKey = "action_pred"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    @property
    def out_keys(self):
        return ["loss_actor", "action_abs_error"]

    @out_keys.setter
    def out_keys(self, values):
        pass

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action_target], type(self).__name__)
        tensordict = tensordict.copy()
        target = tensordict.get(self.tensor_keys.action_target).detach()
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            pred = self.actor_network(tensordict).get(self.tensor_keys.action_pred)
        loss = self._reduce_loss(distance_loss(pred, target, loss_function=self.loss_function), tensordict=tensordict)
        return TensorDict({"loss_actor": loss, "action_abs_error": (pred.detach() - target).abs().mean()}, [])


class OnlineDecisionTransformerLoss(OnlineDTLoss):
    """TorchRL's ``OnlineDTLoss`` (Zheng, Zhang & Grover 2022, arXiv:2202.05607), with input checks.

    The policy is a tanh-squashed Gaussian; the loss is its negative log-likelihood of
    the data's actions, minus an entropy bonus whose weight ``alpha`` is tuned to a
    target entropy (``loss_log_likelihood``, ``loss_entropy``, ``loss_alpha``;
    diagnostics ``entropy``, ``alpha``). Arguments are ``OnlineDTLoss``'s.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import ProbabilisticTensorDictModule as Dist
    >>> from torchrl.data import Bounded
    >>> from torchrl.modules import ProbabilisticActor, TanhNormal
    >>> from offline_plugins.modules.sequence.decision_transformer import (
    ...     DecisionTransformerActor, StochasticDecisionTransformerNet)
    >>> net = StochasticDecisionTransformerNet(3, 1, embed_dim=16, num_layers=1, context_len=5)
    >>> spec = Bounded(-torch.ones(1), torch.ones(1), (1,))
    >>> actor = ProbabilisticActor(DecisionTransformerActor(net, context_len=5, out_keys=["loc", "scale"]),
    ...     in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal,
    ...     distribution_kwargs={"low": -1.0, "high": 1.0})
    >>> loss = OnlineDecisionTransformerLoss(actor, alpha_init=0.1)
    >>> batch = TensorDict({"observation": torch.randn(10, 3), "action": torch.rand(10, 1) * 1.8 - 0.9,
    ...     "return_to_go": torch.randn(10, 1), "step_count": torch.arange(10).unsqueeze(-1)}, [10])
    >>> sorted(k for k in loss(batch).keys() if k.startswith("loss_"))
    ['loss_alpha', 'loss_entropy', 'loss_log_likelihood']
    """

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action_target], type(self).__name__)
        return super().forward(tensordict)
