"""Polyak target updates in one fused kernel call.

TorchRL's ``SoftUpdate`` walks the source and target ``TensorDictParams`` on every step:
it builds ``.data`` views of both TensorDicts and calls ``lerp_`` through the TensorDict
machinery, about 3.5 ms per network pair on one CPU thread (``bench/offline_bench.py``
profiles), as much as the critic's forward pass for 2x256 MLPs. :class:`FusedSoftUpdate`
is the same updater (a ``SoftUpdate`` subclass: same construction, ``init_``,
``state_dict``) whose ``step`` pairs the leaf tensors once and then makes one
``torch._foreach_lerp_`` call per step.

>>> import torch
>>> from torchrl.modules import MLP, ValueOperator
>>> from torchrl.objectives import DQNLoss
>>> loss = DQNLoss(ValueOperator(MLP(in_features=3, out_features=2, num_cells=[4]), ["observation"]), action_space="one-hot")
>>> updater = FusedSoftUpdate(loss, tau=0.5)
>>> with torch.no_grad():
...     _ = [p.add_(1.0) for p in loss.value_network_params.values(True, True)]
>>> updater.step()
>>> online = loss.value_network_params.flatten_keys()
>>> target = loss.target_value_network_params.flatten_keys()
>>> all(torch.allclose(target[k], online[k] - 0.5) for k in online.keys())
True
"""

from __future__ import annotations

import torch
from torchrl.objectives import SoftUpdate

__all__ = ["FusedSoftUpdate"]


class FusedSoftUpdate(SoftUpdate):
    """TorchRL's ``SoftUpdate`` (``target <- (1 - tau) target + tau source``) with one
    ``torch._foreach_lerp_`` over every target tensor per step.

    The (target, source) leaves are paired on the first step; their ``.data`` is read
    on every step, so moving the loss module to another device keeps the pairing valid.
    Construct it as ``SoftUpdate(loss_module, tau=...)`` (or ``eps=``).
    """

    _pairs: list | None = None

    def _leaf_pairs(self) -> list:
        pairs = []
        for key, source in self._sources.items():
            target = self._targets.get(f"target_{key}")
            if isinstance(source, torch.Tensor):
                pairs.append((target, source))
                continue
            for leaf in target.keys(True, True):
                pairs.append((target.get(leaf), source.get(leaf)))
        return pairs

    def step(self) -> None:
        if not self.initialized:
            raise RuntimeError(f"{type(self).__name__} must be initialized (`init_()`) before calling step()")
        if self._pairs is None:
            self._pairs = self._leaf_pairs()
        targets = [t.data for t, _ in self._pairs]
        sources = [s.data for _, s in self._pairs]
        with torch.no_grad():
            torch._foreach_lerp_(targets, sources, 1.0 - self.eps)
