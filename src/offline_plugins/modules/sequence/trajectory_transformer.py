"""Trajectory Transformer (Janner et al. 2021, arXiv:2106.02039): a GPT over discretised transitions.

A transition ``(s, a, r, V)`` becomes ``D = obs_dim + act_dim + 2`` tokens, one per
dimension; a window of ``K`` transitions is a sequence of ``K * D`` tokens. As in the
reference, the token of dimension ``j`` is embedded from its own slice of one table
(``token + j * bins``), and the logits after position ``i`` come from a separate
linear head per dimension ``i mod D``.

>>> import torch
>>> net = TrajectoryTransformerNet(transition_dim=4, bins=10, embed_dim=16, num_layers=1, num_heads=2, max_transitions=3)
>>> tokens = torch.randint(0, 10, (2, 11))
>>> net(tokens).shape
torch.Size([2, 11, 10])
>>> _ = net.eval(); cache = []  # decoding token by token with a cache gives the same logits
>>> steps = torch.cat([net(tokens[:, :4], cache=cache)] + [net(tokens[:, t : t + 1], cache=cache) for t in range(4, 11)], 1)
>>> torch.allclose(steps, net(tokens), atol=1e-5)
True
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDictBase
from torch import nn

from offline_plugins.modules.sequence.decision_transformer import ContextPolicy, env_rows
from offline_plugins.modules.sequence.gpt import CausalTransformer
from offline_plugins.modules.sequence.planning import PlannerMixin, clock_now

__all__ = ["TrajectoryTransformerNet", "TrajectoryTransformerPlanner", "filter_cdf"]


class TrajectoryTransformerNet(nn.Module):
    """``tokens [B, T] -> logits [B, T, bins]`` of the next token, for ``T <= max_transitions * D``.

    The first token of the sequence must be the first dimension of a transition.

    Args:
        transition_dim: tokens per transition ``D``.
        bins: vocabulary per dimension.

    Keyword Args:
        embed_dim, num_layers, num_heads, dropout: the GPT (reference: 128, 4, 4, 0.1).
        max_transitions: the longest window in transitions (reference: 10).
    """

    def __init__(
        self,
        transition_dim: int,
        bins: int,
        *,
        embed_dim: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        dropout: float = 0.1,
        max_transitions: int = 10,
    ) -> None:
        super().__init__()
        self.transition_dim, self.bins = int(transition_dim), int(bins)
        self.max_len = int(max_transitions) * self.transition_dim
        self.embed = nn.Embedding(self.transition_dim * self.bins, embed_dim)
        self.transformer = CausalTransformer(
            embed_dim, num_layers=num_layers, num_heads=num_heads, max_len=self.max_len, dropout=dropout, positional=True
        )
        # one [embed_dim -> bins] head per transition dimension (the reference's EinLinear)
        self.head_weight = nn.Parameter(torch.randn(self.transition_dim, embed_dim, self.bins) * 0.02)
        self.head_bias = nn.Parameter(torch.zeros(self.transition_dim, self.bins))
        nn.init.normal_(self.embed.weight, std=0.02)
        self.register_buffer("_offsets", torch.arange(self.transition_dim) * self.bins, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: Optional[list] = None) -> torch.Tensor:
        """Logits after each token; with ``cache`` (see :class:`CausalTransformer`) ``tokens``
        continue the cached sequence."""
        B, T = tokens.shape
        D = self.transition_dim
        past = cache[0]["k"].shape[2] if cache else 0
        dim_of = (torch.arange(T, device=tokens.device) + past) % D
        h = self.transformer(self.embed(tokens + self._offsets[dim_of]), cache=cache)
        if past or T % D:
            # the head of each position's own dimension
            return torch.einsum("bte,tev->btv", h, self.head_weight[dim_of]) + self.head_bias[dim_of]
        h = h.reshape(B, -1, D, h.shape[-1])
        logits = torch.einsum("bnde,dev->bndv", h, self.head_weight) + self.head_bias
        return logits.reshape(B, T, self.bins)


def filter_cdf(logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Drop the least likely tokens whose total probability is below ``threshold`` (the reference's ``cdf``).

    >>> filter_cdf(torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])), 0.5).isinf().tolist()
    [[True, True, False, False]]
    """
    probs = logits.softmax(-1)
    sorted_probs = probs.sort(-1).values
    below = sorted_probs.cumsum(-1) < threshold
    # the smallest probability that survives: the first one past the dropped mass
    keep_from = below.sum(-1, keepdim=True).clamp_max(probs.shape[-1] - 1)
    cutoff = sorted_probs.gather(-1, keep_from)
    return logits.masked_fill(probs < cutoff, float("-inf"))


def _choose_token(logits: torch.Tensor, *, topk: Optional[int], cdf: Optional[float]) -> torch.Tensor:
    """The next token of each row: argmax for ``topk=1``, else a draw from the filtered logits."""
    if cdf is not None:
        logits = filter_cdf(logits, cdf)
    if topk == 1:
        return logits.argmax(-1, keepdim=True)
    if topk is not None:
        v, _ = logits.topk(topk, -1)
        logits = logits.masked_fill(logits < v[:, -1:], float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1)


class TrajectoryTransformerPlanner(PlannerMixin, ContextPolicy):
    """Beam-search planning with a trained Trajectory Transformer: the evaluation policy.

    At each step the context (the last ``max_context_transitions - 1`` transitions,
    then the current observation's tokens) is extended ``horizon`` transitions ahead: action
    tokens are sampled (least likely ``cdf_act`` of the mass dropped), reward and value
    tokens predicted, and the ``beam_width`` plans with the highest
    ``sum_{k<t} gamma^k E[r_k] + gamma^t E[V_t]`` kept (``V_t``, the value token, is the
    discounted return from step ``t`` on, ``r_t`` included); observation tokens are then
    predicted greedily (``k_obs=1``). The first action of the best plan is returned.
    Every environment of the batch is planned for at once.

    Call :meth:`reset` at the start of every episode (``.train()`` and ``.eval()``
    reset too). Reads ``observation`` and, when present, ``reward`` (the previous
    step's reward, environment units; else the planned reward is kept in the context)
    and ``env_index`` (rows may drop out as episodes end). Writes ``action``. Planning
    time is in :attr:`planning_seconds` and :meth:`planning_stats`.

    Args:
        net: a trained :class:`TrajectoryTransformerNet`.
        discretizer: the :class:`~offline_plugins.modules.sequence.discretizer.Discretizer` it was trained with.
        observation_dim, action_dim: widths of the two.

    Keyword Args:
        horizon: planned transitions (reference: 15).
        beam_width: plans kept per step (reference: 128).
        n_expand: samples per plan per step (reference: 2).
        max_context_transitions: transitions of the context, the current one included
            (reference: 5). The model reads at most ``net.max_len`` tokens (its training
            window); a plan that fits runs with a key/value cache.
        discount: of the planned rewards and final value (reference: 0.99).
        cdf_act: probability mass of the least likely action tokens dropped (reference: 0.6).
        k_obs: observation tokens are sampled from the ``k_obs`` most likely (1: greedy).
        reward_scale, reward_shift: the data's reward transform, applied to environment rewards.
        plan_every: plan at every ``plan_every``-th step and execute the best plan's
            actions in between (1: replan every step, as the reference).
    """

    def __init__(
        self,
        net: TrajectoryTransformerNet,
        discretizer,
        observation_dim: int,
        action_dim: int,
        *,
        horizon: int = 5,
        beam_width: int = 32,
        n_expand: int = 2,
        max_context_transitions: int = 3,
        discount: float = 0.99,
        cdf_act: Optional[float] = 0.6,
        k_obs: Optional[int] = 1,
        reward_scale: float = 1.0,
        reward_shift: float = 0.0,
        plan_every: int = 1,
    ) -> None:
        super().__init__()
        self._init_planning(plan_every, horizon)
        self.net, self.discretizer = net, discretizer
        self.obs_dim, self.act_dim = int(observation_dim), int(action_dim)
        self.D = self.obs_dim + self.act_dim + 2
        self.horizon, self.beam_width, self.n_expand = int(horizon), int(beam_width), int(n_expand)
        self.max_context_transitions = min(int(max_context_transitions), net.max_len // self.D)
        self.discount = float(discount)
        self.cdf_act, self.k_obs = cdf_act, k_obs
        self.reward_scale, self.reward_shift = float(reward_scale), float(reward_shift)
        self.in_keys, self.out_keys = ["observation"], ["action"]
        self.reset()

    def reset(self) -> None:
        """Forget the context: the next call starts a new episode."""
        self._context: Optional[torch.Tensor] = None  # [slots, L * D] tokens of finished transitions
        self._last_obs: Optional[torch.Tensor] = None  # [slots, obs_dim] tokens
        self._pending: Optional[torch.Tensor] = None  # [slots, act_dim + 2] tokens of the step taken
        self._plan: Optional[torch.Tensor] = None  # [slots, horizon * D] best plan of the last planning step
        self._age = 0  # steps since that plan was made

    def _crop(self, x: torch.Tensor) -> torch.Tensor:
        # the model was trained on windows of max_len tokens; longer sequences slide
        max_block = self.net.max_len - 1
        extra = x.shape[1] - max_block
        if extra <= 0:
            return x
        n_crop = -(-extra // self.D) * self.D  # whole transitions, so position i is dimension i mod D
        return x[:, n_crop:]

    def _sample(self, x: torch.Tensor, n: int, *, topk: Optional[int] = None, cdf: Optional[float] = None):
        probs_out = []
        for _ in range(n):
            logits = self.net(self._crop(x))[:, -1]
            probs_out.append(logits.softmax(-1))
            tok = _choose_token(logits, topk=topk, cdf=cdf)
            x = torch.cat([x, tok], 1)
        return x, torch.stack(probs_out, 1)

    def _sample_cached(self, x, logits, cache, n: int, *, topk: Optional[int] = None, cdf: Optional[float] = None):
        """Like :meth:`_sample`, from the logits after ``x`` and a cache holding ``x``."""
        probs_out = []
        for _ in range(n):
            probs_out.append(logits.softmax(-1))
            tok = _choose_token(logits, topk=topk, cdf=cdf)
            x = torch.cat([x, tok], 1)
            logits = self.net(tok, cache=cache)[:, -1]
        return x, logits, torch.stack(probs_out, 1)

    def _fits_cache(self, prefix_len: int) -> bool:
        # the cache needs fixed positions: the whole plan must fit without cropping
        return hasattr(self.net, "transformer") and prefix_len + self.horizon * self.D <= self.net.max_len

    @torch.no_grad()
    def plan(self, prefix: torch.Tensor) -> torch.Tensor:
        """Best planned sequence ``[n, horizon * D]`` after ``prefix`` ``[n, T0]`` (per row).

        When the prefix and the plan fit in the model's context, the model runs token
        by token with a key/value cache (reordered with the beams); otherwise every
        token re-reads the cropped sequence, as in the reference.
        """
        n, T0 = prefix.shape
        S, A, H = self.obs_dim, self.act_dim, self.horizon
        cached = self._fits_cache(T0)
        discounts = self.discount ** torch.arange(H + 1, device=prefix.device, dtype=torch.float32)
        x = prefix.unsqueeze(1)  # [n, beams, T]
        rewards = prefix.new_zeros(n, 1, H + 1, dtype=torch.float32)
        cache, logits = None, None
        if cached:
            cache = []
            logits = self.net(prefix, cache=cache)[:, -1]
        values = None

        def sample(flat, count, **kw):
            nonlocal logits
            if cached:
                flat, logits, probs = self._sample_cached(flat, logits, cache, count, **kw)
                return flat, probs
            return self._sample(flat, count, **kw)

        for t in range(H):
            b = x.shape[1] * self.n_expand
            # plans are laid out [env, beam]; expanding repeats the beams of each env
            rep = (torch.arange(n, device=x.device).unsqueeze(-1) * x.shape[1] + torch.arange(b, device=x.device) % x.shape[1]).reshape(-1)
            x = x.repeat(1, self.n_expand, 1).reshape(n * b, -1)
            rewards = rewards.repeat(1, self.n_expand, 1).reshape(n * b, H + 1)
            if cached:
                cache[:] = CausalTransformer.select_cache(cache, rep)
                logits = logits[rep]
            x, _ = sample(x, A, cdf=self.cdf_act)
            x, probs = sample(x, 2, topk=1)
            rewards = rewards.clone()
            rewards[:, t] = self.discretizer.expectation(probs[:, 0], [S + A])
            # the value token is the discounted return from step t on, r_t included
            # (``discounted_return_to_go``), so it closes the sum at gamma^t, not gamma^(t+1)
            value_t = self.discretizer.expectation(probs[:, 1], [S + A + 1])
            values = ((rewards[:, :t] * discounts[:t]).sum(-1) + discounts[t] * value_t).reshape(n, b)
            values, idx = values.topk(min(self.beam_width, b), dim=-1)
            keep = (torch.arange(n, device=x.device).unsqueeze(-1) * b + idx).reshape(-1)
            x, rewards = x[keep], rewards[keep]
            if cached:
                cache[:] = CausalTransformer.select_cache(cache, keep)
                logits = logits[keep]
            if t < H - 1:
                x, _ = sample(x, S, topk=self.k_obs)
            x = x.reshape(n, idx.shape[1], -1)
            rewards = rewards.reshape(n, idx.shape[1], -1)
        best = values.argmax(-1)
        return x[torch.arange(n, device=x.device), best, T0:]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        start = clock_now()
        single = tensordict.batch_dims == 0
        td = tensordict.unsqueeze(0) if single else tensordict
        obs = td.get("observation")
        slots = obs.shape[0] if td.get("env_index", None) is None else None
        rows = env_rows(td, obs, self._last_obs, type(self).__name__)
        S, A, D = self.obs_dim, self.act_dim, self.D
        if self._context is None:
            n_slots = slots if slots is not None else int(rows.max()) + 1
            self._context = torch.zeros(n_slots, 0, dtype=torch.long, device=obs.device)
            self._last_obs = torch.zeros(n_slots, S, dtype=torch.long, device=obs.device)
            self._pending = torch.zeros(n_slots, A + 2, dtype=torch.long, device=obs.device)
        else:
            reward = td.get("reward", None)
            if reward is not None:
                r = reward.reshape(-1, 1).to(torch.float32) * self.reward_scale + self.reward_shift
                self._pending[rows, A] = self.discretizer.encode(r, start=S + A).reshape(-1)
            done = torch.cat([self._last_obs, self._pending], -1)
            keep = (self.max_context_transitions - 1) * D
            self._context = torch.cat([self._context, done], 1)[:, -keep:] if keep > 0 else self._context[:, :0]
        obs_tokens = self.discretizer.encode(obs.to(torch.float32), start=0)
        self._last_obs[rows] = obs_tokens
        if self._plan is not None and self._age < self.plan_every:
            step = self._plan[rows, self._age * D : self._age * D + A + 2]
            self._age += 1
        else:
            plan = self.plan(torch.cat([self._context[rows], obs_tokens], 1))
            if self._plan is None:
                self._plan = plan.new_zeros(self._context.shape[0], plan.shape[1])
            self._plan[rows] = plan
            self._age = 1
            step = plan[:, : A + 2]
        self._pending[rows] = step
        action = self.discretizer.decode(step[:, :A], start=S).to(obs.dtype)
        tensordict.set("action", action.squeeze(0) if single else action)
        self.count_planning(start, obs.shape[0])
        return tensordict
