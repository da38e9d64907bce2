"""Evaluation policies: deterministic wrappers that read ``observation`` and write ``action``.

>>> import torch
>>> from tensordict import TensorDict
>>> from torchrl.data import Bounded
>>> from offline_plugins.modules.networks import make_tanh_gaussian_actor
>>> actor = make_tanh_gaussian_actor(3, Bounded(-torch.ones(1), torch.ones(1), (1,)), (8,))
>>> policy = DeterministicPolicy(actor)
>>> a1 = policy(TensorDict({"observation": torch.ones(2, 3)}, [2]))["action"]
>>> a2 = policy(TensorDict({"observation": torch.ones(2, 3)}, [2]))["action"]
>>> bool((a1 == a2).all())
True
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

__all__ = ["DeterministicPolicy"]


class DeterministicPolicy(TensorDictModuleBase):
    """Runs ``module`` with ``ExplorationType.DETERMINISTIC`` (mode / mean / argmax), whatever
    the caller's exploration setting, and without gradients."""

    def __init__(self, module: TensorDictModuleBase, out_keys=("action",)) -> None:
        super().__init__()
        self.module = module
        self.in_keys = list(module.in_keys)
        self.out_keys = list(out_keys)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
            return self.module(tensordict)
