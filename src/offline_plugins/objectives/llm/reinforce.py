"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262) as TorchRL loss modules: no
critic, the KL to the reference in the reward, advantages normalised over the round, PPO's clipped ratio;
subclasses of :class:`~offline_plugins.objectives.llm.grpo.TextGRPOLoss` reading the same rows."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from offline_plugins.objectives.llm.estimators import group_advantages, masked_whiten
from offline_plugins.objectives.llm.grpo import TextGRPOLoss, _minus_sequence_kl

__all__ = ["REINFORCEPPLoss", "REINFORCEPPBaselineLoss"]


class REINFORCEPPLoss(TextGRPOLoss):
    """REINFORCE++: no critic, the KL in the reward token by token, advantages normalised over the round.

    Hu et al. 2025, REINFORCE++, arXiv:2501.03262. Each response token's return is
    ``r * 1[t is the last] - beta * sum_{s >= t} KL_s`` (with per-token rewards, a multi-turn
    episode's, ``sum_{s >= t} r_s`` in place of the first term) with ``KL_s = log pi_sample - log pi_ref``
    (k1), so a token is charged the divergence of what follows it; the returns are standardised
    over every response token of the round (the global batch, not the prompt's group), and the
    update is PPO's clipped ratio (0.2). ``beta = 0.01``. With no reference log-probs the return is
    the reward. ``has_signal`` still says whether the prompt's group had different rewards.
    """

    default_beta = 0.01
    kl_as_term = False
    token_baseline_applies = False  # its advantages are per token already

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        td = super().process_rollouts(td)
        k = self.tensor_keys
        mask = self._get(td, "response_mask", "the response-token mask").bool()
        td.set(k.advantage, self.token_advantages(td, mask).unsqueeze(-1))
        return td

    def token_advantages(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` standardised returns on the response tokens, 0 elsewhere. Rows with per-token
        rewards (``token_reward``: a multi-turn episode's turn rewards) return the rewards earned
        at or after each token in place of the episode's reward."""
        dense = td.get(self.tensor_keys.token_reward, None)
        reward = (self.rollout_rewards(td).unsqueeze(-1) if dense is None
                  else dense.to(torch.float32).flip(-1).cumsum(-1).flip(-1))  # sum_{s >= t} r_s
        ref = td.get(self.tensor_keys.ref_log_probs, None)
        if ref is not None:
            sample = self._get(td, "sample_log_probs", "the sampling policy's log-probs")
            kl = torch.where(mask, sample - ref, torch.zeros_like(sample)).to(torch.float32)
            to_go = kl.flip(-1).cumsum(-1).flip(-1)  # sum_{s >= t} KL_s
            returns = reward - self.beta * to_go
        else:
            returns = reward.expand(mask.shape)
        return masked_whiten(returns, mask)

    def advantages(self, rewards, groups):
        # per-row values the base writes first: only has_signal is kept (token_advantages replaces them)
        return group_advantages(rewards, groups, scale=False)


class REINFORCEPPBaselineLoss(REINFORCEPPLoss):
    """REINFORCE++-baseline: the group's mean reward as the baseline, the round's std as the scale.

    Hu et al. 2025, arXiv:2501.03262 (the variant for several responses per prompt): each response's
    reward minus the sequence-level KL, ``r - beta * sum_t KL_t`` (as RLOO here), minus the mean of
    its group, divided by the standard deviation of those differences over the round's responses
    (not the group's: GRPO's per-group std up-weights groups that nearly agree). PPO's clipped ratio.
    """

    def token_advantages(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
        reward = _minus_sequence_kl(self, td, self.rollout_rewards(td))
        centred, _ = group_advantages(reward, self._get(td, "group", "the prompt ids"), scale=False)
        per_row = centred / centred.std(unbiased=False).clamp_min(1e-6)
        return per_row.unsqueeze(-1) * mask.to(per_row.dtype)
