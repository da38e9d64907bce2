"""Fitted Q evaluation (FQE): a trained policy's value estimated from the dataset, without its environment.

Le, Voloshin & Yue 2019 ("Batch Policy Learning under Constraints", arXiv:1903.08738) fit
:math:`Q^\\pi` by regressing :math:`Q(s, a)` on :math:`r + \\gamma (1 - \\mathrm{terminated})
\\bar Q(s', \\pi(s'))` over the dataset's transitions, where :math:`\\bar Q` is a target network
copied every few steps or Polyak-averaged (one FQE iteration per copy); the policy's value is then
:math:`Q(s_0, \\pi(s_0))` averaged over initial states. Paine et al. 2020 ("Hyperparameter
Selection for Offline Reinforcement Learning", arXiv:2007.09055) found FQE the most reliable of
the estimators they compared for ranking a run's policies without the environment; d3rlpy
ships it as ``d3rlpy.ope.FQE``. TorchRL has no FQE, so :class:`FQELoss` is ours, a TorchRL
``LossModule`` with TorchRL's ``HardUpdate`` for the target.

:func:`fitted_q_evaluation` splits the dataset's episodes in two, seeded: FQE fits on one part
and the value is read at the initial states of the other, held-out part, states the regression
never saw. Rewards are fitted in units of their standard deviation and reported raw. The
estimate is of the *discounted* return from the start; to compare it with the environment's
undiscounted return and normalised score, it is mapped through the line fitted between the
discounted and the undiscounted returns of the held-out episodes themselves (their returns
are in the data); a monotone map, so the ranking of checkpoints is the value's own.

>>> import torch
>>> from tensordict import TensorDict
>>> from tensordict.nn import TensorDictModule
>>> from offline_plugins.modules.networks import make_qvalue
>>> policy = TensorDictModule(lambda obs: torch.zeros(obs.shape[:-1] + (1,)), ["observation"], ["action"])
>>> loss = FQELoss(make_qvalue(2, 1, (8,)), policy, gamma=0.5)
>>> batch = TensorDict({"observation": torch.zeros(4, 2), "action": torch.zeros(4, 1),
...                     ("next", "observation"): torch.zeros(4, 2), ("next", "reward"): torch.ones(4, 1),
...                     ("next", "terminated"): torch.zeros(4, 1, dtype=torch.bool)}, [4])
>>> sorted(loss(batch).keys())
['loss_qvalue', 'q_mean', 'target_mean']
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives import HardUpdate, LossModule, SoftUpdate
from tqdm.auto import tqdm

from offline_plugins.errors import UserError
from offline_plugins.modules.networks import make_qvalue
from offline_plugins.objectives.columns import discounted_returns

__all__ = ["FQELoss", "fitted_q_evaluation", "OPEError"]


class OPEError(UserError, ValueError):
    """An off-policy evaluation that cannot run as asked."""


class FQELoss(LossModule):
    """The FQE regression of a fixed policy's Q function on one batch of transitions.

    Args:
        qvalue_network: reads ``observation`` and ``action``, writes ``state_action_value``.
        policy: the policy evaluated (not trained): reads ``observation``, writes ``action``.

    Keyword Args:
        gamma: discount of the value estimated.
        value_range: ``(low, high)``: the bootstrapped values are clipped into it, the range every
            discounted return lies in (``[r_min, r_max] / (1 - gamma)``); a policy's actions outside
            the data then cannot drive the regression out of it. None: no clipping.

    Reads ``observation``, ``action``, ``("next", "observation")``, ``("next", "reward")`` and
    ``("next", "terminated")``; returns ``loss_qvalue`` (mean squared TD error) and the
    detached ``q_mean`` and ``target_mean``.
    """

    qvalue_network: Any
    qvalue_network_params: Any
    target_qvalue_network_params: Any

    def __init__(self, qvalue_network, policy, *, gamma: float = 0.99,
                 value_range: Optional[tuple[float, float]] = None) -> None:
        super().__init__()
        if not 0.0 <= float(gamma) < 1.0:
            raise OPEError(f"FQE's gamma must lie in [0, 1), got {gamma}; the estimate is a discounted value")
        self.convert_to_functional(qvalue_network, "qvalue_network", create_target_params=True)
        self.policy = policy
        self.gamma = float(gamma)
        self.value_range = value_range

    @property
    def out_keys(self) -> list[str]:
        return ["loss_qvalue", "q_mean", "target_mean"]

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        next_td = TensorDict({"observation": tensordict.get(("next", "observation"))}, tensordict.batch_size,
                             device=tensordict.device)
        with torch.no_grad():
            next_td = self.policy(next_td)
            with self.target_qvalue_network_params.to_module(self.qvalue_network):
                next_q = self.qvalue_network(next_td).get("state_action_value")
            if self.value_range is not None:  # no value lies outside [r_min, r_max] / (1 - gamma)
                next_q = next_q.clamp(*self.value_range)
            done = tensordict.get(("next", "terminated")).to(next_q.dtype)
            target = tensordict.get(("next", "reward")) + self.gamma * (1.0 - done) * next_q
        td = tensordict.select("observation", "action")
        with self.qvalue_network_params.to_module(self.qvalue_network):
            q = self.qvalue_network(td).get("state_action_value")
        return TensorDict({"loss_qvalue": (q - target).pow(2).mean(), "q_mean": q.detach().mean(),
                           "target_mean": target.mean()}, [])

    def value(self, observation: torch.Tensor) -> torch.Tensor:
        """``Q(s, pi(s))`` of each row of ``observation``."""
        with torch.no_grad():
            td = self.policy(TensorDict({"observation": observation}, observation.shape[:-1]))
            with self.qvalue_network_params.to_module(self.qvalue_network):
                return self.qvalue_network(td).get("state_action_value").squeeze(-1)


def _episode_split(episode: torch.Tensor, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.unique(episode)
    if ids.numel() < 2:
        raise OPEError(f"FQE needs at least 2 episodes to hold some out, and the dataset has {ids.numel()}; "
                       "evaluate in the environment instead (offline-plugins eval CKPT)")
    n_out = min(max(1, round(ids.numel() * held_out)), ids.numel() - 1)
    order = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    out = torch.isin(episode, order[:n_out])
    return ~out, out


def fitted_q_evaluation(policy, data: Any, *, gamma: float = 0.99, steps: int = 3000, batch_size: int = 256,
                        hidden=(256, 256), lr: float = 1e-3, target_every: int = 0, tau: float = 0.05,
                        held_out: float = 0.2,
                        seed: int = 0, device: str = "cpu", progress: bool = False) -> dict[str, Any]:
    """Estimate ``policy``'s discounted value on ``data`` (an ``OfflineData``, its observations as the
    policy reads them) by FQE, and its undiscounted return and normalised score through the held-out
    episodes' own returns (see the module's text).

    Keyword Args:
        gamma: discount of the value; steps: gradient steps of the regression; batch_size, hidden,
            lr: its batch, Q network widths, Adam's learning rate; target_every: steps between
            hard target copies (one FQE iteration each; 0, the default: the target follows at
            Polyak rate ``tau``, 0.05, which on Pendulum propagated the value about ten times
            faster than 0.005 at the same stability); held_out: the fraction of episodes kept out
            of the fit, whose initial states the value is read at; seed: the split, the network's
            initialisation and the batches.

    Returns:
        ``value`` (mean discounted value of the held-out initial states, raw reward units),
        ``return_estimate`` and ``normalized_score_estimate`` (through the held-out line; None
        with fewer than 2 held-out episodes or equal returns), ``data_value`` and
        ``data_return`` (the held-out episodes' own mean discounted and undiscounted returns),
        ``fit_episodes``, ``held_out_episodes``, ``steps``, ``gamma``, ``final_loss``.
    """
    if int(steps) < 1:
        raise OPEError(f"--ope-steps must be at least 1, got {steps}")
    if not 0.0 < float(held_out) < 1.0:
        raise OPEError(f"--ope-held-out must lie strictly between 0 and 1, got {held_out}")
    td = data.td
    if td.get("action").dtype not in (torch.float32, torch.float64):
        raise OPEError(f"FQE here evaluates policies with continuous actions, and dataset {data.dataset_id!r} "
                       "has discrete ones")
    stats = data.stats
    dev = torch.device(device)
    fit_mask, out_mask = _episode_split(td.get("episode"), held_out, seed)
    raw = (td.get(("next", "reward")) - stats.reward_shift) / stats.reward_scale
    unit = float(raw[fit_mask].std()) or 1.0  # rewards are fitted in units of their spread
    rows = td.select("observation", "action", ("next", "observation"), ("next", "terminated"))
    rows.set(("next", "reward"), raw / unit)
    fit = rows[fit_mask].to(dev)
    torch.manual_seed(seed)
    r_fit = fit.get(("next", "reward"))
    bounds = (float(r_fit.min()) / (1 - gamma), float(r_fit.max()) / (1 - gamma))
    loss = FQELoss(make_qvalue(td.get("observation").shape[-1], td.get("action").shape[-1], tuple(hidden)),
                   policy, gamma=gamma, value_range=bounds).to(dev)
    updater = (HardUpdate(loss, value_network_update_interval=int(target_every)) if target_every
               else SoftUpdate(loss, tau=tau))
    params = list(loss.qvalue_network_params.values(True, True))
    optim = torch.optim.Adam(params, lr=lr)
    g = torch.Generator(device=dev).manual_seed(seed)
    bar = None
    if progress:
        bar = tqdm(total=int(steps), desc="fqe", unit="step")
    last = torch.zeros((), device=dev)
    for _ in range(int(steps)):
        idx = torch.randint(fit.shape[0], (int(batch_size),), generator=g, device=dev)
        out = loss(fit[idx])
        optim.zero_grad(set_to_none=True)
        out["loss_qvalue"].backward()
        optim.step()
        updater.step()
        last = out["loss_qvalue"].detach()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    # the held-out episodes: their initial states, and their own discounted and undiscounted returns
    held = td[out_mask]
    episode = held.get("episode")
    starts = torch.ones_like(episode, dtype=torch.bool)
    starts[1:] = episode[1:] != episode[:-1]
    held_raw = held.clone(False)
    held_raw.set(("next", "reward"), raw[out_mask])
    mc = discounted_returns(held_raw, gamma).reshape(-1)[starts]
    undiscounted = discounted_returns(held_raw, 1.0).reshape(-1)[starts]
    value = loss.value(held.get("observation")[starts].to(dev)) * unit
    v = float(value.mean())
    result = {"method": "fqe", "value": v, "data_value": float(mc.mean()), "data_return": float(undiscounted.mean()),
              "return_estimate": None, "normalized_score_estimate": None, "gamma": float(gamma),
              "steps": int(steps), "fit_episodes": int(torch.unique(td.get("episode")[fit_mask]).numel()),
              "held_out_episodes": int(starts.sum()), "final_loss": float(last) * unit * unit}
    x, y = mc.double().cpu().numpy(), undiscounted.double().cpu().numpy()
    if x.size >= 2 and float(np.std(x)) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        result["return_estimate"] = float(slope * v + intercept)
        if stats.ref_min_score is not None and stats.ref_max_score is not None:
            result["normalized_score_estimate"] = float(data.normalized_score(result["return_estimate"]))
    if not math.isfinite(v):
        raise OPEError(f"FQE diverged (value {v}); try fewer --ope-steps or a smaller --ope-gamma")
    return result

