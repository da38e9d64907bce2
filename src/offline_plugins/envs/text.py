"""``TextEnv``: prompts as states, responses as actions, one step per episode.

Reset yields a batch of prompts; step takes responses (text or tokens) and returns
a reward from a reward function (a verifiable task's exact match by default) or a
reward model. Keys follow TorchRL's LLM stack so its own losses read what the env
writes:

* reset: ``("text", "prompt")`` (strings), ``("tokens", "prompt")`` (left-padded ids,
  for generation), ``"group"`` (prompt id; with ``group_size > 1`` each prompt
  appears that many times in a row, as GRPO needs);
* step reads ``("text", "response")`` or ``("tokens", "response")`` (right-padded ids;
  anything after eos ignored), writes the tokenised episode at the root,
  ``("tokens", "full")``, ``("masks", "all_attention_mask")``,
  ``("masks", "all_assistant_mask")`` (right-padded to ``max_length``, as
  :mod:`offline_plugins.data.preference` lays out preference data), and
  ``("next", "reward")``, ``("next", "done")``, ``("next", "terminated")``.

>>> from offline_plugins.modules.tiny_lm import char_tokenizer
>>> from offline_plugins.envs.tasks import ArithmeticTask
>>> env = TextEnv(char_tokenizer(), task=ArithmeticTask(), batch_size=2, seed=0)
>>> td = env.reset()
>>> list(td["text", "prompt"])
['73+46=', '37+94=']
>>> td["text", "response"] = ["119", "130"]
>>> env.step(td)["next", "reward"].squeeze(-1)
tensor([1., 0.])
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Sequence

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from torchrl.data import Categorical, Composite, NonTensor, Unbounded
from torchrl.envs import EnvBase

from offline_plugins.errors import UserError

__all__ = ["TextEnv", "TextEnvError"]


class TextEnvError(UserError, ValueError):
    """A ``TextEnv`` set-up or action that cannot be used."""


class TextEnv(EnvBase):
    """A batch of single-step text episodes: prompt -> response -> reward.

    Args:
        tokenizer: a transformers tokenizer (one without a pad token gets one).

    Keyword Args:
        task: a verifiable task (e.g. :class:`~offline_plugins.envs.tasks.ArithmeticTask`);
            gives prompts and, unless ``reward_fn`` or ``reward_model`` is given, the reward.
        prompts: a fixed list of prompts to cycle through instead of ``task``'s.
        reward_fn: ``reward_fn(prompts, responses) -> list[float]``.
        reward_model: a TensorDict module reading ``("tokens", "full")`` and
            ``("masks", "all_attention_mask")`` and writing ``"reward"`` (e.g.
            :class:`~offline_plugins.modules.causal_lm.CausalLMReward`).
        batch_size (int): episodes per reset. Defaults to ``4``.
        group_size (int): copies of each prompt per reset (GRPO's group). Defaults to ``1``.
        split (str): the task split prompts come from. Defaults to ``"train"``.
        max_length (int): token budget of prompt + response. Defaults to ``64``.
        reward_per_token (bool): give the reward as ``[B, max_length, 1]``, zero except at each
            episode's last token (the sequence reward arrives at the end), the shape TorchRL's
            ``KLRewardTransform`` subtracts its per-token KL from. Defaults to ``False``
            (one reward per episode, ``[B, 1]``).
        seed (int): prompt order. Defaults to ``0``.
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
        reward_fn: Optional[Callable[[list[str], list[str]], Sequence[float]]] = None,
        reward_model: Optional[torch.nn.Module] = None,
        batch_size: int = 4,
        group_size: int = 1,
        split: str = "train",
        max_length: int = 64,
        reward_per_token: bool = False,
        seed: int = 0,
        device: Any = None,
    ) -> None:
        super().__init__(batch_size=torch.Size([batch_size]), device=device)
        if task is None and prompts is None:
            raise TextEnvError("TextEnv needs prompts: pass task=ArithmeticTask() or prompts=[...]")
        if reward_fn is None and reward_model is None and task is None:
            raise TextEnvError("TextEnv needs a reward: pass task=, reward_fn= or reward_model=")
        if group_size < 1 or batch_size % group_size:
            raise TextEnvError(f"TextEnv: batch_size {batch_size} must be a multiple of group_size {group_size}")
        from offline_plugins.tokens import pad_token_id

        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.task = task
        self.fixed_prompts = list(prompts) if prompts is not None else None
        self.reward_fn = reward_fn if reward_fn is not None else (task.rewards if task is not None else None)
        self.reward_model = reward_model
        self.group_size = group_size
        self.split = split
        self.max_length = max_length
        self.reward_per_token = reward_per_token
        self._episode = 0
        self._set_seed(seed)
        self._prompts: list[str] = []
        self._groups = torch.zeros(batch_size, dtype=torch.long)
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
            text=Composite(response=NonTensor(shape=shape, example_data="3"), shape=shape), shape=shape
        )
        self.reward_spec = Unbounded(shape=(*shape, self.max_length, 1) if self.reward_per_token else (*shape, 1))
        self.done_spec = Composite(
            done=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            terminated=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            truncated=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            shape=shape,
        )

    def _set_seed(self, seed: Optional[int]) -> None:
        self._rng = random.Random(seed)
        self._seed = 0 if seed is None else int(seed)

    def _next_prompts(self, n: int) -> list[str]:
        if self.fixed_prompts is not None:
            return [self._rng.choice(self.fixed_prompts) for _ in range(n)]
        problems = self.task.problems(n, split=self.split, seed=self._seed * 100_003 + self._episode)
        return [p.prompt for p in problems]

    def _reset(self, tensordict: Optional[TensorDictBase] = None, **kwargs) -> TensorDictBase:
        from offline_plugins.tokens import prompt_token_ids

        n = self.batch_size[0] // self.group_size
        unique = self._next_prompts(n)
        base = self._episode * n
        self._episode += 1
        self._prompts = [p for p in unique for _ in range(self.group_size)]
        self._groups = torch.arange(base, base + n).repeat_interleave(self.group_size)
        ids = [prompt_token_ids(self.tokenizer, p) for p in self._prompts]
        width = max(len(i) for i in ids)
        prompt_tokens = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        for row, i in enumerate(ids):
            prompt_tokens[row, width - len(i) :] = torch.tensor(i)
        out = TensorDict(
            {
                "tokens": {"prompt": prompt_tokens},
                "group": self._groups.clone(),
                "done": torch.zeros(*self.batch_size, 1, dtype=torch.bool),
                "terminated": torch.zeros(*self.batch_size, 1, dtype=torch.bool),
                "truncated": torch.zeros(*self.batch_size, 1, dtype=torch.bool),
            },
            batch_size=self.batch_size,
            device=self.device,
        )
        out.set(("text", "prompt"), NonTensorStack(*self._prompts, batch_size=self.batch_size))
        return out

    def _responses(self, tensordict: TensorDictBase) -> list[str]:
        text = tensordict.get(("text", "response"), None)
        if text is not None:
            responses = list(text.tolist() if hasattr(text, "tolist") else text)
        else:
            tokens = tensordict.get(("tokens", "response"), None)
            if tokens is None:
                raise TextEnvError(
                    "TextEnv.step needs the responses at ('text', 'response') (strings) or "
                    "('tokens', 'response') (right-padded ids); the policy wrote neither"
                )
            responses = self.tokenizer.batch_decode(_cut_at_eos(tokens, self.tokenizer.eos_token_id),
                                                    skip_special_tokens=True)
        if len(responses) != self.batch_size[0] or not all(isinstance(r, str) for r in responses):
            raise TextEnvError(f"TextEnv.step expects {self.batch_size[0]} string responses, got {responses!r:.200}")
        specials = [t for t in (self.tokenizer.eos_token, self.tokenizer.pad_token) if t]
        for s in specials:  # policies that decode without skip_special_tokens leave these in
            responses = [r.split(s)[0] if s == self.tokenizer.eos_token else r.replace(s, "") for r in responses]
        return responses

    def tokenize_responses(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write the episodes' tokens at the root: ``("tokens", "full")`` and its two masks.

        ``step`` calls it; a policy may call it first to score its own responses on the
        same tokens (TorchRL's ``KLRewardTransform`` reads them with the policy's
        ``("log_probs", "full")`` during ``step``).
        """
        from offline_plugins.tokens import TokenizeReport, encode_example, pad_rows

        responses = self._responses(tensordict)
        report = TokenizeReport()
        encoded = []
        for prompt, response in zip(self._prompts, responses):
            e = encode_example(self.tokenizer, prompt, response if response.strip() else " ",
                               max_length=self.max_length, report=report)
            if e is None:
                raise TextEnvError(f"TextEnv: prompt {prompt!r} leaves no room for a response in max_length={self.max_length}")
            encoded.append(e)
        parts = pad_rows(encoded, self.pad_id, self.max_length)
        tensordict.set(("tokens", "full"), parts["tokens"].to(self.device))
        tensordict.set(("masks", "all_attention_mask"), parts["attn"].to(self.device))
        tensordict.set(("masks", "all_assistant_mask"), parts["resp"].to(self.device))
        return tensordict

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        responses = self._responses(tensordict)
        self.tokenize_responses(tensordict)
        if self.reward_model is not None:
            with torch.no_grad():
                scored = self.reward_model(tensordict.select(("tokens", "full"), ("masks", "all_attention_mask")))
            reward = scored.get("reward").reshape(*self.batch_size, 1).float()
        else:
            reward = torch.tensor(list(self.reward_fn(self._prompts, responses)), dtype=torch.float32).reshape(
                *self.batch_size, 1
            )
        if self.reward_per_token:
            attn = tensordict.get(("masks", "all_attention_mask"))
            last = attn.sum(-1, keepdim=True) - 1
            reward = torch.zeros(*attn.shape, 1, device=attn.device).scatter(
                -2, last.unsqueeze(-1), reward.to(attn.device).unsqueeze(-1)
            )
        done = torch.ones(*self.batch_size, 1, dtype=torch.bool, device=self.device)
        return TensorDict(
            {
                "reward": reward.to(self.device),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros_like(done),
                "tokens": {"prompt": tensordict.get(("tokens", "prompt"))},
                "group": self._groups.clone(),
            },
            batch_size=self.batch_size,
            device=self.device,
        ).set(("text", "prompt"), NonTensorStack(*self._prompts, batch_size=self.batch_size))


def _cut_at_eos(tokens: torch.Tensor, eos: Optional[int]) -> list[list[int]]:
    rows = []
    for row in tokens.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        rows.append(row)
    return rows
