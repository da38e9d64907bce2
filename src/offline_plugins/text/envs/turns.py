"""A batch of multi-turn episodes between turns: what the text environment's ``step`` advances by one turn.

:class:`Turns` holds each episode's tokens so far (prompt + turns + tool observations), which of them
are the policy's, the sampling log-probs, the turn rewards and the counts. A turn goes:
:meth:`Turns.batches` says what to sample (the unfinished episodes, grouped by the room each has left,
so a long episode near the width does not cut the others' turns short); the policy samples each batch;
:meth:`Turns.take` places each episode's sampled tokens, cut after the first tool call's closing tag
(a turn sampled past it is the same sample of its prefix: what follows is dropped with its
log-probs), runs the calls in the :class:`~offline_plugins.text.tools.tools.ToolBox` and appends their
answers, tokenised, as the observation. A turn with no call, one that ends at eos, the last turn, or
an episode with no room left ends the episode; its last turn's text is its answer. :meth:`Turns.finish`
gives the episodes, right-padded to the width, in one copy to the device.

Nothing a response holds raises out of a turn (the toolbox turns it into a failed call the policy
sees); when calls crashed (the tool's own code raised), :meth:`Turns.finish` makes each such tool's
health call (:meth:`~offline_plugins.text.tools.tools.ToolBox.broken`): a tool that fails it too stops
the run (the tool or its sandbox is broken); otherwise the responses made it crash, and the crashes
are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from offline_plugins.text.tools.multiturn import FAILURE_KINDS, MultiTurn
from offline_plugins.text.tools.tools import ToolError
from offline_plugins.tokens import pad_token_id

__all__ = ["Episodes", "TurnBatch", "Turns"]


@dataclass(frozen=True)
class TurnBatch:
    """One ``generate`` of a step: ``num_samples`` responses to each of ``prompt_ids`` of at most
    ``max_new_tokens`` tokens, for the env rows ``rows`` (None: every row, in order).

    ``seed_parts`` names the batch within the round (turn, and its index among the turn's batches when
    not the first); the sampler seeds it with ``rollout_seed(round_seed, *seed_parts)`` (the round's
    seed itself when empty), so a resumed run re-samples the same episodes.
    """

    rows: Optional[list[int]]
    prompt_ids: list[list[int]]
    max_new_tokens: int
    num_samples: int = 1
    seed_parts: tuple[int, ...] = ()


@dataclass
class Episodes:
    """Finished episodes, one row each, right-padded to ``width``.

    Attributes:
        tokens, attention_mask, assistant_mask: ``[B, width]`` prompt + turns + observations;
            the assistant mask is True on the policy's tokens only.
        log_probs: ``[B, width]`` the sampling log-prob of each policy token, 0 elsewhere.
        turn_rewards: ``[B, width]`` each turn's reward (``multiturn.turn_reward``) on its last token.
        answers: the final answers (the last turn's text).
        transcripts: what the policy wrote and was shown, after the prompt.
        counts: ``{name: [B] float}``: ``turns``, ``tool_calls``, ``tool_failures``,
            ``tool_failures_<kind>`` and ``turn_reward`` (the episode's sum of turn rewards).
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    assistant_mask: torch.Tensor
    log_probs: torch.Tensor
    turn_rewards: torch.Tensor
    answers: list[str]
    transcripts: list[str]
    counts: dict[str, torch.Tensor]


def _stop_at(tokenizer: Any, seq: list[int], stop: str) -> int:
    """The number of tokens of ``seq`` up to the one that completes ``stop`` (all of them without it)."""
    if stop not in tokenizer.decode(seq, skip_special_tokens=True):
        return len(seq)
    return next(k for k in range(1, len(seq) + 1) if stop in tokenizer.decode(seq[:k], skip_special_tokens=True))


class Turns:
    """Episodes from ``prompt_ids`` (one list of ids per episode), up to ``multiturn.max_turns`` turns of
    at most ``max_new_tokens`` tokens each, each whole episode within ``width`` tokens (a turn is cut at
    the room its episode has left), their log-probs on ``device``."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], multiturn: MultiTurn, *, width: int,
                 max_new_tokens: int, device: Any = "cpu") -> None:
        self.tokenizer, self.multiturn = tokenizer, multiturn
        self.width, self.max_new_tokens, self.device = int(width), int(max_new_tokens), device
        self.pad, self.eos = pad_token_id(tokenizer), tokenizer.eos_token_id
        n = len(prompt_ids)
        # the prompts' text, for the turn reward only
        self.prompts = ([tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids]
                        if multiturn.turn_reward is not None else None)
        self.seqs = [list(p) for p in prompt_ids]
        self.policy: list[list[int]] = [[] for _ in range(n)]  # positions of each episode's policy tokens
        self.answers, self.transcripts = [""] * n, [""] * n
        self.counts = {k: [0.0] * n for k in ("turns", "tool_calls", "tool_failures",
                                              *(f"tool_failures_{f}" for f in FAILURE_KINDS), "turn_reward")}
        self.turn_rewards: list[tuple[int, int, float]] = []  # (episode, its turn's last token, reward)
        self.last_crash, self.crashed = "", set()  # the last crash's text, the tools that crashed
        self.log_probs = torch.zeros(n, self.width, device=device)
        self.active = list(range(n))
        self.turn = 0
        self._budgets: dict[int, int] = {}

    @property
    def running(self) -> list[int]:
        """The episodes that take another turn: not ended, with room left, before the turn limit."""
        if self.turn >= self.multiturn.max_turns:
            return []
        return [i for i in self.active if len(self.seqs[i]) < self.width]

    @property
    def done(self) -> bool:
        """Every episode has ended."""
        return not self.running

    def batches(self) -> list[TurnBatch]:
        """What this turn samples: the unfinished episodes with room left, one batch per budget (the room
        each has left, up to ``max_new_tokens``), the largest first; ``seed_parts`` ``(turn, k)``."""
        self.active = [i for i in self.active if len(self.seqs[i]) < self.width]  # no room left: it ends
        self._budgets = {i: min(self.max_new_tokens, self.width - len(self.seqs[i])) for i in self.active}
        out = []
        for k, budget in enumerate(sorted(set(self._budgets.values()), reverse=True)):
            rows = [i for i in self.active if self._budgets[i] == budget]
            out.append(TurnBatch(rows, [self.seqs[i] for i in rows], budget, 1, (self.turn, *([k] if k else []))))
        return out

    def take(self, tokens: torch.Tensor, lengths: torch.Tensor, log_probs: Optional[torch.Tensor] = None) -> None:
        """Place the turn: row ``i`` of ``tokens`` (``[B, K]``) holds the ``lengths[i]`` tokens episode ``i``
        sampled (rows of ended episodes are ignored), ``log_probs`` (``[B, K]``) their sampling log-probs
        (None: greedy). A turn longer than the room its episode has left is cut to it."""
        multiturn, eos, turn = self.multiturn, self.eos, self.turn
        if tokens.dim() != 2 or tokens.shape[0] != len(self.seqs) or lengths.shape != tokens.shape[:1]:
            raise ToolError(f"a turn of {len(self.seqs)} episodes needs tokens [{len(self.seqs)}, K] and lengths "
                            f"[{len(self.seqs)}], got {tuple(tokens.shape)} and {tuple(lengths.shape)}")
        self.active = [i for i in self.active if len(self.seqs[i]) < self.width]
        rows, counts = tokens.tolist(), lengths.tolist()  # the turn's one host copy
        sampled = {i: rows[i][:min(int(counts[i]), self.max_new_tokens, self.width - len(self.seqs[i]))]
                   for i in self.active}
        src: list[tuple[int, int]] = []  # (episode, step in the turn) -> (episode, position)
        dst: list[tuple[int, int]] = []
        still = []
        for i in self.active:
            seq = sampled[i]
            seq = seq[:_stop_at(self.tokenizer, seq, multiturn.stop)]
            src.extend((i, step) for step in range(len(seq)))
            dst.extend((i, len(self.seqs[i]) + step) for step in range(len(seq)))
            self.policy[i] += range(len(self.seqs[i]), len(self.seqs[i]) + len(seq))
            self.seqs[i] += seq
            text = self.tokenizer.decode(seq, skip_special_tokens=True)
            self.answers[i] = text
            self.transcripts[i] += text
            self.counts["turns"][i] += 1
            if (eos is not None and seq and seq[-1] == eos) or turn == multiturn.max_turns - 1:
                continue  # the policy stopped, or the turn limit: this turn's text is the answer
            results = multiturn.tools.run_response(text)
            for r in results:
                self.counts["tool_calls"][i] += r.failure != "malformed"
                if not r.ok:
                    self.counts["tool_failures"][i] += 1
                    self.counts[f"tool_failures_{r.failure}"][i] += 1
                    if r.failure == "crash":
                        self.last_crash = r.text
                        self.crashed.add(r.tool)
            if not results:
                continue
            if multiturn.turn_reward is not None and seq:
                value = float(multiturn.turn_reward(self.prompts[i], results))
                self.turn_rewards.append((i, len(self.seqs[i]) - 1, value))
                self.counts["turn_reward"][i] += value
            obs = self.tokenizer(multiturn.observe([r.text for r in results]),
                                 add_special_tokens=False)["input_ids"]
            obs = obs[:min(multiturn.max_observation_tokens, self.width - len(self.seqs[i]))]
            self.seqs[i] += obs
            self.transcripts[i] += self.tokenizer.decode(obs, skip_special_tokens=True)
            still.append(i)
        if src and log_probs is not None:  # the turn's log-probs, placed on the device
            (si, sk), (di, dp) = (torch.tensor(list(zip(*src)), device=log_probs.device),
                                  torch.tensor(list(zip(*dst)), device=self.log_probs.device))
            self.log_probs[di, dp] = log_probs[si, sk].float().to(self.log_probs.device)
        self.active = still
        self.turn += 1

    def finish(self) -> Episodes:
        """The episodes, right-padded to the width (one copy to the device); raises ``ToolError`` when a
        tool that crashed this round also fails its own health call."""
        calls, crashes = sum(self.counts["tool_calls"]), sum(self.counts["tool_failures_crash"])
        if self.crashed:  # a response can make a tool crash; the run stops only when the tool fails its health call
            broken = self.multiturn.tools.broken(sorted(self.crashed), all_crashed=bool(calls) and crashes == calls)
            if broken is not None:
                raise ToolError(f"a tool is broken: {broken} ({int(crashes)} of the round's {int(calls)} calls "
                                f"crashed; the last: {self.last_crash}); it fails whatever the policy asks: fix the "
                                "tool or its sandbox ('offline-plugins list' says whether each sandbox works here)")
        n, width = len(self.seqs), self.width
        full = torch.full((n, width), self.pad, dtype=torch.long)
        attn = torch.zeros(n, width, dtype=torch.bool)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, seq in enumerate(self.seqs):
            full[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = True
            mask[i, self.policy[i]] = True
        shaped = torch.zeros(n, width)
        for i, pos, value in self.turn_rewards:
            shaped[i, pos] += value
        both = torch.cat([full.double(), attn.double(), mask.double(), shaped.double(),
                          torch.tensor(list(self.counts.values()), dtype=torch.float64).T], 1).to(self.device)
        return Episodes(both[:, :width].long(), both[:, width:2 * width].bool(), both[:, 2 * width:3 * width].bool(),
                        self.log_probs, both[:, 3 * width:4 * width].float(), self.answers, self.transcripts,
                        {k: both[:, 4 * width + c].float() for c, k in enumerate(self.counts)})
