"""The multi-turn round: episodes of turns and tool observations, written as TED text rows.

When the prompt source carries a :class:`~offline_plugins.envs.multiturn.MultiTurn`, the
:class:`~offline_plugins.data.collector.RolloutCollector` runs each round's episodes here
(:func:`multiturn_rows`): turn ``t`` of every unfinished episode is one batched ``generate``
seeded with ``rollout_seed(round_seed, t)`` (so a resumed run re-samples the same episodes),
cut after the first ``</tool>`` (a turn sampled past it is the same sample of its prefix: what
follows is dropped with its log-probs); the turn's calls run in the
:class:`~offline_plugins.envs.tools.ToolBox` and their answers are appended, tokenised, as the
observation; a turn with no call, one that ends at eos, or the last turn ends the episode, and the
source's reward (through the collector's :class:`~offline_plugins.data.prompts.RewardGuard`)
scores its final answer, the text of its last turn. With a ``turn_reward`` each turn that called
tools is also scored from its calls' results. Nothing a response holds raises out of a round (the
:class:`~offline_plugins.envs.tools.ToolBox` turns it into a failed call the policy sees). A row is prompt + turns + observations:
``("masks", "all_assistant_mask")`` and ``("log_probs", "full")`` (the sampling log-probs) cover
the policy's own tokens only, so the losses, the KL and the token counts never train on or count
prompt or tool-output tokens. ``("next", "turn_reward")`` (``[B, T]``) holds each turn's reward on
its last token and the verifier's on the last turn's, and ``("next", "reward")`` is the episode's
return, their sum: the group methods read the return, REINFORCE++ its per-token rewards (each
token's return is the rewards of the turns ending at or after it). Per-episode counts go under
``"stats"`` (the round's means: ``rollout/tool_calls``, ``rollout/tool_failures``,
``rollout/tool_failures_<kind>``, ``rollout/turns``, ``rollout/turn_reward``). When calls of a round
crashed (the tool's own code raised), the round makes each such tool's health call
(:meth:`~offline_plugins.envs.tools.ToolBox.broken`): a tool that fails it too stops the run (the
tool or its sandbox is broken); otherwise the responses made it crash, and the crashes are counted.

Why not TorchRL's ``ChatEnv`` with its ``History`` and tool transforms: a ``History`` is text
re-rendered through a chat template each turn, so the tokens a loss reads are a re-tokenisation,
not the tokens sampled (the PPO ratio needs those), and its turns are the wrapper's ``generate``
calls, where ours are one seeded batched ``generate`` per turn; the call format is TorchRL's
(``XMLBlockParser``, :mod:`offline_plugins.envs.tools`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from offline_plugins.data.prompts import rollout_seed
from offline_plugins.envs.multiturn import FAILURE_KINDS, MultiTurn
from offline_plugins.envs.tools import ToolError
from offline_plugins.modules.generation import generate
from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = ["Episodes", "run_episodes", "multiturn_rows", "greedy_final_answers"]


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


@torch.no_grad()
def run_episodes(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], multiturn: MultiTurn,
                 *, width: int, max_new_tokens: int, seed: Optional[int] = None, greedy: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, generator: Any = None) -> Episodes:
    """One episode per prompt (``prompt_ids``, one list of ids per row), up to ``multiturn.max_turns``
    turns of at most ``max_new_tokens`` tokens each, the whole row within ``width`` tokens: a row's
    turn is cut at the room it has left, and an episode with no room left ends. ``generator``: an
    engine with :func:`generate`'s contract."""
    device = next(model.parameters()).device
    pad, eos = pad_token_id(tokenizer), tokenizer.eos_token_id
    n = len(prompt_ids)
    # the prompts' text, for the turn reward only
    prompts = ([tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids]
               if multiturn.turn_reward is not None else None)
    seqs = [list(p) for p in prompt_ids]
    policy: list[list[int]] = [[] for _ in range(n)]  # positions of each row's policy tokens
    answers, transcripts = [""] * n, [""] * n
    counts = {k: [0.0] * n for k in ("turns", "tool_calls", "tool_failures",
                                     *(f"tool_failures_{f}" for f in FAILURE_KINDS), "turn_reward")}
    turn_rewards: list[tuple[int, int, float]] = []  # (row, position of the turn's last token, reward)
    last_crash, crashed = "", set()  # the last crash's text, the tools that crashed this round
    log_probs = torch.zeros(n, width, device=device)
    active = list(range(n))
    for turn in range(multiturn.max_turns):
        active = [i for i in active if len(seqs[i]) < width]  # an episode with no room left ends
        if not active:
            break
        # each row's budget is the room it has left, up to max_new_tokens (no row may run past the width, nor
        # the model's positions); rows with the same budget share one generate: all of them until rows near
        # the width differ, and then a long row no longer cuts the others' turns short
        budgets = {i: min(max_new_tokens, width - len(seqs[i])) for i in active}
        generated: dict[int, tuple[list[int], int, int]] = {}  # row -> (its tokens, its batch, its index there)
        batch_log_probs = []  # per batch: the sampled log-probs ([rows, steps], or None when greedy)
        for k, budget in enumerate(sorted(set(budgets.values()), reverse=True)):
            rows = [i for i in active if budgets[i] == budget]
            kwargs = dict(pad_id=pad, eos_id=eos, max_new_tokens=budget, temperature=temperature, top_p=top_p,
                          seed=None if seed is None else rollout_seed(seed, turn, *([k] if k else [])))
            ids = [seqs[i] for i in rows]
            out = (generator.generate(ids, device=device, **kwargs) if generator is not None
                   else generate(model, ids, greedy=greedy, log_probs=not greedy, **kwargs))
            batch_log_probs.append(out.log_probs)
            for j, (i, toks, length) in enumerate(zip(rows, out.tokens.tolist(), out.lengths.tolist())):
                generated[i] = (toks[:length], k, j)
        placed = [([], []) for _ in batch_log_probs]  # per batch: (batch row, step) -> (episode row, position)
        still = []
        for i in active:
            seq, k, j = generated[i]
            seq = seq[:_stop_at(tokenizer, seq, multiturn.stop)]
            placed[k][0].extend((j, step) for step in range(len(seq)))
            placed[k][1].extend((i, len(seqs[i]) + step) for step in range(len(seq)))
            policy[i] += range(len(seqs[i]), len(seqs[i]) + len(seq))
            seqs[i] += seq
            text = tokenizer.decode(seq, skip_special_tokens=True)
            answers[i] = text
            transcripts[i] += text
            counts["turns"][i] += 1
            if (eos is not None and seq and seq[-1] == eos) or turn == multiturn.max_turns - 1:
                continue  # the policy stopped, or the turn limit: this turn's text is the answer
            results = multiturn.tools.run_response(text)
            for r in results:
                counts["tool_calls"][i] += r.failure != "malformed"
                if not r.ok:
                    counts["tool_failures"][i] += 1
                    counts[f"tool_failures_{r.failure}"][i] += 1
                    if r.failure == "crash":
                        last_crash = r.text
                        crashed.add(r.tool)
            if not results:
                continue
            if multiturn.turn_reward is not None and seq:
                value = float(multiturn.turn_reward(prompts[i], results))
                turn_rewards.append((i, len(seqs[i]) - 1, value))
                counts["turn_reward"][i] += value
            obs = tokenizer(multiturn.observe([r.text for r in results]), add_special_tokens=False)["input_ids"]
            obs = obs[:min(multiturn.max_observation_tokens, width - len(seqs[i]))]
            seqs[i] += obs
            transcripts[i] += tokenizer.decode(obs, skip_special_tokens=True)
            still.append(i)
        for batch_lp, (src, dst) in zip(batch_log_probs, placed):  # the turn's log-probs, placed on device
            if src and batch_lp is not None:
                (sj, sk), (di, dp) = (torch.tensor(list(zip(*src)), device=device),
                                      torch.tensor(list(zip(*dst)), device=device))
                log_probs[di, dp] = batch_lp[sj, sk].float()
        active = still
    calls, crashes = sum(counts["tool_calls"]), sum(counts["tool_failures_crash"])
    if crashed:  # a response can make a tool crash; the run stops only when the tool fails its own health call
        broken = multiturn.tools.broken(sorted(crashed), all_crashed=bool(calls) and crashes == calls)
        if broken is not None:
            raise ToolError(f"a tool is broken: {broken} ({int(crashes)} of the round's {int(calls)} calls crashed; "
                            f"the last: {last_crash}); it fails whatever the policy asks: fix the tool or its "
                            "sandbox ('offline-plugins list' says whether each sandbox works here)")
    full = torch.full((n, width), pad, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.bool)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        full[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = True
        mask[i, policy[i]] = True
    shaped = torch.zeros(n, width)
    for i, pos, value in turn_rewards:
        shaped[i, pos] += value
    both = torch.cat([full.double(), attn.double(), mask.double(), shaped.double(),
                      torch.tensor(list(counts.values()), dtype=torch.float64).T], 1).to(device)  # one copy
    return Episodes(both[:, :width].long(), both[:, width:2 * width].bool(), both[:, 2 * width:3 * width].bool(),
                    log_probs, both[:, 3 * width:4 * width].float(), answers, transcripts,
                    {k: both[:, 4 * width + c].float() for c, k in enumerate(counts)})


def multiturn_rows(collector: Any, model: torch.nn.Module, env: Any, td: TensorDict, seed: int) -> TensorDict:
    """The round's rows in the TED text layout (the collector's ``_ROW_KEYS`` and ``"stats"``): the
    episodes of ``env``'s prompts after ``reset``, sampled with ``seed``, scored by ``env.score``."""
    g = env.group_size
    ep = run_episodes(model, collector.tokenizer, [env.prompt_ids[i // g] for i in range(len(env.rows))],
                      collector.source.multiturn, width=collector.width, max_new_tokens=collector.max_new_tokens,
                      seed=seed, temperature=collector.temperature, top_p=collector.top_p,
                      generator=collector.generator)
    device = ep.tokens.device
    values, parts = env.score_parts(env.rows, ep.answers)
    verifier = torch.tensor(values, dtype=torch.float32, device=device)
    # the verifier's reward on the last policy token, beside the turns' own
    last = ep.assistant_mask.long().cumsum(-1).argmax(-1, keepdim=True)
    per_token = ep.turn_rewards.scatter_add(1, last, verifier.unsqueeze(-1))
    reward = per_token.sum(-1, keepdim=True)
    done = torch.ones_like(reward, dtype=torch.bool)
    row = TensorDict({"tokens": {"full": ep.tokens},
                      "masks": {"all_attention_mask": ep.attention_mask, "all_assistant_mask": ep.assistant_mask},
                      "log_probs": {"full": ep.log_probs},
                      "next": {"reward": reward, "turn_reward": per_token, "done": done,
                               "terminated": done.clone()},
                      "response_length": ep.assistant_mask.sum(-1).float(), "group": td.get("group"),
                      "stats": ep.counts}, batch_size=[len(env.rows)], device=device)
    if parts is not None:  # several rewards of the final answer, side by side (gdpo reads them)
        row.set(("next", "reward_components"), torch.tensor(parts, dtype=torch.float32, device=device).T.contiguous())
    row.set(("text", "prompt"), td.get(("text", "prompt")))
    row.set(("text", "response"), NonTensorStack.from_list(ep.transcripts))
    return row


def greedy_final_answers(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], multiturn: MultiTurn, *,
                         width: int, max_new_tokens: int, batch_size: int = 100) -> list[str]:
    """The final answers of greedy episodes from ``prompts``, ``batch_size`` episodes at a time."""
    ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    return [a for s in range(0, len(ids), batch_size)
            for a in run_episodes(model, tokenizer, ids[s:s + batch_size], multiturn, width=width,
                                  max_new_tokens=max_new_tokens, greedy=True).answers]
