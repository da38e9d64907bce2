"""Multi-turn episodes outside a round: :func:`run_episodes` (episodes of given prompts, sampled or greedy)
and :func:`greedy_final_answers` (what held-out evaluation scores).

A round's multi-turn episodes are the rollout collector's (:class:`~offline_plugins.text.collectors.collector.RolloutCollector`):
it steps the text environment one turn at a time (:class:`~offline_plugins.text.envs.text.TextEnv` with a
:class:`~offline_plugins.text.tools.multiturn.MultiTurn`), as it steps a single-turn episode once. The
functions here drive the same turns (:class:`~offline_plugins.text.envs.turns.Turns`) with the same
sampler (:func:`~offline_plugins.text.collectors.collector.sample_turn`) over prompts given as ids,
with no reward: turn ``t`` of every unfinished episode is one batched ``generate`` seeded with
``rollout_seed(seed, t)`` (one more batch per distinct budget when episodes near the width have less
room), so the same seed gives the same episodes.

A row is prompt + turns + observations: ``("masks", "all_assistant_mask")`` and ``("log_probs",
"full")`` (the sampling log-probs) cover the policy's own tokens only, so the losses, the KL and the
token counts never train on or count prompt or tool-output tokens; ``("next", "turn_reward")``
(``[B, T]``) holds each turn's reward on its last token and the verifier's on the last turn's, and
``("next", "reward")`` is the episode's return, their sum: the group methods read the return,
REINFORCE++ its per-token rewards (each token's return is the rewards of the turns ending at or after
it). Per-episode counts go under ``"stats"`` (the round's means: ``rollout/tool_calls``,
``rollout/tool_failures``, ``rollout/tool_failures_<kind>``, ``rollout/turns``, ``rollout/turn_reward``).

Why not TorchRL's ``ChatEnv`` with its ``History`` and tool transforms: a ``History`` is text
re-rendered through a chat template each turn, so the tokens a loss reads are a re-tokenisation,
not the tokens sampled (the PPO ratio needs those), and its turns are the wrapper's ``generate``
calls, where ours are one seeded batched ``generate`` per turn; the call format is TorchRL's
(``XMLBlockParser``, :mod:`offline_plugins.text.tools.tools`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from offline_plugins.text.collectors.collector import sample_turn
from offline_plugins.text.envs.turns import Episodes, Turns
from offline_plugins.text.tools.multiturn import MultiTurn
from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = ["Episodes", "run_episodes", "greedy_final_answers"]


@torch.no_grad()
def run_episodes(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], multiturn: MultiTurn,
                 *, width: int, max_new_tokens: int, seed: Optional[int] = None, greedy: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, generator: Any = None) -> Episodes:
    """One episode per prompt (``prompt_ids``, one list of ids per row), up to ``multiturn.max_turns``
    turns of at most ``max_new_tokens`` tokens each, the whole row within ``width`` tokens: a row's
    turn is cut at the room it has left, and an episode with no room left ends. ``generator``: an
    engine with :func:`~offline_plugins.text.backends.generation.generate`'s contract."""
    turns = Turns(tokenizer, prompt_ids, multiturn, width=width, max_new_tokens=max_new_tokens,
                  device=next(model.parameters()).device)
    while not turns.done:
        tokens, lengths, log_probs = sample_turn(
            model, turns.batches(), rows=len(prompt_ids), pad_id=pad_token_id(tokenizer),
            eos_id=tokenizer.eos_token_id, seed=seed, temperature=temperature, top_p=top_p, greedy=greedy,
            generator=generator)
        turns.take(tokens, lengths, log_probs)
    return turns.finish()


def greedy_final_answers(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], multiturn: MultiTurn, *,
                         width: int, max_new_tokens: int, batch_size: int = 100) -> list[str]:
    """The final answers of greedy episodes from ``prompts``, ``batch_size`` episodes at a time."""
    ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    return [a for s in range(0, len(ids), batch_size)
            for a in run_episodes(model, tokenizer, ids[s:s + batch_size], multiturn, width=width,
                                  max_new_tokens=max_new_tokens, greedy=True).answers]
