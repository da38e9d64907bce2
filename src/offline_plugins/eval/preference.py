"""Held-out scores of a preference-trained model: pairwise accuracy, KL to the reference, exact match.

* ``preference_accuracy``: the share of held-out pairs the model ranks right. For a
  policy, by its implicit reward ``log pi(y|x) - log pi_ref(y|x)`` summed over the
  response (the DPO reading: the policy moved probability toward the chosen answer more
  than toward the rejected one); for a reward model, by its scalar reward.
* ``likelihood_accuracy``: the share where the policy's length-averaged log-prob of
  the chosen response beats the rejected one's (the policy's own ranking, without the
  reference; SimPO's and ORPO's criterion). The reference has one too.
* ``kl_to_reference``: the mean over held-out chosen responses of
  ``sum_t KL(pi(.|x, y_<t) || pi_ref(.|x, y_<t))`` over response positions, over the full
  vocabulary (a sequence-level KL along the data's prefixes, exact, no sampling).
* ``exact_match``: greedy answers to held-out task prompts that are exactly right
  (built-in tasks only).

>>> import torch
>>> from tensordict import TensorDict
>>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
>>> lm = torch.nn.Embedding(5, 5)
>>> tokens = torch.tensor([[[1, 2, 3], [1, 2, 4]]])
>>> td = TensorDict({"tokens": {"full": tokens},
...                  "masks": {"all_attention_mask": torch.ones(1, 2, 3, dtype=torch.bool),
...                            "all_assistant_mask": torch.tensor([[[0, 0, 1], [0, 0, 1]]]).bool()},
...                  "ref_log_probs": {"response": torch.zeros(1, 2)}}, [1, 2])
>>> with torch.no_grad():
...     _ = lm.weight.zero_()
...     lm.weight[2, 3] = 1.0  # after token 2, token 3 is likelier than 4
>>> pairwise_scores(CausalLMLogProbs(lm), td)["preference_accuracy"]
1.0
>>> kl_to_reference(lm, lm, td)
0.0
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from offline_plugins.modules.causal_lm import _is_hf_like, _logits_of, sequence_log_probs
from offline_plugins.text.data.task_data import exact_match_accuracy

__all__ = ["pairwise_scores", "kl_to_reference", "evaluate_preference_model"]


def _chunks(td, batch_size: int, device):
    for i in range(0, td.batch_size[0], batch_size):
        yield td[i : i + batch_size].to(device)


def _device_of(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def pairwise_scores(policy: torch.nn.Module, pairs, *, batch_size: int = 64) -> dict[str, float]:
    """``preference_accuracy`` (and, for a log-prob policy, ``likelihood_accuracy``) on ``[N, 2]`` pairs."""
    device = _device_of(policy)
    right, right_lik, n = torch.zeros((), device=device), torch.zeros((), device=device), 0
    is_reward = hasattr(policy, "rewards")
    for td in _chunks(pairs, batch_size, device):
        tokens, attn = td.get(("tokens", "full")), td.get(("masks", "all_attention_mask"))
        if is_reward:
            r = policy.rewards(tokens, attn)
            right += (r[:, 0] > r[:, 1]).sum()
        else:
            total, count = sequence_log_probs(policy.log_probs(tokens, attn), td.get(("masks", "all_assistant_mask")))
            ratio = total - td.get(("ref_log_probs", "response")).to(total.dtype)
            right += (ratio[:, 0] > ratio[:, 1]).sum()
            mean = total / count.clamp_min(1)
            right_lik += (mean[:, 0] > mean[:, 1]).sum()
        n += td.batch_size[0]
    out = {"preference_accuracy": float(right) / max(n, 1)}
    if not is_reward:
        out["likelihood_accuracy"] = float(right_lik) / max(n, 1)
    return out


@torch.no_grad()
def kl_to_reference(model: torch.nn.Module, reference: torch.nn.Module, td, *, batch_size: int = 64) -> float:
    """Mean over responses of the summed per-token KL(model || reference) on the response positions.

    ``td`` is ``[N, 2]`` pairs (the chosen responses are used) or ``[N]`` rows.
    """
    if td.batch_dims == 2:
        td = td[:, 0]
    device = _device_of(model)
    ref_device = _device_of(reference)
    hf, hf_ref = _is_hf_like(model), _is_hf_like(reference)
    total, n = torch.zeros((), device=device, dtype=torch.float64), 0
    for chunk in _chunks(td, batch_size, device):
        ids = chunk.get(("tokens", "full"))
        resp = chunk.get(("masks", "all_assistant_mask"))
        # logits at t-1 predict token t; a response token t contributes the KL of that prediction
        logp = torch.log_softmax(_logits_of(model, hf, ids).float()[:, :-1], -1)
        logq = torch.log_softmax(_logits_of(reference, hf_ref, ids.to(ref_device)).float()[:, :-1], -1).to(device)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        total += (kl * resp[:, 1:].to(kl.dtype)).sum().double()
        n += ids.shape[0]
    return float(total) / max(n, 1)


def evaluate_preference_model(
    policy: torch.nn.Module,
    data: Any,
    *,
    model: Optional[torch.nn.Module] = None,
    exact_match_n: int = 500,
    batch_size: int = 64,
    kl: bool = True,
    reference: Optional[torch.nn.Module] = None,
) -> dict[str, Optional[float]]:
    """All held-out scores of ``policy`` (a ``CausalLMLogProbs`` or ``CausalLMReward``) on ``data``.

    Args:
        policy: what the algorithm's ``build`` returned as its policy.
        data: the run's :class:`~offline_plugins.text.data.preference.PreferenceData`.

    Keyword Args:
        model: the transformers model inside ``policy`` (for KL and generation).
        exact_match_n: held-out task prompts for exact match (built-in tasks only).
        kl: compute the KL to the reference (False when ``policy`` is the reference).
        reference: the reference to compare with (the run's ``AlgorithmParts.reference``); None: the data's.

    Returns:
        ``preference_accuracy``, ``likelihood_accuracy``, ``kl_to_reference`` and
        ``exact_match`` (None where they do not apply).
    """
    out: dict[str, Optional[float]] = {
        "preference_accuracy": None, "likelihood_accuracy": None, "kl_to_reference": None, "exact_match": None,
    }
    model = model if model is not None else getattr(policy, "model", None)
    was_training = policy.training
    policy.eval()
    try:
        pairs = getattr(data, "test_pairs", None)
        if pairs is not None and pairs.batch_size[0]:
            out.update(pairwise_scores(policy, pairs, batch_size=batch_size))
        is_reward = hasattr(policy, "rewards")
        held_out = pairs if pairs is not None else getattr(data, "test", None)
        if kl and not is_reward and model is not None and held_out is not None and held_out.batch_size[0]:
            reference = reference if reference is not None else data.reference
            out["kl_to_reference"] = kl_to_reference(model, reference, held_out, batch_size=batch_size)
        task = getattr(data, "task", None)
        if not is_reward and model is not None and task is not None and exact_match_n > 0:
            out["exact_match"] = exact_match_accuracy(task, model, data.tokenizer, n=exact_match_n)
    finally:
        policy.train(was_training)
    return out
