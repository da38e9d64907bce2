"""Decision Transformer losses: TorchRL's ``DTLoss`` and ``OnlineDTLoss`` with input checks.

Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence
Modeling", arXiv:2106.01345. Both classes keep TorchRL's contract, so swapping
TorchRL's import for ours changes nothing a caller relies on: the same keys
(``action_target`` and ``action_pred``, both ``"action"``), the same outputs
(``loss`` for DT), keyword calls through ``@dispatch``, ``select_out_keys``, any batch
shape, and TorchRL's hyperparameters. What we add: a clear error naming a key the batch
lacks, and, on request, a detached action-error diagnostic (``diagnostics=True``).

>>> import torch
>>> from tensordict import TensorDict
>>> from offline_plugins.modules.sequence.decision_transformer import DecisionTransformerActor, DecisionTransformerNet
>>> net = DecisionTransformerNet(3, 1, embed_dim=16, num_layers=1, context_len=5)
>>> loss = DecisionTransformerLoss(DecisionTransformerActor(net, context_len=5), diagnostics=True)
>>> loss.set_keys(action_pred="action_pred")  # our actor reads "action", so writes its prediction beside it
>>> batch = TensorDict({"observation": torch.randn(10, 3), "action": torch.rand(10, 1),
...     "return_to_go": torch.randn(10, 1), "step_count": torch.arange(10).unsqueeze(-1)}, [10])
>>> out = loss(batch)
>>> loss.out_keys, out["loss"].shape
(['loss', 'action_abs_error'], torch.Size([]))
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from torchrl.objectives import DTLoss, OnlineDTLoss
from torchrl.objectives.utils import distance_loss

from offline_plugins.objectives.common import HyperparameterError, check_batch_keys

__all__ = ["DecisionTransformerLoss", "OnlineDecisionTransformerLoss"]

_LOSS_FUNCTIONS = ("l1", "l2", "smooth_l1")  # what torchrl.objectives.utils.distance_loss computes
_REDUCTIONS = (None, "none", "mean", "sum")


def _check_reduction(owner: str, reduction: Optional[str]) -> None:
    if reduction not in _REDUCTIONS:
        raise HyperparameterError(f"{owner}: reduction={reduction!r} is not one of {_REDUCTIONS}; pass one of them")


class _ActionInKeys:
    """``in_keys``: the actor's inputs and ``action_target``, kept current by ``set_keys``.

    TorchRL's ``DTLoss`` also lists ``action_pred``, which the actor *writes*; with the
    default keys the two lists are equal (``action_pred == action_target == "action"``).
    Where ``action_pred`` is renamed, listing it would make ``@dispatch`` and
    ``select_out_keys`` treat every real batch (which never carries the prediction) as
    a keyword call, so it is left out. TorchRL's losses also keep ``in_keys`` from
    before a ``set_keys`` (they override ``LossModule``'s refresh); ours refresh them.
    """

    def _set_in_keys(self) -> None:
        keys = {*self.actor_network.in_keys, self.tensor_keys.action_target}
        self._in_keys = sorted(keys, key=str)

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        self._set_in_keys()


class DecisionTransformerLoss(_ActionInKeys, DTLoss):
    """TorchRL's ``DTLoss``: regress the actions of trajectory windows (output ``loss``).

    The term is TorchRL's: ``distance_loss(pred, target)`` reduced by ``reduction``,
    over every step of every window (a batch of any shape).

    Args:
        actor_network: reads a batch and writes the predicted action at
            ``tensor_keys.action_pred``.

    Keyword Args:
        loss_function: ``"l2"`` (default, the paper's), ``"l1"`` or ``"smooth_l1"``.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        device: accepted for TorchRL's signature; unused, as in TorchRL.
        diagnostics: also return ``action_abs_error``, the mean absolute error of the
            prediction, detached. Off by default (TorchRL returns ``loss`` only); listed
            in ``out_keys`` when on.

    Keys (``set_keys``): ``action_target`` (the data's action) and ``action_pred`` (the
    actor's prediction), both ``"action"`` by default, as in TorchRL. An actor that reads
    the data's action as an input, like
    :class:`~offline_plugins.modules.sequence.decision_transformer.DecisionTransformerActor`,
    writes its prediction elsewhere: ``loss.set_keys(action_pred="action_pred")``.
    """

    def __init__(
        self,
        actor_network,
        *,
        loss_function: str = "l2",
        reduction: Optional[str] = None,
        device: Optional[torch.device] = None,
        diagnostics: bool = False,
    ) -> None:
        if loss_function not in _LOSS_FUNCTIONS:
            # TorchRL fails on the first forward with NotImplementedError; same set, sooner
            raise HyperparameterError(
                f"{type(self).__name__}: loss_function={loss_function!r} is not one of {_LOSS_FUNCTIONS}; pass one of them"
            )
        _check_reduction(type(self).__name__, reduction)
        self.diagnostics = bool(diagnostics)
        super().__init__(actor_network, loss_function=loss_function, reduction=reduction, device=device)

    @property
    def out_keys(self):
        if self._out_keys is None:
            self._out_keys = ["loss", "action_abs_error"] if self.diagnostics else ["loss"]
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = list(values)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action_target], type(self).__name__)
        tensordict = tensordict.copy()
        target = tensordict.get(self.tensor_keys.action_target).detach()
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            pred = self.actor_network(tensordict).get(self.tensor_keys.action_pred)
        loss = self._reduce_loss(distance_loss(pred, target, loss_function=self.loss_function), tensordict=tensordict)
        td_out = TensorDict(loss=loss)
        if self.diagnostics:
            td_out.set("action_abs_error", (pred.detach() - target).abs().mean())
        self._clear_weakrefs(tensordict, td_out, "actor_network_params", "target_actor_network_params")
        return td_out


class OnlineDecisionTransformerLoss(_ActionInKeys, OnlineDTLoss):
    """TorchRL's ``OnlineDTLoss`` (Zheng, Zhang & Grover 2022, arXiv:2202.05607), with input checks.

    The policy is a tanh-squashed Gaussian; the loss is its negative log-likelihood of
    the data's actions, minus an entropy bonus whose weight ``alpha`` is tuned to a
    target entropy (``loss_log_likelihood``, ``loss_entropy``, ``loss_alpha``;
    diagnostics ``alpha``, ``entropy``). Arguments, keys and outputs are
    ``OnlineDTLoss``'s; ``out_keys`` leaves out ``alpha`` and ``entropy`` where
    ``reduction="none"`` with ``scalar_output_mode="exclude"`` leaves them out of the
    output (TorchRL lists them anyway, and its keyword call then fails on them).

    >>> import torch
    >>> from tensordict import TensorDict
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

    def __init__(self, actor_network, **kwargs) -> None:
        _check_reduction(type(self).__name__, kwargs.get("reduction"))
        super().__init__(actor_network, **kwargs)
        self._out_keys = None  # computed on first read, from the reduction and scalar_output_mode set above

    @property
    def out_keys(self):
        if self._out_keys is None:
            keys = ["loss_log_likelihood", "loss_entropy", "loss_alpha"]
            if not (self.reduction == "none" and self.scalar_output_mode == "exclude"):
                keys += ["alpha", "entropy"]
            self._out_keys = keys
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values if values is None else list(values)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, [*self.actor_network.in_keys, self.tensor_keys.action_target], type(self).__name__)
        return super().forward(tensordict)
