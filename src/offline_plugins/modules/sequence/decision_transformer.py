"""Decision Transformer (Chen et al. 2021, arXiv:2106.01345): network, actor and rolling-context policy.

The network follows the reference implementation rather than TorchRL's
``DecisionTransformer``: a learned embedding of the episode timestep is added to the
return, state and action tokens (TorchRL's has none and uses GPT-2 positions within
the window), returns-to-go are divided by ``return_scale`` (1000 for locomotion), and
the action head ends in ``tanh`` scaled to the action bounds.

>>> import torch
>>> from tensordict import TensorDict
>>> net = DecisionTransformerNet(3, 1, embed_dim=16, num_layers=1, num_heads=1, context_len=4)
>>> actor = DecisionTransformerActor(net, context_len=4)
>>> window = TensorDict({"observation": torch.randn(8, 3), "action": torch.rand(8, 1),
...     "return_to_go": torch.randn(8, 1), "step_count": torch.arange(8).unsqueeze(-1)}, [8])
>>> actor(window)["action_pred"].shape  # flat [B*K] windows, as SliceSampler returns them
torch.Size([8, 1])
>>> policy = DecisionTransformerPolicy(net, context_len=4, target_return=-100.0)
>>> policy.reset()
>>> for t in range(6):
...     a = policy(TensorDict({"observation": torch.randn(2, 3), "reward": torch.full((2, 1), -1.0)}, [2]))["action"]
>>> a.shape, policy.context_length, policy.return_to_go[:, 0].tolist()
(torch.Size([2, 1]), 4, [-95.0, -95.0])
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from offline_plugins.errors import OfflineLossError
from offline_plugins.modules.sequence.gpt import CausalTransformer

__all__ = ["DecisionTransformerNet", "StochasticDecisionTransformerNet", "DecisionTransformerActor", "DecisionTransformerPolicy", "ContextPolicy", "windows", "env_rows"]


def windows(tensordict: TensorDictBase, length: int, owner: str) -> TensorDictBase:
    """View a flat ``[B*K]`` batch of trajectory windows (as ``SliceSampler`` returns) as ``[B, K]``."""
    if tensordict.batch_dims >= 2:
        return tensordict
    n = tensordict.shape[0]
    if n % length:
        raise OfflineLossError(
            f"{owner}: a flat batch of {n} steps is not a whole number of windows of {length} steps; sample "
            f"with SliceSampler(slice_len={length}) and a batch size that is a multiple of {length}, or pass "
            "windows as a [B, K] TensorDict"
        )
    return tensordict.reshape(n // length, length)


def env_rows(td: TensorDictBase, obs: torch.Tensor, state: Optional[torch.Tensor], owner: str) -> torch.Tensor:
    """The context slot of each row: ``env_index`` when given, else ``0..n-1``.

    Without ``env_index``, a batch smaller than the context means some episodes
    ended and the remaining rows can no longer be matched to their histories.
    """
    rows = td.get("env_index", None)
    if rows is not None:
        return rows.reshape(-1).long()
    if state is not None and state.shape[0] != obs.shape[0]:
        raise ValueError(
            f"{owner}: got {obs.shape[0]} rows but holds the context of {state.shape[0]} environments; when "
            "episodes end at different steps, pass each row's environment as 'env_index' [n] (int64), or call "
            "reset() before a new batch of episodes"
        )
    return torch.arange(obs.shape[0], device=obs.device)


class ContextPolicy(TensorDictModuleBase):
    """A policy that keeps the episode so far between calls (a context window, a plan); a subclass's
    ``reset()`` forgets it, and switching the mode (``train()``/``eval()``) calls it. The evaluator
    switches the policy to eval mode before every evaluation and all its episodes start together, so
    each evaluation starts afresh even where nothing calls ``reset()``."""

    def train(self, mode: bool = True):
        self.reset()
        return super().train(mode)


class DecisionTransformerNet(nn.Module):
    """``(observation, action, return_to_go, timestep) [B, K, *] -> predicted action [B, K, A]``.

    The tokens are ``(R_1, s_1, a_1, R_2, s_2, a_2, ...)``; action ``a_t`` is predicted
    from the output at ``s_t``, which the causal mask keeps from seeing ``a_t``.

    Args:
        state_dim: observation width.
        action_dim: action width.

    Keyword Args:
        embed_dim, num_layers, num_heads, dropout: the GPT (reference: 128, 3, 1, 0.1).
        context_len: the longest window ``K`` (reference: 20).
        max_ep_len: timesteps with their own embedding; later ones share the last.
        return_scale: returns-to-go are divided by this before embedding.
        action_low, action_high: bounds the ``tanh`` head is scaled to (default ``[-1, 1]``).
    """

    def __init__(
        self,
        state_dim: int,
        action_dim: int,
        *,
        embed_dim: int = 128,
        num_layers: int = 3,
        num_heads: int = 1,
        dropout: float = 0.1,
        context_len: int = 20,
        max_ep_len: int = 1000,
        return_scale: float = 1000.0,
        action_low: Optional[torch.Tensor] = None,
        action_high: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        self.state_dim, self.action_dim, self.context_len = int(state_dim), int(action_dim), int(context_len)
        self.max_ep_len = int(max_ep_len)
        self.embed_timestep = nn.Embedding(self.max_ep_len, embed_dim)
        self.embed_return = nn.Linear(1, embed_dim)
        self.embed_state = nn.Linear(state_dim, embed_dim)
        self.embed_action = nn.Linear(action_dim, embed_dim)
        self.embed_ln = nn.LayerNorm(embed_dim)
        self.transformer = CausalTransformer(
            embed_dim,
            num_layers=num_layers,
            num_heads=num_heads,
            max_len=3 * self.context_len,
            dropout=dropout,
            activation="relu",
        )
        self.predict_action = nn.Linear(embed_dim, action_dim)
        low = torch.full((action_dim,), -1.0) if action_low is None else torch.as_tensor(action_low, dtype=torch.float32)
        high = torch.full((action_dim,), 1.0) if action_high is None else torch.as_tensor(action_high, dtype=torch.float32)
        self.register_buffer("action_loc", (high + low) / 2)
        self.register_buffer("action_half_range", (high - low) / 2)
        self.register_buffer("return_scale", torch.tensor(float(return_scale)))

    def hidden(
        self,
        observation: torch.Tensor,
        action: torch.Tensor,
        return_to_go: torch.Tensor,
        timestep: torch.Tensor,
    ) -> torch.Tensor:
        """The transformer's output at the state tokens, ``[B, K, embed_dim]``."""
        B, K = observation.shape[0], observation.shape[1]
        time = self.embed_timestep(timestep.reshape(B, K).long().clamp(0, self.max_ep_len - 1))
        tokens = torch.stack(
            (
                self.embed_return(return_to_go / self.return_scale) + time,
                self.embed_state(observation) + time,
                self.embed_action(action) + time,
            ),
            dim=2,
        ).reshape(B, 3 * K, -1)
        # the action head reads the state tokens only (positions 1, 4, 7, ...)
        state_tokens = torch.arange(1, 3 * K, 3, device=tokens.device)
        return self.transformer(self.embed_ln(tokens), output_index=state_tokens)

    def squash(self, pre_tanh: torch.Tensor) -> torch.Tensor:
        """``tanh`` scaled to the action bounds."""
        return torch.tanh(pre_tanh) * self.action_half_range + self.action_loc

    def forward(
        self,
        observation: torch.Tensor,
        action: torch.Tensor,
        return_to_go: torch.Tensor,
        timestep: torch.Tensor,
    ) -> torch.Tensor:
        return self.squash(self.predict_action(self.hidden(observation, action, return_to_go, timestep)))

    def act(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The deterministic action at every state token (what the evaluation policy executes)."""
        return self(*inputs)


class StochasticDecisionTransformerNet(DecisionTransformerNet):
    """Online Decision Transformer's head: ``(loc, scale)`` of a tanh-squashed Gaussian per step.

    Zheng, Zhang & Grover 2022 (arXiv:2202.05607), as TorchRL's ``OnlineDTActor``:
    ``log std = tanh(.)`` mapped to ``[-5, 2]``. Feed ``(loc, scale)`` to TorchRL's
    ``TanhNormal`` with the action bounds; :meth:`act` is its mode ``squash(loc)``.
    """

    def __init__(self, state_dim: int, action_dim: int, **kwargs) -> None:
        super().__init__(state_dim, action_dim, **kwargs)
        self.predict_log_std = nn.Linear(self.predict_action.in_features, action_dim)
        self.log_std_min, self.log_std_max = -5.0, 2.0

    def forward(self, observation, action, return_to_go, timestep) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hidden(observation, action, return_to_go, timestep)
        log_std = torch.tanh(self.predict_log_std(h))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (log_std + 1.0)
        return self.predict_action(h), log_std.exp()

    def act(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.squash(self(*inputs)[0])


class DecisionTransformerActor(TensorDictModuleBase):
    """The network as a tensordict module over trajectory windows, for TorchRL's ``DTLoss``.

    Reads ``observation``, ``action``, ``return_to_go`` and ``step_count`` (the step's
    index in its episode, TorchRL's ``StepCounter`` key) from windows ``[B, K]`` or flat
    ``[B*K]``, and writes ``action_pred`` in the same shape.

    Args:
        net: a :class:`DecisionTransformerNet`.

    Keyword Args:
        context_len: the window length ``K`` of flat batches.
        in_keys: ``[observation, action, return_to_go, step_count]`` keys.
        out_key: where the predicted action goes.
        out_keys: several outputs instead, for a network returning a tuple
            (``["loc", "scale"]`` for :class:`StochasticDecisionTransformerNet`).
    """

    def __init__(
        self,
        net: DecisionTransformerNet,
        *,
        context_len: int,
        in_keys: Sequence[NestedKey] = ("observation", "action", "return_to_go", "step_count"),
        out_key: NestedKey = "action_pred",
        out_keys: Optional[Sequence[NestedKey]] = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.context_len = int(context_len)
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys) if out_keys is not None else [out_key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        w = windows(tensordict, self.context_len, "DecisionTransformerActor")
        obs, act, rtg, step = (w.get(k) for k in self.in_keys)
        preds = self.net(obs, act, rtg, step)
        for key, pred in zip(self.out_keys, preds if isinstance(preds, tuple) else (preds,)):
            tensordict.set(key, pred.reshape(*tensordict.shape, pred.shape[-1]))
        return tensordict


class DecisionTransformerPolicy(ContextPolicy):
    """Evaluation policy that conditions on a target return and keeps a rolling context.

    Call :meth:`reset` at the start of every episode (``.train()`` and ``.eval()``
    reset too); then call it once per environment step on that step's TensorDict
    (batch ``[]`` or ``[n]``).
    Each call appends ``(return-to-go, observation)`` to the context of the last
    ``context_len`` steps, predicts the action at the newest state and stores it.
    The return-to-go starts at ``target_return`` and drops by each reward received.

    Reads ``observation``, and when present ``reward`` (the reward of the previous
    step, in environment units; ignored on the first step) and ``env_index`` (which
    environment each row is, so rows may drop out as episodes end). Writes ``action``.

    Args:
        net: a :class:`DecisionTransformerNet` (its :meth:`~DecisionTransformerNet.act` is used).

    Keyword Args:
        context_len: how many past steps the model sees.
        target_return: return to condition on, in environment units.
        reward_scale, reward_shift: the data's reward transform (training rewards are
            ``reward * scale + shift``); environment rewards get the same.
    """

    def __init__(
        self,
        net: DecisionTransformerNet,
        *,
        context_len: int,
        target_return: float,
        reward_scale: float = 1.0,
        reward_shift: float = 0.0,
    ) -> None:
        super().__init__()
        self.net = net
        self.context_len = int(context_len)
        self.target_return = float(target_return)
        self.reward_scale, self.reward_shift = float(reward_scale), float(reward_shift)
        self.in_keys = ["observation"]
        self.out_keys = ["action"]
        self._warned_reward = False
        self.reset()

    def reset(self) -> None:
        """Forget the context: the next call starts a new episode at ``target_return``."""
        self._obs: Optional[torch.Tensor] = None
        self._act = self._rtg = self._step = self.return_to_go = self._t = None
        self.context_length = 0

    def _allocate(self, slots: int, obs: torch.Tensor) -> None:
        K, dev = self.context_len, obs.device
        self._obs = obs.new_zeros(slots, K, obs.shape[-1])
        self._act = obs.new_zeros(slots, K, self.net.action_dim)
        self._rtg = obs.new_zeros(slots, K, 1)
        self._step = torch.zeros(slots, K, dtype=torch.long, device=dev)
        self.return_to_go = obs.new_full((slots, 1), self.target_return * self.reward_scale)
        self._t = torch.zeros(slots, dtype=torch.long, device=dev)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        single = tensordict.batch_dims == 0
        td = tensordict.unsqueeze(0) if single else tensordict
        obs = td.get("observation")
        rows = env_rows(td, obs, self._obs, type(self).__name__)
        first = self._obs is None
        if first:
            slots = obs.shape[0] if td.get("env_index", None) is None else int(rows.max()) + 1
            self._allocate(slots, obs)
        else:
            reward = td.get("reward", None)
            if reward is None:
                if not self._warned_reward:
                    warnings.warn(
                        "DecisionTransformerPolicy got no 'reward' key, so the return-to-go stays at the target; "
                        "pass the previous step's reward as 'reward' [n, 1]",
                        stacklevel=2,
                    )
                    self._warned_reward = True
            else:
                r = reward.reshape(-1, 1).to(obs.dtype) * self.reward_scale + self.reward_shift
                self.return_to_go[rows] = self.return_to_go[rows] - r
            self._t[rows] += 1
        with torch.no_grad():
            if self.context_length == self.context_len:
                # the window is full: drop the oldest step of every slot
                for buf in (self._obs, self._act, self._rtg, self._step):
                    buf.copy_(buf.roll(-1, dims=1))
            else:
                self.context_length += 1
            pos = self.context_length - 1
            self._obs[rows, pos] = obs
            self._act[rows, pos] = 0.0
            self._rtg[rows, pos] = self.return_to_go[rows]
            self._step[rows, pos] = self._t[rows]
            L = self.context_length
            pred = self.net.act(self._obs[rows, :L], self._act[rows, :L], self._rtg[rows, :L], self._step[rows, :L])[:, -1]
            self._act[rows, pos] = pred
        tensordict.set("action", pred.squeeze(0) if single else pred)
        return tensordict
