"""Algorithm Distillation (Laskin et al. 2022, arXiv:2210.14215): network, actor and in-context policy.

One token per step, the sum of embeddings of the observation ``o_t``, the previous
action ``a_{t-1}`` and the previous reward ``r_{t-1}``, with a learned position in the
window; the causal transformer's output at step ``t`` gives the logits of ``a_t``. There
is no return-to-go: what the model conditions on is the learning history itself,
across episode boundaries. At the start of a history the previous action is the extra
index ``num_actions`` ("none") and the previous reward 0.

>>> import torch
>>> from tensordict import TensorDict
>>> net = AlgorithmDistillationNet(1, 3, embed_dim=16, num_layers=1, num_heads=1, context_len=4)
>>> actor = AlgorithmDistillationActor(net, context_len=4)
>>> window = TensorDict({"observation": torch.zeros(8, 1), "prev_action": torch.randint(0, 4, (8,)),
...     "prev_reward": torch.rand(8, 1)}, [8])
>>> actor(window)["action_logits"].shape  # flat [B*K] windows, as SliceSampler returns them
torch.Size([8, 3])
>>> policy = AlgorithmDistillationPolicy(net, context_len=4)
>>> for t in range(6):
...     a = policy(TensorDict({"observation": torch.zeros(2, 1), "reward": torch.ones(2, 1)}, [2]))["action"]
>>> a.shape, a.dtype, policy.context_length
(torch.Size([2]), torch.int64, 4)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from offline_plugins.errors import SequenceModelError
from offline_plugins.modules.sequence.decision_transformer import ContextPolicy, env_rows, windows
from offline_plugins.modules.sequence.gpt import CausalTransformer

__all__ = ["AlgorithmDistillationNet", "AlgorithmDistillationActor", "AlgorithmDistillationPolicy", "previous_steps"]


def previous_steps(episode: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, num_actions: int):
    """``(prev_action [N], prev_reward [N, 1])`` of contiguous histories: each step's predecessor in
    its history, ``num_actions`` and 0 at a history's first step.

    >>> prev_a, prev_r = previous_steps(torch.tensor([0, 0, 1, 1]), torch.tensor([2, 1, 0, 2]),
    ...                                 torch.tensor([[1.0], [0.0], [1.0], [1.0]]), 3)
    >>> prev_a.tolist(), prev_r.squeeze(-1).tolist()
    ([3, 2, 3, 0], [0.0, 1.0, 0.0, 1.0])
    """
    episode = episode.reshape(-1)
    first = torch.ones_like(episode, dtype=torch.bool)
    first[1:] = episode[1:] != episode[:-1]
    action = action.reshape(-1).long()
    prev_a = torch.where(first, torch.full_like(action, num_actions), action.roll(1))
    prev_r = torch.where(first.unsqueeze(-1), torch.zeros_like(reward), reward.roll(1, 0))
    return prev_a, prev_r


class AlgorithmDistillationNet(nn.Module):
    """``(observation [B, K, D], prev_action [B, K], prev_reward [B, K, 1]) -> action logits [B, K, A]``.

    Args:
        obs_dim: observation width.
        num_actions: discrete actions ``A``.

    Keyword Args:
        embed_dim, num_layers, num_heads, dropout: the causal transformer.
        context_len: the longest window ``K`` (steps, across episodes).
    """

    def __init__(self, obs_dim: int, num_actions: int, *, embed_dim: int = 64, num_layers: int = 2, num_heads: int = 2,
                 dropout: float = 0.1, context_len: int = 40) -> None:
        super().__init__()
        self.obs_dim, self.num_actions, self.context_len = int(obs_dim), int(num_actions), int(context_len)
        self.embed_obs = nn.Linear(obs_dim, embed_dim)
        self.embed_action = nn.Embedding(self.num_actions + 1, embed_dim)  # the last index: no previous action
        self.embed_reward = nn.Linear(1, embed_dim)
        self.transformer = CausalTransformer(embed_dim, num_layers=num_layers, num_heads=num_heads,
                                             max_len=self.context_len, dropout=dropout, positional=True)
        self.head = nn.Linear(embed_dim, self.num_actions)

    def forward(self, observation: torch.Tensor, prev_action: torch.Tensor, prev_reward: torch.Tensor) -> torch.Tensor:
        tokens = self.embed_obs(observation) + self.embed_action(prev_action.long()) + self.embed_reward(prev_reward)
        return self.head(self.transformer(tokens))


class AlgorithmDistillationActor(TensorDictModuleBase):
    """The network as a tensordict module over history windows ``[B, K]`` or flat ``[B*K]``.

    Reads ``observation``, ``prev_action`` and ``prev_reward``; writes ``action_logits``.

    Args:
        net: an :class:`AlgorithmDistillationNet`.

    Keyword Args:
        context_len: the window length ``K`` of flat batches.
        in_keys: ``[observation, prev_action, prev_reward]`` keys.
        out_key: where the logits go.
    """

    def __init__(self, net: AlgorithmDistillationNet, *, context_len: int,
                 in_keys: Sequence[NestedKey] = ("observation", "prev_action", "prev_reward"),
                 out_key: NestedKey = "action_logits") -> None:
        super().__init__()
        self.net, self.context_len = net, int(context_len)
        self.in_keys, self.out_keys = list(in_keys), [out_key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        w = windows(tensordict, self.context_len, type(self).__name__)
        logits = self.net(*(w.get(k) for k in self.in_keys))
        tensordict.set(self.out_keys[0], logits.reshape(*tensordict.shape, logits.shape[-1]))
        return tensordict


class AlgorithmDistillationPolicy(ContextPolicy):
    """Acts in context: the last ``context_len`` steps of the history, across episodes, no weight update.

    Call :meth:`reset` before a new history (a new task; ``.train()`` and ``.eval()``
    reset too), then once per environment step with that step's TensorDict (batch
    ``[]`` or ``[n]``): ``observation``, and after the first step ``reward`` (the previous
    step's reward, ``[n, 1]``) and optionally ``env_index`` (rows may drop out). The
    previous action is the one this policy wrote for the row. Writes ``action`` (int64
    indices), sampled from the predicted distribution (``sample=True``, as a learning
    algorithm explores) or its argmax.

    Args:
        net: an :class:`AlgorithmDistillationNet`.

    Keyword Args:
        context_len: steps the model sees.
        sample: sample actions (default) rather than take the argmax.
        reward_scale, reward_shift: the data's reward transform, applied to rewards received.
    """

    def __init__(self, net: AlgorithmDistillationNet, *, context_len: int, sample: bool = True,
                 reward_scale: float = 1.0, reward_shift: float = 0.0) -> None:
        super().__init__()
        self.net, self.context_len, self.sample = net, int(context_len), bool(sample)
        self.reward_scale, self.reward_shift = float(reward_scale), float(reward_shift)
        self.in_keys, self.out_keys = ["observation"], ["action"]
        self.reset()

    def reset(self) -> None:
        """Forget the history: the next call starts a new task."""
        self._obs: Optional[torch.Tensor] = None
        self._prev_a = self._prev_r = self._last = None
        self.context_length = 0

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        single = tensordict.batch_dims == 0
        td = tensordict.unsqueeze(0) if single else tensordict
        obs = td.get("observation")
        rows = env_rows(td, obs, self._obs, type(self).__name__)
        K, n = self.context_len, self.net.num_actions
        with torch.no_grad():
            if self._obs is None:
                slots = obs.shape[0] if td.get("env_index", None) is None else int(rows.max()) + 1
                self._obs = obs.new_zeros(slots, K, obs.shape[-1])
                self._prev_a = torch.full((slots, K), n, dtype=torch.long, device=obs.device)
                self._prev_r = obs.new_zeros(slots, K, 1)
                self._last = torch.full((slots,), n, dtype=torch.long, device=obs.device)
                reward = obs.new_zeros(obs.shape[0], 1)
            else:
                reward = td.get("reward", None)
                if reward is None:
                    raise SequenceModelError(f"{type(self).__name__} got no 'reward': after a history's first step pass the "
                                     "previous step's reward as 'reward' [n, 1], or call reset() to start a new task")
                reward = reward.reshape(-1, 1).to(obs.dtype) * self.reward_scale + self.reward_shift
            if self.context_length == K:  # the window is full: drop the oldest step
                for buf in (self._obs, self._prev_a, self._prev_r):
                    buf.copy_(buf.roll(-1, dims=1))
            else:
                self.context_length += 1
            pos = self.context_length - 1
            self._obs[rows, pos], self._prev_a[rows, pos], self._prev_r[rows, pos] = obs, self._last[rows], reward
            L = self.context_length
            logits = self.net(self._obs[rows, :L], self._prev_a[rows, :L], self._prev_r[rows, :L])[:, -1]
            action = torch.distributions.Categorical(logits=logits).sample() if self.sample else logits.argmax(-1)
            self._last[rows] = action
        tensordict.set("action", action.squeeze(0) if single else action)
        return tensordict
