"""``TextEnv``: prompts as states, responses as actions, one step per episode.

The rollout collector (:class:`~offline_plugins.text.collectors.collector.RolloutCollector`) steps it
every round; it is also a plain TorchRL ``EnvBase`` (``TransformedEnv``, TorchRL's LLM
transforms). Keys follow TorchRL's LLM stack, the TED text layout the losses read:

* ``reset(round=r, rank=k, attempt=a)`` draws the episode's prompts with
  :meth:`TextEnv.episode_seed` ``(k, r, a)``, so the prompts are a function of the run's
  seed, the rank, the round and the attempt, never of how many resets came before (a plain
  ``reset()`` counts rounds itself; the collector's
  :class:`~offline_plugins.text.collectors.collector.RolloutEnv` draws from a
  :class:`~offline_plugins.text.sources.prompts.PromptSource` with ``rollout_seed(seed, k, r, a)``).
  It writes ``("text", "prompt")`` (strings),
  ``("tokens", "prompt")`` (left-padded ids) and ``"group"`` (the prompt's id: with
  ``group_size > 1`` each prompt appears that many times in a row, as GRPO needs);
* the action is the response's tokens, ``("tokens", "response")`` ``[B, K]``: a row's
  response runs to its first eos (kept), else to ``K``; what follows is ignored. Optional
  ``("log_probs", "response")`` (the sampling policy's log-prob of each token) is laid out
  with them. The tokens are placed, exactly as sampled, right after the prompt: no decode
  and re-tokenise round trip (a BPE round trip need not give back the sampled tokens,
  which the PPO ratio needs). A policy that only produces text may instead write
  ``("text", "response")``; that episode is tokenised as SFT data is (prompt + response + eos);
* ``step`` writes the episode at the root, ``("tokens", "full")``,
  ``("masks", "all_attention_mask")``, ``("masks", "all_assistant_mask")``,
  ``("log_probs", "full")`` (when the policy gave them), ``("text", "response")`` and
  ``"response_length"``, right-padded to ``max_length``, and returns ``("next", "reward")``
  (:meth:`TextEnv.score` on the decoded responses: the task's verifier or ``reward_fn``, in
  ``RolloutEnv`` the source's reward through
  :func:`~offline_plugins.text.sources.prompts.score_responses` and its checks; or a token-level
  ``reward_model`` on the exact tokens), ``("next", "done")`` and
  ``("next", "terminated")`` (every episode ends after one step).

>>> from offline_plugins.modules.tiny_lm import char_tokenizer
>>> from offline_plugins.text.tasks import ArithmeticTask
>>> tok = char_tokenizer()
>>> env = TextEnv(tok, task=ArithmeticTask(), batch_size=2, seed=0, max_length=16)
>>> td = env.reset(round=0)
>>> prompts = list(td["text", "prompt"])
>>> prompts == list(env.reset(round=0)["text", "prompt"])
True
>>> answer = ArithmeticTask().answer(prompts[0])
>>> right = tok.convert_tokens_to_ids(list(answer) + ["<eos>"])
>>> wrong = tok.convert_tokens_to_ids(["0", "<eos>"] + ["7"] * (len(right) - 2))  # after eos: ignored
>>> td["tokens", "response"] = torch.tensor([right, wrong])
>>> td = env.step(td)
>>> td["next", "reward"].squeeze(-1)
tensor([1., 0.])
>>> list(td["text", "response"]) == [answer, "0"], td["response_length"][1].item()
(True, 2.0)
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Sequence

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from torchrl.data import Categorical, Composite, NonTensor, Unbounded
from torchrl.envs import EnvBase

from offline_plugins.errors import UserError
from offline_plugins.text.envs.turns import TurnBatch, Turns
from offline_plugins.tokens import TokenizeReport, encode_example, pad_rows, pad_token_id, prompt_token_ids

__all__ = ["TextEnv", "TextEnvError"]


class TextEnvError(UserError, ValueError):
    """A ``TextEnv`` set-up or action that cannot be used."""


class TextEnv(EnvBase):
    """A batch of single-step text episodes: prompt -> response tokens -> reward.

    Args:
        tokenizer: a transformers tokenizer (one without a pad token gets one).

    Keyword Args:
        task: a verifiable task (e.g. :class:`~offline_plugins.text.tasks.ArithmeticTask`): its
            train-split problems and, unless ``reward_fn`` or ``reward_model`` is given, its verifier.
        prompts: a list of prompts drawn with replacement instead of ``task``'s.
        reward_fn: ``reward_fn(prompts, responses) -> list[float]``.
        reward_model: a TensorDict module reading ``("tokens", "full")`` and
            ``("masks", "all_attention_mask")`` and writing ``"reward"`` (e.g.
            :class:`~offline_plugins.modules.causal_lm.CausalLMReward`); replaces the source's reward.
        batch_size (int): episodes per reset. Defaults to ``4``.
        group_size (int): copies of each prompt per reset (GRPO's group). Defaults to ``1``.
        max_length (int): token budget of prompt + response, the episode's width. Defaults to ``64``.
        max_new_tokens (int): the policy's response budget; given, every prompt must leave room
            for it in ``max_length`` (checked at reset, a ``RolloutError`` naming the prompt).
        max_attempts (int): attempts per round (dynamic sampling); ``"group"`` numbers the prompts
            ``(round * max_attempts + attempt) * prompts + i``, unique within the run and rank.
            Defaults to ``1``.
        reward_per_token (bool): give the reward as ``[B, max_length, 1]``, zero except at each
            episode's last token (the sequence reward arrives at the end), the shape TorchRL's
            ``KLRewardTransform`` subtracts its per-token KL from. Defaults to ``False``
            (one reward per episode, ``[B, 1]``).
        multiturn: a :class:`~offline_plugins.text.tools.multiturn.MultiTurn` (default: ``task``'s
            ``multiturn``, where it has one): ``step`` is then one turn of multi-turn episodes with tools
            (below); needs ``max_new_tokens`` (a turn's budget) and a reward that reads text.
        seed (int): the run's seed. Defaults to ``0``.

    **Multi-turn episodes.** With ``multiturn`` set, an episode is prompt + turns + tool observations, and
    each ``step`` is one turn of every unfinished episode (:class:`~offline_plugins.text.envs.turns.Turns`):
    the action is the turn's tokens, ``("tokens", "response")`` ``[B, K]`` with ``"turn_length"`` ``[B]``
    (how many of each row's tokens were sampled) and optional ``("log_probs", "response")``;
    :meth:`turn_batches` says what the policy samples for the turn. ``("next", "done")`` is True for the
    episodes that have ended; the step that ends the last one writes the episodes as a single-turn step
    does (``("tokens", "full")``, the masks, ``("log_probs", "full")``, ``"response_length"``,
    ``("text", "response")``: the transcript after the prompt), plus ``"stats"`` (per episode: turns, tool
    calls, failed calls by kind, turn reward) and ``("next", "turn_reward")`` ``[B, max_length]`` (each
    turn's reward on its last token, the verifier's on the last turn's); ``("next", "reward")`` is the
    episode's return, their sum, and the verifier scores the final answer, the last turn's text.
    """

    batch_locked = True
    #: what TorchRL's LLM transforms (``KLRewardTransform``) read as the action: the episode's tokens
    input_mode = "tokens"

    def __init__(
        self,
        tokenizer: Any,
        *,
        task: Any = None,
        prompts: Optional[Sequence[str]] = None,
        reward_fn: Optional[Callable[..., Sequence[float]]] = None,
        reward_model: Optional[torch.nn.Module] = None,
        batch_size: int = 4,
        group_size: int = 1,
        max_length: int = 64,
        max_new_tokens: Optional[int] = None,
        max_attempts: int = 1,
        reward_per_token: bool = False,
        multiturn: Any = None,
        seed: int = 0,
        device: Any = None,
    ) -> None:
        super().__init__(batch_size=torch.Size([batch_size]), device=device)
        if group_size < 1 or batch_size % group_size:
            raise TextEnvError(f"TextEnv: batch_size {batch_size} must be a multiple of group_size {group_size}")

        if task is None and prompts is None and type(self).sample_rows is TextEnv.sample_rows:
            raise TextEnvError("TextEnv needs prompts: pass task=ArithmeticTask() or prompts=[...]")
        if reward_fn is None and reward_model is None and task is None and type(self).score is TextEnv.score:
            raise TextEnvError("TextEnv needs a reward: pass task=, reward_fn= or reward_model=")
        self.task = task
        self.fixed_prompts = list(prompts) if prompts is not None else None
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.reward_model = reward_model
        self.group_size = int(group_size)
        self.max_length = int(max_length)
        self.max_new_tokens = max_new_tokens
        self.max_attempts = int(max_attempts)
        self.reward_per_token = reward_per_token
        self.seed = int(seed)
        self._rounds = 0  # rounds counted by resets that name none
        self.rows: list[dict] = []  # the episode's prompt rows, one per env row
        self.prompt_ids: list[list[int]] = []  # the episode's prompts' ids, one list per group
        self._prompt_right: Optional[torch.Tensor] = None  # [prompts, width] right-padded, on the device
        self._prompt_len: Optional[torch.Tensor] = None  # [B]
        self._multiturn = multiturn
        self.turns: Optional[Turns] = None  # the multi-turn episodes between turns
        self._stepped = False  # a single-turn episode has had its step
        if self.multiturn is not None and (max_new_tokens is None or reward_model is not None or reward_per_token):
            raise TextEnvError("TextEnv: multi-turn episodes need max_new_tokens (each turn's budget) and a reward "
                               "that reads the final answer's text (task=, reward_fn=), not reward_model= or "
                               "reward_per_token=True")
        self._make_specs()

    def _make_specs(self) -> None:
        shape = self.batch_size
        self.observation_spec = Composite(
            text=Composite(prompt=NonTensor(shape=shape, example_data="1+2="), shape=shape),
            tokens=Composite(prompt=Unbounded(shape=(*shape, -1), dtype=torch.long), shape=shape),
            group=Unbounded(shape=shape, dtype=torch.long),
            shape=shape,
        )
        self.action_spec = Composite(
            tokens=Composite(response=Unbounded(shape=(*shape, -1), dtype=torch.long), shape=shape), shape=shape
        )
        self.reward_spec = Unbounded(shape=(*shape, self.max_length, 1) if self.reward_per_token else (*shape, 1))
        self.done_spec = Composite(
            done=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            terminated=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            truncated=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            shape=shape,
        )

    def _set_seed(self, seed: Optional[int]) -> None:
        self.seed = 0 if seed is None else int(seed)
        self._rounds = 0

    @property
    def multiturn(self) -> Any:
        """The :class:`~offline_plugins.text.tools.multiturn.MultiTurn` of the episodes (None: one step each)."""
        return self._multiturn if self._multiturn is not None else getattr(self.task, "multiturn", None)

    @property
    def episode_done(self) -> bool:
        """Every episode of the last reset has ended (a single-turn episode after its step)."""
        return self.turns.done if self.turns is not None else self._stepped

    def turn_batches(self) -> list[TurnBatch]:
        """What the policy samples for the next step: one batch of ``group_size`` samples of each prompt
        (single-turn), or the unfinished episodes grouped by the room each has left
        (:meth:`Turns.batches <offline_plugins.text.envs.turns.Turns.batches>`)."""
        if self.turns is not None:
            return self.turns.batches()
        room = self.max_new_tokens or self.max_length - max((len(p) for p in self.prompt_ids), default=0)
        return [TurnBatch(None, self.prompt_ids, int(room), self.group_size)]

    # -- where prompts and rewards come from (the collector's RolloutEnv binds a PromptSource) --
    @property
    def source_name(self) -> str:
        """What the prompts are, for messages."""
        return getattr(self.task, "name", None) or "TextEnv prompts"

    def episode_seed(self, rank: int, round: int, attempt: int) -> int:
        """The seed the prompts of ``(rank, round, attempt)`` are drawn with: a function of these and ``seed``."""
        return random.Random(f"{self.seed},{int(rank)},{int(round)},{int(attempt)}").getrandbits(63)

    def sample_rows(self, n: int, seed: int) -> list[dict]:
        """``n`` rows (dicts with ``"prompt"``, and the task's ``"answer"``) drawn with ``seed``."""
        if self.fixed_prompts is not None:
            rng = random.Random(seed)
            return [{"prompt": rng.choice(self.fixed_prompts)} for _ in range(n)]
        return [{"prompt": p.prompt, "answer": p.answer} for p in self.task.problems(n, split="train", seed=seed)]

    def score(self, rows: list[dict], responses: list[str]) -> list[float]:
        """One reward per response: ``reward_fn(prompts, responses)``, else the task's verifier."""
        fn = self.reward_fn if self.reward_fn is not None else self.task.rewards
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            values = [float(v) for v in fn([r["prompt"] for r in rows], responses)]
        except Exception as exc:  # noqa: BLE001 - the user's function failed: say which
            raise TextEnvError(f"TextEnv: reward function {name} raised {type(exc).__name__}: {exc}") from None
        if len(values) != len(rows):
            raise TextEnvError(f"TextEnv: reward function {name} returned {len(values)} rewards for {len(rows)} "
                               "responses; return one float per response, in order")
        return values

    def score_parts(self, rows: list[dict], responses: list[str]) -> tuple[list[float], Optional[list[list[float]]]]:
        """``(reward, components)``: :meth:`score`'s rewards, and ``[K][B]`` the scores of each of several
        rewards where the env has them (written at ``("next", "reward_components")``); here None."""
        return self.score(rows, responses), None

    # -- reset ---------------------------------------------------------------------
    def _reset(self, tensordict: Optional[TensorDictBase] = None, *, round: Optional[int] = None, rank: int = 0,
               attempt: int = 0, **kwargs) -> TensorDictBase:
        if round is None:
            round, self._rounds = self._rounds, self._rounds + 1
        g, n = self.group_size, self.batch_size[0] // self.group_size
        unique = self.sample_rows(n, self.episode_seed(rank, round, attempt))
        ids = [prompt_token_ids(self.tokenizer, r["prompt"]) for r in unique]
        if self.max_new_tokens is not None:
            budget = self.max_length - self.max_new_tokens
            for e, r in zip(ids, unique):
                if len(e) > budget:
                    raise TextEnvError(
                        f"{self.source_name}: prompt {r['prompt']!r:.80} is {len(e)} tokens; the rollout budget is "
                        f"{budget} prompt tokens (sized on the source's longest prompts) + max_new_tokens="
                        f"{self.max_new_tokens}; shorten the prompt")
        self.rows = [r for r in unique for _ in range(g)]
        self.prompt_ids = ids
        # one host tensor per layout, one copy to the device; the rows of a group share their prompt
        width = max(len(e) for e in ids)
        lengths = torch.tensor([len(e) for e in ids])
        pads = [[self.pad_id] * (width - len(e)) for e in ids]
        right = torch.tensor([e + pad for e, pad in zip(ids, pads)], dtype=torch.long)
        left = torch.tensor([pad + e for e, pad in zip(ids, pads)], dtype=torch.long)
        both = torch.cat([right, left, lengths.unsqueeze(1)], 1).to(self.device)
        self._prompt_right = both[:, :width]
        self._prompt_len = both[:, -1].repeat_interleave(g)
        base = (int(round) * self.max_attempts + int(attempt)) * n
        out = TensorDict(
            {
                "tokens": {"prompt": both[:, width:2 * width].repeat_interleave(g, 0)},
                "group": torch.arange(base, base + n, device=self.device).repeat_interleave(g),
            },
            batch_size=self.batch_size,
            device=self.device,
        )
        # from_list: NonTensorStack(*items) on a device TensorDict moves every item
        out.set(("text", "prompt"), NonTensorStack.from_list([r["prompt"] for r in self.rows]))
        self._stepped = False
        multiturn = self.multiturn
        self.turns = None if multiturn is None else Turns(
            self.tokenizer, [ids[i // g] for i in range(len(self.rows))], multiturn, width=self.max_length,
            max_new_tokens=int(self.max_new_tokens), device=self.device if self.device is not None else "cpu")
        return out

    # -- the episode -----------------------------------------------------------------
    def tokenize_responses(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write the episode at the root: ``("tokens", "full")``, its two masks, ``"response_length"``,
        ``("text", "response")`` and, from ``("log_probs", "response")``, ``("log_probs", "full")``.

        ``step`` calls it; a policy may call it first to score its own responses on the
        same tokens (TorchRL's ``KLRewardTransform`` reads them with the policy's
        ``("log_probs", "full")`` during ``step``).
        """
        if self._prompt_right is None:
            raise TextEnvError("TextEnv.step before reset: call reset() first")
        tokens = tensordict.get(("tokens", "response"), None)
        if tokens is not None:
            return self._place_tokens(tensordict, tokens)
        if tensordict.get(("text", "response"), None) is None:
            raise TextEnvError("TextEnv.step needs the responses at ('tokens', 'response') (token ids, the exact "
                               "sampled ones) or ('text', 'response') (strings); the policy wrote neither")
        return self._tokenize_text(tensordict)

    def _place_tokens(self, tensordict: TensorDictBase, gen: torch.Tensor) -> TensorDictBase:
        n, k = self.batch_size[0], gen.shape[-1]
        if gen.shape[0] != n or gen.dim() != 2:
            raise TextEnvError(f"TextEnv.step expects ('tokens', 'response') of shape [{n}, K], got {tuple(gen.shape)}")
        device, width = gen.device, self.max_length
        eos = self.tokenizer.eos_token_id
        # a response runs to its first eos (kept: the policy chose to stop), else to K
        is_eos = gen == eos if eos is not None else torch.zeros_like(gen, dtype=torch.bool)
        first = is_eos.to(torch.int8).argmax(-1)
        resp_len = torch.where(is_eos.any(-1), first + 1, torch.full_like(first, k))
        valid = torch.arange(k, device=device).unsqueeze(0) < resp_len.unsqueeze(1)
        lengths_p = self._prompt_len.to(device)
        prompt = self._prompt_right.to(device)
        if prompt.shape[1] + k > width:
            raise TextEnvError(f"TextEnv: prompts of {prompt.shape[1]} tokens and responses of {k} exceed "
                               f"max_length={width}")
        full = torch.full((n, width), self.pad_id, dtype=torch.long, device=device)
        full[:, :prompt.shape[1]] = prompt.repeat_interleave(self.group_size, 0)
        # each response right after its prompt (one vectorised scatter)
        target = lengths_p.unsqueeze(1) + torch.arange(k, device=device).unsqueeze(0)
        rows_idx = torch.arange(n, device=device).unsqueeze(1).expand_as(target)
        r_idx, t_idx = rows_idx[valid], target[valid]
        full[r_idx, t_idx] = gen[valid]
        resp_mask = torch.zeros(n, width, dtype=torch.bool, device=device)
        resp_mask[r_idx, t_idx] = True
        attn = torch.arange(width, device=device).unsqueeze(0) < (lengths_p + resp_len).unsqueeze(1)
        tensordict.set(("tokens", "full"), full)
        tensordict.set(("masks", "all_attention_mask"), attn)
        tensordict.set(("masks", "all_assistant_mask"), resp_mask)
        lp = tensordict.get(("log_probs", "response"), None)
        if lp is not None:
            lp_full = torch.zeros(n, width, dtype=torch.float32, device=device)
            lp_full[r_idx, t_idx] = lp[valid].to(torch.float32)
            tensordict.set(("log_probs", "full"), lp_full)
        tensordict.set("response_length", resp_len.to(torch.float32))
        # the reward function reads strings: the one host copy of the step
        texts = self.tokenizer.batch_decode(torch.where(valid, gen, self.pad_id).tolist(), skip_special_tokens=True)
        tensordict.set(("text", "response"), NonTensorStack.from_list(texts))
        return tensordict

    def _tokenize_text(self, tensordict: TensorDictBase) -> TensorDictBase:
        text = tensordict.get(("text", "response"))
        responses = list(text.tolist() if hasattr(text, "tolist") else text)
        if len(responses) != self.batch_size[0] or not all(isinstance(r, str) for r in responses):
            raise TextEnvError(f"TextEnv.step expects {self.batch_size[0]} string responses, got {responses!r:.200}")
        for s in (self.tokenizer.eos_token, self.tokenizer.pad_token):  # left by decoding with special tokens
            if s:
                responses = [r.split(s)[0] if s == self.tokenizer.eos_token else r.replace(s, "") for r in responses]
        report, encoded = TokenizeReport(), []
        for row, response in zip(self.rows, responses):
            e = encode_example(self.tokenizer, row["prompt"], response if response.strip() else " ",
                               max_length=self.max_length, report=report)
            if e is None:
                raise TextEnvError(f"TextEnv: prompt {row['prompt']!r} leaves no room for a response in "
                                   f"max_length={self.max_length}")
            encoded.append(e)
        parts = pad_rows(encoded, self.pad_id, self.max_length)
        tensordict.set(("tokens", "full"), parts["tokens"].to(self.device))
        tensordict.set(("masks", "all_attention_mask"), parts["attn"].to(self.device))
        tensordict.set(("masks", "all_assistant_mask"), parts["resp"].to(self.device))
        tensordict.set("response_length", parts["resp"].sum(-1).to(self.device, torch.float32))
        tensordict.set(("text", "response"), NonTensorStack.from_list(responses))
        return tensordict

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.turns is not None:
            return self._turn(tensordict)
        self._stepped = True
        self.tokenize_responses(tensordict)
        attn = tensordict.get(("masks", "all_attention_mask"))
        if self.reward_model is not None:
            with torch.no_grad():
                scored = self.reward_model(tensordict.select(("tokens", "full"), ("masks", "all_attention_mask")))
            reward = scored.get("reward").reshape(*self.batch_size, 1).float()
        parts = None
        if self.reward_model is None:
            responses = tensordict.get(("text", "response")).tolist()
            values, parts = self.score_parts(self.rows, responses)
            reward = torch.tensor(values, dtype=torch.float32)
        reward = reward.to(attn.device).reshape(*self.batch_size, 1)
        if self.reward_per_token:
            last = attn.sum(-1, keepdim=True) - 1
            reward = torch.zeros(*attn.shape, 1, device=attn.device).scatter(-2, last.unsqueeze(-1),
                                                                             reward.unsqueeze(-1))
        done = torch.ones(*self.batch_size, 1, dtype=torch.bool, device=attn.device)
        out = TensorDict({"reward": reward, "done": done, "terminated": done.clone(),
                          "truncated": torch.zeros_like(done)}, batch_size=self.batch_size, device=self.device)
        if parts is not None:  # several rewards side by side, [B, K] (gdpo reads them)
            out.set("reward_components", torch.tensor(parts, dtype=torch.float32, device=attn.device).T.contiguous())
        return out

    def _turn(self, tensordict: TensorDictBase) -> TensorDictBase:
        """One turn of the multi-turn episodes (the class docstring's "Multi-turn episodes")."""
        if self.turns.done:
            raise TextEnvError("TextEnv.step after every episode ended: call reset() for new episodes")
        tokens = tensordict.get(("tokens", "response"), None)
        lengths = tensordict.get("turn_length", None)
        if tokens is None or lengths is None:
            raise TextEnvError("TextEnv.step of a multi-turn episode needs the turn's tokens at ('tokens', "
                               "'response') [B, K] and 'turn_length' [B] (tokens sampled per row); the policy "
                               "wrote " + ("neither" if tokens is None and lengths is None else
                                           "only ('tokens', 'response')" if lengths is None else "only 'turn_length'"))
        self.turns.take(tokens, lengths, tensordict.get(("log_probs", "response"), None))
        if not self.turns.done:
            ended = torch.ones(*self.batch_size, 1, dtype=torch.bool)
            ended[self.turns.running] = False
            ended = ended.to(tokens.device)
            return TensorDict({"reward": torch.zeros(*self.batch_size, 1, device=tokens.device), "done": ended,
                               "terminated": ended.clone(), "truncated": torch.zeros_like(ended)},
                              batch_size=self.batch_size, device=self.device)
        ep = self.turns.finish()
        device = ep.tokens.device
        values, parts = self.score_parts(self.rows, ep.answers)
        verifier = torch.tensor(values, dtype=torch.float32, device=device)
        # the verifier's reward on the last policy token, beside the turns' own
        last = ep.assistant_mask.long().cumsum(-1).argmax(-1, keepdim=True)
        per_token = ep.turn_rewards.scatter_add(1, last, verifier.unsqueeze(-1))
        reward = per_token.sum(-1, keepdim=True)
        done = torch.ones_like(reward, dtype=torch.bool)
        tensordict.set(("tokens", "full"), ep.tokens)
        tensordict.set(("masks", "all_attention_mask"), ep.attention_mask)
        tensordict.set(("masks", "all_assistant_mask"), ep.assistant_mask)
        tensordict.set(("log_probs", "full"), ep.log_probs)
        tensordict.set("response_length", ep.assistant_mask.sum(-1).float())
        tensordict.set("stats", TensorDict(ep.counts, batch_size=self.batch_size, device=device))
        tensordict.set(("text", "response"), NonTensorStack.from_list(ep.transcripts))
        tensordict.set(("text", "answer"), NonTensorStack.from_list(ep.answers))
        out = TensorDict({"reward": reward, "turn_reward": per_token, "done": done, "terminated": done.clone(),
                          "truncated": torch.zeros_like(done)}, batch_size=self.batch_size, device=self.device)
        if parts is not None:  # several rewards of the final answer, side by side (gdpo reads them)
            out.set("reward_components", torch.tensor(parts, dtype=torch.float32, device=device).T.contiguous())
        return out
