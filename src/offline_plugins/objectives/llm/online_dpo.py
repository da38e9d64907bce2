"""Online and iterative DPO: preference pairs labelled from the policy's own rollouts.

The seeds' "iterative DPO is offline-to-online RL" (000/002; 003, 5.6.5 and 5.6.10): sample
``G >= 2`` responses to each prompt from the current policy, label them with the run's reward
(a verifier, a reward function or a reward model: the rollouts' ``("next", "reward")``), and
train a preference loss on the pair

    ``y_w = argmax_i r_i``,  ``y_l = argmin_i r_i``  (first of equals, per prompt),

a pair existing only when ``max_i r_i > min_i r_i``. Guo et al. 2024 (Direct Language Model
Alignment from Online AI Feedback, arXiv:2402.04792) take a step on each fresh batch of such
pairs; Xiong et al. 2024 (Iterative Preference Learning from Human Feedback,
arXiv:2312.11456) and Yuan et al. 2024 (Self-Rewarding Language Models, arXiv:2401.10020)
collect a larger round, train to convergence, and sample the next round from the trained
policy. Yuan et al. pair the highest- against the lowest-scored of several samples and drop
prompts whose samples all score the same, as here; Xu et al. 2023 ("Some things are more
CRINGE than others", arXiv:2312.16682) iterate the same way with their pairwise Cringe loss.

:class:`OnlinePreferenceLoss` wraps any paired loss of
:mod:`offline_plugins.objectives.llm.preference` (DPO, IPO, robust DPO, RPO, ORPO, SimPO),
which computes the per-pair loss unchanged. It adds the two rollout hooks the
``text-rollouts`` kind calls once per round: :meth:`~OnlinePreferenceLoss.process_rollouts`
(per row: does its prompt make a pair) and :meth:`~OnlinePreferenceLoss.pair_rollouts`
(the rollouts ``[P * G]`` -> one pair per prompt ``[P, 2]`` in the preference layout).

Shapes are static: a prompt whose ``G`` rewards are all equal still gives a pair slot (its
first response twice) with ``pair_weight = 0``, so no host sync sizes the batch; the loss is
``sum_b w_b l_b / max(1, sum_b w_b)`` over the minibatch, each ``loss_*`` term of the inner
loss weighted the same way.

The reference of the pair's implicit reward is the run's reference (``reference="initial"``:
``sum_t log pi_ref`` from ``("next", "ref_log_probs", "full")``) or the policy that sampled the
round (``reference="sampler"``: ``sum_t log pi_sample`` from ``("log_probs", "full")``, the
collector's scoring forward of the policy at the round boundary): iterative DPO's "the trained
policy becomes the new reference", with no copy of the model kept.

With a ``judge`` (AI feedback, Guo et al. 2024's online AI feedback; seeds 003, 5.6.9) the pair is
the judge's instead of the reward's: the ``G`` responses to a prompt are compared pairwise, each
pair in both display orders (a verdict that flips with the order is a tie), a win counts 1 and a
tie 1/2 (a round robin; with ``G = 2`` one comparison), chosen the first response with the most
wins, rejected the first with the fewest; no winner (all wins equal) is a tie. ``judge_ties="drop"``
gives a tie weight 0 (as a prompt without a pair); ``"weight"`` keeps it, chosen by the wins in
P(better) averaged over both orders, weighted by their spread ``(max - min) / (G - 1)`` (``|2 p - 1|``
for ``G = 2``: 0 for a judge that flips completely). The reward is still read: its agreement with
the judge is a round statistic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from offline_plugins.objectives.llm.common import PreferenceInputError, PreferenceLossBase, get_checked
from offline_plugins.objectives.llm.preference import KTOLoss
from offline_plugins.objectives.llm.rollout import RolloutLoss

__all__ = ["OnlinePreferenceLoss", "REFERENCES", "JUDGE_TIES"]

#: where the pair's reference log-probs come from
REFERENCES = ("initial", "sampler")
#: what a judge's tie gives: no pair (weight 0), or a pair weighted by the judge's order-averaged confidence
JUDGE_TIES = ("drop", "weight")


class OnlinePreferenceLoss(RolloutLoss):
    """A paired preference loss trained on best-vs-worst pairs of the policy's own rollouts.

    Online DPO (Guo et al. 2024, arXiv:2402.04792) and iterative DPO (Xiong et al. 2024,
    arXiv:2312.11456): for a group of ``G`` responses to one prompt with rewards ``r_1..r_G``,
    chosen ``argmax r``, rejected ``argmin r``, weight ``1[max r > min r]``; the inner loss
    (DPO: ``-log sigmoid(beta * ((log pi_w - log ref_w) - (log pi_l - log ref_l)))``) is
    averaged over the minibatch's pairs of weight 1.

    Args:
        inner: a paired :class:`~offline_plugins.objectives.llm.common.PreferenceLossBase`
            (``DPOLoss``, ``IPOLoss``, ``RobustDPOLoss``, ``RPOLoss``, ``ORPOLoss``,
            ``SimPOLoss``) with its actor, built with ``reduction="none"`` (this loss weights
            and reduces its per-pair terms).

    Keyword Args:
        group_size (int): responses per prompt ``G >= 2``; the rollouts' rows of a prompt are
            contiguous (as :class:`~offline_plugins.text.data.rollouts.RolloutCollector` writes them).
        reference (str): ``"initial"`` (the run's reference) or ``"sampler"`` (the policy that
            sampled the round). Defaults to ``"initial"``.
        dynamic_sampling (bool): ask the collector to replace prompts without a pair by newly
            sampled ones (up to its ``max_attempts``). Defaults to ``False``.
        judge: None (the reward picks the pair) or a judge with ``compare_many([(prompt, a, b)])``
            returning judgements with ``verdict`` (``"a"``, ``"b"``, ``"tie"``) and ``p_a``
            (:class:`~offline_plugins.eval.judge.Judge`): it picks the pair from the rollouts' text.
        judge_ties (str): ``"drop"`` (a tie weighs 0) or ``"weight"`` (see above). Defaults to ``"drop"``.

    With a judge, :meth:`process_rollouts` writes ``("stats", "judge_ties")`` (1 where the prompt's
    verdict is a tie) and ``("stats", "judge_agreement")`` (1 where the judge's chosen has the
    higher reward, 0 the lower, NaN for a tie or equal rewards); the collector logs their means
    as ``rollout/judge_ties`` and ``rollout/judge_agreement``.

    The inner loss's diagnostics (``preference_accuracy``, ``reward_margin``...) are means over
    every pair slot of the minibatch, tie slots included (margin exactly 0 there);
    ``pair_fraction`` is the share of slots that are real pairs.

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> from offline_plugins.objectives.llm import DPOLoss
        >>> from offline_plugins.objectives.llm.online import _example_rollouts
        >>> _ = torch.manual_seed(0)
        >>> loss = OnlinePreferenceLoss(DPOLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)), reduction="none"),
        ...                             group_size=3)
        >>> rollouts = loss.process_rollouts(_example_rollouts(torch.randint(0, 6, (6, 5)),
        ...                                  [0., 1., 0., 1., 1., 1.], [0, 0, 0, 1, 1, 1]))
        >>> rollouts["has_signal"].tolist()
        [True, True, True, False, False, False]
        >>> pairs = loss.pair_rollouts(rollouts)
        >>> pairs.batch_size, pairs["pair_weight"][:, 0].tolist()
        (torch.Size([2, 2]), [1.0, 0.0])
        >>> out = loss(pairs)
        >>> sorted(k for k in out.keys() if k.startswith("loss_")), out["pair_fraction"].item()
        (['loss_dpo'], 0.5)
    """

    @dataclass
    class _AcceptedKeys(RolloutLoss._AcceptedKeys):
        """The rollout keys of :class:`~offline_plugins.objectives.llm.rollout.RolloutLoss` (the pairing reads
        ``reward``, ``group``, ``ref_log_probs`` for ``reference="initial"`` and ``sample_log_probs`` for
        ``reference="sampler"``), plus ``pair_weight``: where the pairs carry their weight,
        ``"pair_weight"`` (``[P, 2]``); ``judge_wins``: where :meth:`process_rollouts` writes each response's
        round-robin wins and order-averaged P(better) summed, ``"judge_wins"`` (``[P * G, 2]``; with a judge).

        The token and mask keys the pairs are read from and written at are the inner loss's
        (``inner.tensor_keys``).
        """

        pair_weight: NestedKey = "pair_weight"
        judge_wins: NestedKey = "judge_wins"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(self, inner: PreferenceLossBase, *, group_size: int, reference: str = "initial",
                 dynamic_sampling: bool = False, judge=None, judge_ties: str = "drop") -> None:
        super().__init__()
        if isinstance(inner, KTOLoss) or not isinstance(inner, PreferenceLossBase):
            raise PreferenceInputError(
                f"OnlinePreferenceLoss trains a paired preference loss (DPOLoss, IPOLoss, RobustDPOLoss, RPOLoss, "
                f"ORPOLoss, SimPOLoss), got {type(inner).__name__}; KTO reads unpaired rows with a mismatched-"
                f"prompt KL estimate that rollout groups do not carry")
        if inner.reduction != "none":
            raise PreferenceInputError(
                f"OnlinePreferenceLoss weights the inner loss's per-pair terms itself (tie slots weigh 0): build "
                f"{type(inner).__name__}(..., reduction='none'), got reduction={inner.reduction!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise PreferenceInputError(f"OnlinePreferenceLoss: group_size must be a whole number >= 2 (a pair needs "
                                       f"two responses to one prompt), got {group_size!r}")
        if reference not in REFERENCES:
            raise PreferenceInputError(f"OnlinePreferenceLoss: reference must be one of {', '.join(REFERENCES)}, "
                                       f"got {reference!r}")
        if judge is not None and not callable(getattr(judge, "compare_many", None)):
            raise PreferenceInputError(f"OnlinePreferenceLoss: judge must have compare_many([(prompt, a, b)]) (an "
                                       f"offline_plugins.eval.judge.Judge), got {type(judge).__name__}")
        if judge_ties not in JUDGE_TIES:
            raise PreferenceInputError(f"OnlinePreferenceLoss: judge_ties must be one of {', '.join(JUDGE_TIES)}, got "
                                       f"{judge_ties!r}")
        self.judge, self.judge_ties = judge, judge_ties
        self.inner = inner
        self.group_size = int(group_size)
        self.reference = reference
        self.dynamic_sampling = bool(dynamic_sampling)

    @property
    def actor_network(self):
        return self.inner.actor_network

    @property
    def in_keys(self):
        return [*self.inner.in_keys, self.tensor_keys.pair_weight]

    @property
    def out_keys(self):
        return ["pair_fraction"]

    def _grouped_rewards(self, td: TensorDictBase) -> torch.Tensor:
        n, g = td.numel(), self.group_size
        if td.batch_dims != 1 or n % g:
            raise PreferenceInputError(
                f"OnlinePreferenceLoss: rollouts must be [P * G] rows with G = group_size = {g} contiguous rows per "
                f"prompt, got batch_size {tuple(td.batch_size)}; sample them with "
                f"offline_plugins.text.data.rollouts.RolloutCollector(group_size={g})")
        return self.rollout_rewards(td).reshape(n // g, g)

    # -- once per round --------------------------------------------------------
    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Write ``"has_signal"`` per row: its prompt's rewards differ, so it gives a pair.

        The collector's ``groups_without_signal`` is then the share of prompts without a pair.
        """
        reward = self._grouped_rewards(td)
        if self.judge is None:
            pair = reward.amax(-1) > reward.amin(-1)
        else:
            _, weight = self._judge_pairs(td, reward)
            pair = weight > 0
        td.set("has_signal", pair.repeat_interleave(self.group_size))
        return td

    def _judge_pairs(self, td: TensorDictBase, reward: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-robin verdicts of the judge on each prompt's responses, both orders: ``(scores [P, G],
        weight [P])``; writes ``judge_wins`` and the round's ``("stats", ...)`` (once per round, on the host)."""
        p, g = reward.shape
        text = td.get(("text", "prompt"), None), td.get(("text", "response"), None)
        if text[0] is None or text[1] is None:
            raise PreferenceInputError("OnlinePreferenceLoss: a judge reads the rollouts' text at ('text', 'prompt') "
                                       "and ('text', 'response'), which these rollouts lack; sample them with "
                                       "offline_plugins.text.data.rollouts.RolloutCollector")
        prompts, responses = ([str(x) for x in (t.tolist() if hasattr(t, "tolist") else list(t))] for t in text)
        ij = [(i, j) for i in range(g) for j in range(i + 1, g)]
        if td.device is not None and callable(getattr(self.judge, "to", None)):
            self.judge.to(td.device)  # a model judge runs where the rollouts are (the policy's device)
        judged = self.judge.compare_many([(prompts[k * g], responses[k * g + i], responses[k * g + j])
                                          for k in range(p) for i, j in ij])
        wins = torch.zeros(p, g, 2, dtype=torch.float64)  # [..., 0] round-robin wins, [..., 1] P(better) summed
        for n, jd in enumerate(judged):
            k, (i, j) = n // len(ij), ij[n % len(ij)]
            a = {"a": 1.0, "tie": 0.5, "b": 0.0}[jd.verdict]
            wins[k, i] += torch.tensor([a, jd.p_a], dtype=torch.float64)
            wins[k, j] += torch.tensor([1.0 - a, 1.0 - jd.p_a], dtype=torch.float64)
        wins = wins.to(device=reward.device, dtype=torch.float32)
        td.set(self.tensor_keys.judge_wins, wins.reshape(p * g, 2))
        scores, weight = self._judge_scores(wins)
        decided = wins[..., 0].amax(-1) > wins[..., 0].amin(-1)
        picked = reward.gather(-1, torch.stack([scores.argmax(-1), scores.argmin(-1)], -1))
        agrees = torch.where(decided & (picked[:, 0] != picked[:, 1]), (picked[:, 0] > picked[:, 1]).float(),
                             torch.full_like(picked[:, 0], float("nan")))
        td.set(("stats", "judge_ties"), (~decided).float().repeat_interleave(g))
        td.set(("stats", "judge_agreement"), agrees.repeat_interleave(g))
        return scores, weight

    def _judge_scores(self, wins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [P, G], weight [P])`` from ``judge_wins`` ``[P, G, 2]``: the hard wins where they have a
        winner; a tie weighs 0 (``"drop"``) or is scored by P(better), weighted by its spread (``"weight"``)."""
        hard, soft = wins[..., 0], wins[..., 1]
        decided = hard.amax(-1) > hard.amin(-1)
        if self.judge_ties == "drop":
            return hard, decided.to(torch.float32)
        spread = (soft.amax(-1) - soft.amin(-1)) / (self.group_size - 1)
        return (torch.where(decided.unsqueeze(-1), hard, soft),
                torch.where(decided, torch.ones_like(spread), spread).to(torch.float32))

    def pair_rollouts(self, td: TensorDictBase) -> TensorDict:
        """One pair per prompt, ``[P, 2]`` in the preference layout: index 0 the first best, 1 the
        first worst response, with ``pair_weight`` 1 (0 where all ``G`` rewards are equal).

        Writes the inner loss's token and mask keys, its ``ref_log_prob`` (the reference's log-prob
        of each response summed over its tokens, fp32), ``("next", "reward")`` ``[P, 2, 1]`` and
        ``"group"``. Runs once per round (it checks the group ids, one host sync).
        """
        keys, inner = self.tensor_keys, self.inner.tensor_keys
        g = self.group_size
        reward = self._grouped_rewards(td)
        p = reward.shape[0]
        group = self._get(td, "group", "the prompt ids").reshape(p, g)
        if not bool((group == group[:, :1]).all()):
            raise PreferenceInputError(
                f"OnlinePreferenceLoss: the rollouts' {keys.group!r} ids must be constant over each run of "
                f"group_size = {g} rows (a prompt's responses contiguous); sort the rows by prompt first")
        if self.judge is None:
            scores, weight = reward, (reward.amax(-1) > reward.amin(-1)).to(torch.float32)
        else:  # the verdicts written by process_rollouts (kept in checkpoints with the round's rollouts)
            wins = self._get(td, "judge_wins", "the judge's verdicts (written by loss.process_rollouts)")
            scores, weight = self._judge_scores(wins.reshape(p, g, 2))
        best, worst = scores.argmax(-1), scores.argmin(-1)
        rows = torch.arange(p, device=reward.device).unsqueeze(-1) * g + torch.stack([best, worst], -1)
        mask = get_checked(td, inner.response_mask, what="the response-token mask", loss=type(self).__name__,
                           setter="response_mask")
        pairs = TensorDict(batch_size=[p, 2], device=td.device)
        for key, name in ((inner.tokens, "tokens"), (inner.attention_mask, "attention_mask")):
            pairs.set(key, get_checked(td, key, what=f"the rollouts' {name}", loss=type(self).__name__,
                                       setter=name)[rows])
        pairs.set(inner.response_mask, mask[rows])
        ref_key = keys.ref_log_probs if self.reference == "initial" else keys.sample_log_probs
        ref = td.get(ref_key, None)
        if ref is None and (self.inner.uses_reference or self.reference == "sampler"):
            fix = ("sample the rollouts with a reference (RolloutCollector(source, tokenizer, reference)) or use "
                   "reference='sampler'" if self.reference == "initial" else "score the rollouts with the sampling "
                   "policy (RolloutCollector does)")
            raise PreferenceInputError(f"OnlinePreferenceLoss (reference={self.reference!r}) needs per-token "
                                       f"log-probs at {ref_key!r}, which the rollouts lack; {fix}")
        if ref is not None:
            per_seq = (ref.to(torch.float32) * mask.to(torch.float32)).sum(-1)
            pairs.set(inner.ref_log_prob, per_seq[rows])
        pairs.set(keys.reward, reward.reshape(-1, 1)[rows])
        pairs.set(keys.group, group[:, :2])
        pairs.set(keys.pair_weight, weight.unsqueeze(-1).expand(p, 2).clone())
        return pairs

    # -- every step ------------------------------------------------------------
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        weight = self._get(tensordict, "pair_weight", "the pair weights (written by loss.pair_rollouts)")
        weight = weight[..., 0].to(torch.float32)
        out = self.inner(tensordict)
        total = weight.sum().clamp_min(1)
        for key in [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]:
            value = out.get(key)
            if value.shape != weight.shape:
                raise PreferenceInputError(
                    f"OnlinePreferenceLoss: the inner loss's {key} has shape {tuple(value.shape)}, expected one "
                    f"value per pair {tuple(weight.shape)}; build it with reduction='none'")
            out.set(key, (value * weight).sum() / total)
        out.set("pair_fraction", weight.mean().detach())
        return out
