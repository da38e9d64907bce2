"""What an algorithm's ``build(config, data)`` returns: the parts a trainer needs.

An :class:`AlgorithmParts` holds the TorchRL loss, the evaluation policy, the
optimiser groups (which parameters, which learning rate, which ``loss_*`` terms
they minimise) and the target-network updater. The Lightning shell trains any of
them; a plain TorchRL loop can use the same parts (``examples/compose_in_torchrl.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives import LossModule

__all__ = ["OptimizerGroup", "AlgorithmParts"]


@dataclass
class OptimizerGroup:
    """One optimiser: its parameters, learning rate and the loss terms it minimises.

    Attributes:
        name: ``actor``, ``critic``, ``value``, ``alpha``... (used in logs and checkpoints).
        params: the parameters it steps.
        lr: learning rate.
        loss_keys: the ``loss_*`` entries of the loss output whose sum it minimises.
        every: step it every ``every`` gradient steps (TD3+BC's delayed actor).
        weight_decay: Adam weight decay.
        max_grad_norm: clip gradients of ``params`` to this norm first (None: no clipping).
    """

    name: str
    params: Sequence[torch.nn.Parameter]
    lr: float
    loss_keys: tuple[str, ...]
    every: int = 1
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.params if p.requires_grad]
        if not params:
            raise ValueError(f"optimiser group {self.name!r} has no trainable parameters")
        kwargs: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        # fused Adam (one kernel for every tensor) runs on CUDA and, since torch 2.4, on CPU,
        # where it measured 3.6x faster than foreach for 2x256 MLPs (bench/offline_bench.py);
        # it needs floating-point parameters all on one device type
        devices = {p.device.type for p in params}
        if len(devices) == 1 and devices <= {"cuda", "cpu"} and all(p.is_floating_point() for p in params):
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        return torch.optim.Adam(params, **kwargs)


@dataclass
class AlgorithmParts:
    """Everything built for one algorithm on one dataset.

    Attributes:
        loss: the TorchRL ``LossModule``; ``loss(batch)`` returns ``loss_*`` terms and
            detached diagnostics.
        policy: deterministic evaluation policy reading ``"observation"`` (normalised as
            in training) and writing ``"action"``.
        optimizers: the optimiser groups, in the order they are stepped.
        target_updater: TorchRL ``SoftUpdate``/``HardUpdate`` bound to ``loss``, or None.
        extra: anything else the algorithm wants saved or logged.
    """

    loss: LossModule
    policy: TensorDictModuleBase
    optimizers: list[OptimizerGroup]
    target_updater: Optional[Any] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def loss_keys(self) -> tuple[str, ...]:
        keys: list[str] = []
        for group in self.optimizers:
            keys.extend(k for k in group.loss_keys if k not in keys)
        return tuple(keys)
