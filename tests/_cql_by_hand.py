"""CQL's conservative term computed by hand, for the tests of CQL and Cal-QL (which raises the
policy's action values to a bound first)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type


def conservative_term_by_hand(loss, actor, batch, *, n: int, weight: float,
                              bound: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int]:
    """``(mean over states and Q heads of weight * (logsumexp over the sampled actions - Q(s, a_data)),
    how many policy action values the bound raised)``: uniform actions on [-1, 1]^2 corrected by their
    density, the current and next states' policy actions scored at ``s`` and corrected by their
    log-probs, drawn as the loss draws them after ``torch.manual_seed(1)``; with ``bound`` (Cal-QL)
    each policy action value is ``max(Q, bound)`` first."""
    b = batch.batch_size[0]
    qmod = loss.qvalue_network.module
    raise_to = (lambda q: torch.maximum(q, bound)) if bound is not None else (lambda q: q)
    with torch.no_grad():
        torch.manual_seed(1)
        s, s2 = batch["observation"], batch["next", "observation"]
        rand = torch.empty(b * n, 2).uniform_(-1, 1)
        with set_exploration_type(ExplorationType.RANDOM):
            cur_a, cur_lp = actor.get_dist(TensorDict({"observation": s.repeat_interleave(n, 0)}, [b * n])) \
                .rsample_and_log_prob()
            nxt_a, nxt_lp = actor.get_dist(TensorDict({"observation": s2.repeat_interleave(n, 0)}, [b * n])) \
                .rsample_and_log_prob()
        s_rep = s.repeat_interleave(n, 0)
        expected, raised = 0, 0
        for i in range(len(loss.qvalue_network_params)):
            with loss.qvalue_network_params[i].to_module(loss.qvalue_network):
                q_cur = qmod(s_rep, cur_a).reshape(b, n)
                q_nxt = qmod(s_rep, nxt_a).reshape(b, n)  # next-state actions scored at s
                if bound is not None:
                    raised += int((q_cur < bound).sum() + (q_nxt < bound).sum())
                cat = torch.cat([
                    qmod(s_rep, rand).reshape(b, n) - 2 * math.log(0.5),
                    raise_to(q_nxt) - nxt_lp.reshape(b, n),
                    raise_to(q_cur) - cur_lp.reshape(b, n),
                ], -1)
                data_q = qmod(s, batch["action"]).squeeze(-1)
            expected = expected + weight * (torch.logsumexp(cat, -1) - data_q)
    return expected.mean(), raised
