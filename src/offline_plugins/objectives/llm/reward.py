"""The reward-model objective of RLHF as a TorchRL loss module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from offline_plugins.objectives.llm import functional as F
from offline_plugins.objectives.llm.common import PreferenceLossBase, run_network

__all__ = ["BradleyTerryLoss"]


class BradleyTerryLoss(PreferenceLossBase):
    """Bradley-Terry reward-model loss: ``-log sigmoid(r(x, y_w) - r(x, y_l) - margin)``.

    Bradley and Terry 1952; Ouyang et al. 2022, arXiv:2203.02155 (step 2 of RLHF).
    Rewards are identified only up to a constant (seeds, 5.6.4); ``center_coeff > 0``
    adds ``loss_center = center_coeff * mean((r_w + r_l)**2)``, which pins their mean
    near 0 (Eisenstein et al. 2023, arXiv:2312.09244).

    Args:
        reward_network: writes one reward per sequence at ``tensor_keys.reward`` (e.g.
            :class:`~offline_plugins.modules.causal_lm.CausalLMReward`). ``None`` reads
            rewards already in the batch.

    Keyword Args:
        margin (float): the chosen reward must win by this much. Defaults to ``0.0``.
        center_coeff (float): weight of the reward-centring term; 0 disables it. Defaults to ``0.0``.
        reduction (str): ``"mean"``, ``"sum"`` or ``"none"``. Defaults to ``"mean"``.
        bootstrap (bool): with an ensemble reward network (``num_heads > 1``, e.g.
            ``CausalLMReward(heads=K)``) every head minimises its own loss, each pair
            weighted by a Poisson(1) draw per head: the online bootstrap (Oza and Russell
            2001), so the heads see different resamples of the data and disagree where it
            is thin. False: every head sees every pair. Defaults to ``True``.

    With an ensemble, ``loss_reward`` is the mean over heads of each head's weighted
    Bradley-Terry loss, and the output adds ``ensemble_std`` (the mean over responses of
    the heads' population std); the accuracy and margins are the aggregated reward's.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"reward": torch.tensor([[1.0, 0.0]])}, [1, 2])
        >>> round(BradleyTerryLoss()(batch)["loss_reward"].item(), 4)
        0.3133
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename with ``set_keys``.

        Attributes:
            reward: one reward per sequence, ``[B, 2]`` (index 0 chosen, 1 rejected),
                written by the reward network. Defaults to ``"reward"``.
        """

        reward: NestedKey = "reward"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        reward_network: Optional[torch.nn.Module] = None,
        *,
        margin: float = 0.0,
        center_coeff: float = 0.0,
        reduction: str = "mean",
        bootstrap: bool = True,
    ) -> None:
        super().__init__(None, reduction=reduction)
        self.reward_network = reward_network
        self.bootstrap = bool(bootstrap)
        self.register_buffer("margin", torch.tensor(float(margin)))
        self.register_buffer("center_coeff", torch.tensor(float(center_coeff)))
        self._center = center_coeff > 0

    def rewards(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``[B, 2]`` rewards: from the reward network when given, else from the batch."""
        if self.reward_network is not None:
            out = run_network(
                self.reward_network, tensordict, "BradleyTerryLoss: the reward network",
                "tokenise the pairs with offline_plugins.text.data.preference.tokenize_pairs",
            )
            reward = self._get(out, "reward", "the reward network's output")
        else:
            reward = self._get(tensordict, "reward", "one reward per response (or pass a reward_network)")
        if reward.shape == tensordict.batch_size + (1,):
            reward = reward.squeeze(-1)
        self._check_shape(reward, "reward", tensordict.batch_size)
        return reward

    def _ensemble(self) -> bool:
        return self.reward_network is not None and getattr(self.reward_network, "num_heads", 1) > 1

    def _ensemble_loss(self, tensordict: TensorDictBase):
        """Each head's bootstrap-weighted loss, averaged over heads; and the aggregated ``[B, 2]`` reward."""
        net = self.reward_network
        heads = net.head_rewards(tensordict.get(net.tokens_key), tensordict.get(net.attention_mask_key))  # [B, 2, K]
        per = F.bradley_terry_loss(heads[:, 0], heads[:, 1], margin=self.margin)  # [B, K]
        if self.bootstrap:
            # the global RNG, which the training shell seeds per step: reproducible and resumable
            weights = torch.poisson(torch.ones_like(per))
            per = (weights * per).sum(0) / weights.sum(0).clamp_min(1.0)
        else:
            per = per.mean(0)
        spread = heads.detach().std(-1, correction=0).mean()
        return per.mean(), net.combine(heads), spread

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        self._check_pairs(tensordict)
        if self._ensemble():
            loss, reward, spread = self._ensemble_loss(tensordict)
            r_w, r_l = reward[..., 0], reward[..., 1]
            out = TensorDict({"loss_reward": loss}, [])
            out.set("ensemble_std", spread)
        else:
            reward = self.rewards(tensordict)
            r_w, r_l = reward[..., 0], reward[..., 1]
            out = TensorDict({"loss_reward": self._reduce(F.bradley_terry_loss(r_w, r_l, margin=self.margin))}, [])
        if self._center:
            out.set("loss_center", self.center_coeff * ((r_w + r_l) ** 2).mean())
        margin = (r_w - r_l).detach()
        out.set("preference_accuracy", (margin > 0).float().mean())
        out.set("reward_margin", margin.mean())
        out.set("reward_chosen", r_w.detach().mean())
        out.set("reward_rejected", r_l.detach().mean())
        return out
