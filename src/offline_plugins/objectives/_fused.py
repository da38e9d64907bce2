"""Fused tensor paths for the hot loops of our TorchRL-based losses.

TorchRL's losses run each critic through ``torch.vmap`` + ``to_module`` on TensorDicts
and build ``torch.distributions`` objects every step; for 2x256 MLPs at batch 256 on a
CPU that bookkeeping costs as much as the arithmetic. These helpers compute the same
values straight from the losses' parameter TensorDicts: the critic ensemble as one
batched matmul per layer (``baddbmm`` over the stacked weights), the tanh-Gaussian
log-density in closed form. They apply only to the plain MLP networks built by
:mod:`offline_plugins.modules.networks`; :func:`linear_chain` returns None for
anything else and the losses fall back to TorchRL's code.

The fused maths reproduce TorchRL's ``*_loss`` methods with TorchRL's plain TD(0)
estimator, and nothing else: :func:`torchrl_blocker` names what would make them differ
(another estimator, a subclass override, a loss mask in the batch), and the losses then
run TorchRL's code, which honours it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict.utils import unravel_key
from torch import nn
from torchrl.objectives.value import TD0Estimator

__all__ = [
    "transition",
    "torchrl_blocker",
    "loss_mask_present",
    "td0_discount",
    "linear_chain",
    "chain_params",
    "run_chain",
    "run_ensemble",
    "tanh_normal_log_prob",
    "no_plan_reason",
    "FusedPath",
]


def transition(tensordict, keys, obs_key) -> tuple:
    """``(tensordict, obs, action, next_obs, reward, not_terminal)`` of a transition batch.

    The batch is flattened to ``[batch]`` first (the ensemble matmuls take ``[batch, features]``)
    and returned, so values written to it land in the flattened batch; ``reward`` and
    ``not_terminal`` are ``[batch]``, ``not_terminal`` in the reward's dtype.
    """
    if tensordict.ndim != 1:
        tensordict = tensordict.reshape(-1)
    reward = tensordict.get(("next", keys.reward)).squeeze(-1)
    not_terminal = (~tensordict.get(("next", keys.terminated))).squeeze(-1).to(reward.dtype)
    return (
        tensordict,
        tensordict.get(obs_key),
        tensordict.get(keys.action),
        tensordict.get(("next", obs_key)),
        reward,
        not_terminal,
    )


def torchrl_blocker(loss, torchrl_cls: type, methods: tuple, *, value_network, value_key) -> Optional[str]:
    """Why the fused maths would not give what ``torchrl_cls``'s own code gives for ``loss``; None if they would.

    They hard-code ``torchrl_cls``'s ``methods`` (``actor_loss``, ``qvalue_loss``, ...) and a
    TD(0) target ``r + gamma * (1 - terminated) * V'`` as TorchRL's ``TD0Estimator`` computes it:
    an override of one of the methods (on a subclass or the instance) or any other estimator
    (TD(1), TD(lambda), standardised rewards, another value network or other keys) needs
    TorchRL's code. ``value_network``/``value_key``: what the loss's own estimator is built with.
    Read on every forward, as ``make_value_estimator`` may be called at any time; a few
    attribute reads.
    """
    cls = type(loss)
    for name in methods:
        if getattr(cls, name) is not getattr(torchrl_cls, name) or name in loss.__dict__:
            return f"{cls.__name__}.{name} overrides TorchRL's"
    if loss.reduction != "mean":
        return f"reduction={loss.reduction!r}"
    est = loss.value_estimator
    if type(est) is not TD0Estimator:
        return f"the value estimator is {type(est).__name__}, not TD0Estimator"
    if getattr(est, "average_rewards", False):
        return "the TD(0) estimator standardises rewards (average_rewards=True)"
    if est.value_network is not value_network:
        return "the TD(0) estimator has another value network than the loss"
    keys, own = est.tensor_keys, loss.tensor_keys
    if (keys.reward, keys.terminated, keys.value) != (own.reward, own.terminated, value_key):
        return "the TD(0) estimator reads other keys than the loss (set them with loss.set_keys)"
    return None


def loss_mask_present(loss, tensordict) -> bool:
    """Whether the batch holds a mask TorchRL's ``_reduce_loss`` would apply (``("collector", "mask")``, ...)."""
    mask_keys = getattr(loss, "_loss_mask_keys", None)  # torchrl >= 0.12
    return mask_keys is not None and any(tensordict.get(k, None) is not None for k in mask_keys())


def td0_discount(estimator, tensordict, reward: torch.Tensor, kept: Optional[tuple] = None) -> torch.Tensor:
    """The estimator's ``gamma``, raised to ``steps_to_next_obs`` where the (flattened) batch has
    it (n-step transitions), shaped like ``reward``: TorchRL's ``TD0Estimator.value_estimate``.

    ``kept``: the keys TorchRL's loss method keeps (``tensordict.select(*kept)``) before it
    calls the estimator, None for all; a ``steps_to_next_obs`` it drops is not applied
    (TorchRL's ``IQLLoss.qvalue_loss`` keeps only ``"next"``, the observations and the action).
    """
    gamma = estimator.gamma
    key = getattr(estimator.tensor_keys, "steps_to_next_obs", None)
    if key is None:
        return gamma
    if kept is not None:
        path = unravel_key(key)
        path = (path,) if isinstance(path, str) else path
        prefixes = [(k,) if isinstance(k, str) else k for k in map(unravel_key, kept)]
        if not any(path[: len(p)] == p for p in prefixes):
            return gamma
    steps = tensordict.get(key, None)
    if steps is not None:
        gamma = gamma ** steps.reshape(reward.shape)
    return gamma


def linear_chain(module: nn.Module, root: nn.Module) -> Optional[list]:
    """Key paths (relative to ``root``'s parameters) of ``module``'s Linear layers, if it is
    ``Linear -> ReLU -> ... -> Linear``; None otherwise."""
    if not isinstance(module, nn.Sequential) or len(module) == 0:
        return None
    layers = list(module)
    for i, layer in enumerate(layers):
        expected = nn.Linear if i % 2 == 0 else nn.ReLU
        if type(layer) is not expected:
            return None
    if not isinstance(layers[-1], nn.Linear):
        return None
    names = {id(p): n for n, p in root.named_parameters()}
    keys = []
    for layer in layers[::2]:
        if layer.bias is None or id(layer.weight) not in names:
            return None
        keys.append((tuple(names[id(layer.weight)].split(".")), tuple(names[id(layer.bias)].split("."))))
    return keys


def chain_params(params, keys) -> list:
    """``[(weight, bias), ...]`` from a (possibly stacked) parameter TensorDict."""
    return [(params.get(w), params.get(b)) for w, b in keys]


def run_chain(layers: list, x: torch.Tensor) -> torch.Tensor:
    """One MLP: ``Linear -> ReLU -> ... -> Linear``."""
    last = len(layers) - 1
    for i, (w, b) in enumerate(layers):
        x = F.linear(x, w, b)
        if i < last:
            x = torch.relu(x)
    return x


def run_ensemble(layers: list, x: torch.Tensor, *, per_member: bool = False) -> torch.Tensor:
    """An ensemble of MLPs with stacked weights ``[E, out, in]``: ``x`` ``[B, in]`` or ``[E, B, in]``
    -> ``[E, B, out]``, one ``baddbmm`` per layer.

    ``per_member=True`` runs each member's layers as ``addmm`` instead: for thousands of
    rows on a CPU, BLAS's plain GEMM beats its batched one by 10-25% (CQL's sampled
    actions); for a few hundred rows, or on a GPU, one batched kernel is cheaper.
    """
    n = layers[0][0].shape[0]
    last = len(layers) - 1
    if per_member:
        # unbind: the backward stacks the members' gradients once (indexing w[e] would
        # scatter each into a zero tensor of the stack's size)
        members = [(w.unbind(0), b.unbind(0)) for w, b in layers]
        xs = x.unbind(0) if x.dim() == 3 else (x,) * n
        outs = []
        for e in range(n):
            h = xs[e]
            for i, (w, b) in enumerate(members):
                h = F.linear(h, w[e], b[e])
                if i < last:
                    h = torch.relu(h)
            outs.append(h)
        return torch.stack(outs)
    # Features-first activations [E, features, B]: each layer is W @ h + b, so the weight
    # gradient (grad @ h^T) comes out in the parameter's own [E, out, in] layout; in the
    # rows-first form (h @ W^T) it is the transpose, and autograd copies it into the
    # parameter's layout (5 such copies of [2, 256, 256] per IQL step, ~10% of the step).
    h = x.transpose(-1, -2)
    if h.dim() == 2:
        h = h.unsqueeze(0).expand(n, *h.shape)
    for i, (w, b) in enumerate(layers):
        h = torch.baddbmm(b.unsqueeze(2), w, h)
        if i < last:
            h = torch.relu(h)
    return h.transpose(1, 2)


_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def tanh_normal_log_prob(
    loc: torch.Tensor, scale: torch.Tensor, action: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> torch.Tensor:
    """``log p(action)`` under TorchRL's ``TanhNormal(loc, scale, low, high)`` (safe tanh), summed
    over the last dimension: the same clamping (``1 - finfo.resolution``) and Jacobian terms."""
    half = (high - low) / 2
    y = (action - (high + low) / 2) / half
    lim = 1.0 - torch.finfo(y.dtype).resolution
    x = y.clamp(-lim, lim).atanh()
    normal = -((x - loc) ** 2) / (2 * scale**2) - scale.log() - _LOG_SQRT_2PI
    log_det_tanh = 2.0 * (math.log(2.0) - x - F.softplus(-2.0 * x))
    return (normal - log_det_tanh - half.log()).sum(-1)


def no_plan_reason(fused: bool) -> str:
    """Why a loss built without a fused plan runs TorchRL's code."""
    if not fused:
        return "fused=False"
    return ("the networks or settings are not the fused path's (the plain MLPs of "
            "offline_plugins.modules.networks, reduction='mean', ...)")


class FusedPath:
    """What a loss with a fused fast path (IQL, TD3+BC) shares: the plan, made once at
    construction by the loss's ``_fused_plan`` (None: TorchRL's code always), and the check,
    on every call, of whether the plan gives exactly what TorchRL's code would.

    A subclass sets ``_fused_torchrl`` (the TorchRL loss class whose maths the plan
    reproduces) and ``_fused_methods`` (that class's methods it hard-codes), and defines
    ``_fused_plan`` and ``_fused_value`` (the value network and key its TD(0) estimator is
    built with, for :func:`torchrl_blocker`).
    """

    _fused_torchrl: type
    _fused_methods: tuple

    def _init_fused(self, fused: bool) -> None:
        """Call at the end of ``__init__``, once the TorchRL loss is set up."""
        self._plan = self._fused_plan() if fused else None
        self._no_plan = no_plan_reason(fused)

    def _fused_blocker(self) -> Optional[str]:
        """Why this call runs TorchRL's code, not the fused path; None when the fused path is exact."""
        if self._plan is None:
            return self._no_plan
        value_network, value_key = self._fused_value()
        return torchrl_blocker(self, self._fused_torchrl, self._fused_methods, value_network=value_network, value_key=value_key)
