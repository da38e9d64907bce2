"""The shell's one optimiser over an algorithm's optimiser groups (:func:`make_shell_optimizer`): one
grouped Adam (:func:`make_grouped_adam`), or a chain of the groups' own optimisers
(:class:`OptimizerChain`) where a group asks for another; ``offline_plugins.lightning.module``
re-exports the three."""

from __future__ import annotations

from typing import Sequence

import torch

from offline_plugins.algorithms.base import OptimizerGroup, adam_kernel

__all__ = ["OptimizerChain", "make_grouped_adam", "make_shell_optimizer"]


def make_grouped_adam(groups: Sequence[OptimizerGroup]) -> torch.optim.Adam:
    """One Adam whose parameter groups are the algorithm's optimiser groups.

    One optimiser (not one per group) keeps Lightning's ``global_step`` equal to the
    number of gradient steps. It is equivalent to one Adam per group: Adam's state
    is per parameter, and a group that sits a step out (``every > 1``) has no
    gradient, so Adam leaves its parameters and moments alone.
    """
    param_groups = [
        {"params": g.trainable(), "lr": g.lr, "weight_decay": g.weight_decay, "name": g.name,
         "betas": tuple(g.betas), "decoupled_weight_decay": g.decoupled_weight_decay} for g in groups
    ]
    return torch.optim.Adam(param_groups, **adam_kernel([p for pg in param_groups for p in pg["params"]]))


class OptimizerChain(torch.optim.Optimizer):
    """Several optimisers stepped, zeroed and saved as one.

    Lightning counts every ``step()`` of every optimiser in ``global_step``; the shell
    hands it this one optimiser so that a step stays one gradient step. Its
    ``param_groups`` are the members' own group dicts, so a learning-rate scheduler
    on the chain sets the members' rates.

    >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> chain = OptimizerChain([torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=1e-3)])
    >>> (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum().backward()
    >>> chain.step(); [g["lr"] for g in chain.param_groups]
    [0.1, 0.001]
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("OptimizerChain needs at least one optimiser")
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """The members' per-parameter states (their own dicts: changes to a value reach them)."""
        merged: dict = {}
        for o in getattr(self, "optimizers", ()):
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ assigns an empty state
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the state holds {len(saved)} optimisers, this chain has {len(self.optimizers)}")
        for o, s in zip(self.optimizers, saved):
            o.load_state_dict(s)


def make_shell_optimizer(groups: Sequence[OptimizerGroup]) -> torch.optim.Optimizer:
    """The shell's one optimiser: :func:`make_grouped_adam` when every group is a plain
    :class:`OptimizerGroup`, else an :class:`OptimizerChain` of each group's own
    ``make_optimizer()`` (a group that overrides it gets the optimiser it asks for)."""
    if all(type(g).make_optimizer is OptimizerGroup.make_optimizer for g in groups):
        return make_grouped_adam(groups)
    return OptimizerChain([g.make_optimizer() for g in groups])
