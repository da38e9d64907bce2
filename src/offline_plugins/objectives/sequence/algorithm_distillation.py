"""Algorithm Distillation loss: cross-entropy of the learner's action given its across-episode history.

Laskin et al. 2022, "In-context Reinforcement Learning with Algorithm Distillation",
arXiv:2210.14215. TorchRL has no Algorithm Distillation (its ``DTLoss`` regresses
continuous actions given returns-to-go), so this is a ``LossModule`` of its own, shaped
like :class:`~offline_plugins.objectives.sequence.decision_transformer.DecisionTransformerLoss`:
keys in ``_AcceptedKeys``, keyword calls through ``@dispatch``, ``out_keys``.

>>> import torch
>>> from tensordict import TensorDict
>>> from offline_plugins.modules.sequence.algorithm_distillation import (
...     AlgorithmDistillationActor, AlgorithmDistillationNet)
>>> net = AlgorithmDistillationNet(1, 3, embed_dim=16, num_layers=1, num_heads=1, context_len=5, dropout=0.0)
>>> loss = AlgorithmDistillationLoss(AlgorithmDistillationActor(net, context_len=5), diagnostics=True)
>>> batch = TensorDict({"observation": torch.zeros(10, 1), "prev_action": torch.randint(0, 4, (10,)),
...     "prev_reward": torch.rand(10, 1), "action": torch.randint(0, 3, (10,))}, [10])
>>> out = loss(batch)
>>> loss.out_keys, out["loss"].shape
(['loss', 'action_accuracy'], torch.Size([]))
>>> keyword = loss(observation=batch["observation"], prev_action=batch["prev_action"],
...     prev_reward=batch["prev_reward"], action=batch["action"])  # keyword call: a tuple in out_keys' order
>>> torch.equal(keyword[0], out["loss"])
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModuleBase, dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule

from offline_plugins.objectives.common import HyperparameterError, check_batch_keys

__all__ = ["AlgorithmDistillationLoss"]


class AlgorithmDistillationLoss(LossModule):
    """``loss = CE(logits_t, a_t)`` over every step of every history window (output ``loss``).

    The actor predicts the source learner's action ``a_t`` from the window's steps up to
    ``t`` (observation, previous action, previous reward); ``reduction`` averages
    (``"mean"``), sums (``"sum"``) or keeps (``"none"``, the batch's shape) the per-step terms.

    Args:
        actor_network: reads a batch and writes action logits ``[..., A]`` at
            ``tensor_keys.action_logits``
            (:class:`~offline_plugins.modules.sequence.algorithm_distillation.AlgorithmDistillationActor`).

    Keyword Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        diagnostics: also return ``action_accuracy``, the fraction of steps whose argmax
            is the learner's action, detached (listed in ``out_keys`` when on).

    Keys (``set_keys``): ``action_target`` (the learner's action, int64 indices or
    one-hot; default ``"action"``) and ``action_logits`` (default ``"action_logits"``).
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename them with ``set_keys``.

        Attributes:
            action_target: Defaults to ``"action"``.
            action_logits: what the actor writes. Defaults to ``"action_logits"``.
        """

        action_target: NestedKey = "action"
        action_logits: NestedKey = "action_logits"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    actor_network: TensorDictModuleBase
    actor_network_params: TensorDictParams
    target_actor_network_params: TensorDictParams

    def __init__(self, actor_network, *, reduction: Optional[str] = None, diagnostics: bool = False) -> None:
        if reduction not in (None, "none", "mean", "sum"):
            raise HyperparameterError(f"{type(self).__name__}: reduction={reduction!r} is not one of "
                                      "None, 'none', 'mean', 'sum'; pass one of them")
        super().__init__()
        self.convert_to_functional(actor_network, "actor_network", create_target_params=False)
        self.reduction = reduction or "mean"
        self.diagnostics = bool(diagnostics)

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self):
        return sorted({*self.actor_network.in_keys, self.tensor_keys.action_target}, key=str)

    @property
    def out_keys(self):
        return ["loss", "action_accuracy"] if self.diagnostics else ["loss"]

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        check_batch_keys(tensordict, self.in_keys, type(self).__name__)
        tensordict = tensordict.copy()
        with self.actor_network_params.to_module(self.actor_network, preserve_module_state=False):
            logits = self.actor_network(tensordict).get(self.tensor_keys.action_logits)
        target = tensordict.get(self.tensor_keys.action_target)
        if target.shape == logits.shape:  # one-hot actions
            target = target.argmax(-1)
        target = target.reshape(logits.shape[:-1]).long()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        ce = ce.reshape(target.shape)
        loss = ce.mean() if self.reduction == "mean" else ce.sum() if self.reduction == "sum" else ce
        out = TensorDict(loss=loss)
        if self.diagnostics:
            out.set("action_accuracy", (logits.detach().argmax(-1) == target).float().mean())
        return out
