"""Rollout rows, a fixed actor and the log-probs they start from, for the hand-computed tests of the text losses."""

from __future__ import annotations

import torch
from tensordict import TensorDict


class _Fixed(torch.nn.Module):
    """An actor returning given per-token log-probs as a parameter (so gradients reach them)."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.lp = torch.nn.Parameter(log_probs.clone())

    def log_probs(self, tokens, attention_mask):
        return self.lp


def _rows(sample_lp, rewards, groups, *, ref_lp=None, response=None, components=None):
    """Rollout rows with the given sampling log-probs; the last ``response`` tokens are the response
    (``response`` may be a list: each row's own length, then right-padded)."""
    b, t = sample_lp.shape
    resp = torch.zeros(b, t, dtype=torch.bool)
    lengths = response if isinstance(response, list) else [response or t - 1] * b
    for i, n in enumerate(lengths):
        resp[i, 1:1 + n] = True
    nxt = {"reward": torch.tensor(rewards, dtype=torch.float32).reshape(b, 1)}
    if ref_lp is not None:
        nxt["ref_log_probs"] = {"full": ref_lp}
    if components is not None:
        nxt["reward_components"] = torch.tensor(components, dtype=torch.float32)
    return TensorDict({
        "tokens": {"full": torch.zeros(b, t, dtype=torch.long)},
        "masks": {"all_attention_mask": torch.ones(b, t, dtype=torch.bool), "all_assistant_mask": resp},
        "log_probs": {"full": sample_lp}, "next": nxt, "group": torch.tensor(groups),
    }, [b])


# two responses of one prompt, 2 response tokens each (position 0 is the prompt): the sampling policy's
# log-probs, and the current policy's
SAMPLE = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.2, 0.4]]))
CURRENT = torch.log(torch.tensor([[0.5, 0.6, 0.5], [0.5, 0.1, 0.6]]))


def _run(loss, current, td):
    """``loss`` on the rollouts ``td`` (processed first) with an actor whose log-probs are ``current``: its
    output, the actor's log-prob parameter (for gradients) and the processed rollouts."""
    loss.actor_network = _Fixed(current)
    td = loss.process_rollouts(td)
    return loss(td), loss.actor_network.lp, td
