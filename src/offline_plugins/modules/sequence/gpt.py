"""A small causal transformer (GPT) for the sequence-model algorithms.

Ours rather than transformers' ``GPT2Model`` (which TorchRL's ``DecisionTransformer``
wraps): it runs attention through :func:`torch.nn.functional.scaled_dot_product_attention`
with ``is_causal=True`` and builds no attention mask or position table per call,
which makes Decision Transformer training faster at the same size
(``bench/sequence_bench.py``), and it keeps no vocabulary it does not use.

>>> import torch
>>> gpt = CausalTransformer(16, num_layers=2, num_heads=2, max_len=8)
>>> x = torch.randn(3, 5, 16)
>>> y = gpt(x)
>>> y.shape
torch.Size([3, 5, 16])
>>> x2 = x.clone(); x2[:, 3:] = 0  # later tokens never change earlier outputs
>>> _ = gpt.eval()
>>> torch.allclose(gpt(x)[:, :3], gpt(x2)[:, :3], atol=1e-6)
True
>>> idx = torch.tensor([1, 4])  # only some outputs: the same values, less work
>>> torch.allclose(gpt(x, output_index=idx), gpt(x)[:, idx], atol=1e-5)
True
>>> cache = []  # token-by-token decoding gives the same outputs
>>> steps = [gpt(x[:, :3], cache=cache)] + [gpt(x[:, t : t + 1], cache=cache) for t in (3, 4)]
>>> torch.allclose(torch.cat(steps, 1), gpt(x), atol=1e-5)
True
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalSelfAttention", "TransformerBlock", "CausalTransformer"]

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which token ``t`` sees tokens ``<= t``."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, query_index: Optional[torch.Tensor] = None, cache: Optional[dict] = None
    ) -> torch.Tensor:
        B, T, E = x.shape
        H = self.num_heads
        p = self.attn_dropout if self.training else 0.0
        if cache is not None:
            # incremental decoding: x holds the new tokens; keys and values of the
            # earlier ones are in the cache, and the new ones are added to it
            q, k, v = self.qkv(x).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            past = k.shape[2] - T
            mask = None
            if T > 1:
                mask = (torch.arange(T, device=x.device).unsqueeze(-1) + past) >= torch.arange(past + T, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, E)))
        if query_index is None:
            q, k, v = self.qkv(x).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, E)))
        # only the rows at query_index are wanted: project queries for them alone
        n = query_index.shape[0]
        q = F.linear(x[:, query_index], self.qkv.weight[:E], self.qkv.bias[:E]).view(B, n, H, E // H).transpose(1, 2)
        k, v = F.linear(x, self.qkv.weight[E:], self.qkv.bias[E:]).view(B, T, 2, H, E // H).permute(2, 0, 3, 1, 4)
        mask = query_index.unsqueeze(-1) >= torch.arange(T, device=x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, n, E)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm GPT block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1, activation: str = "gelu") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim),
            _ACTIVATIONS[activation](),
            nn.Linear(4 * embed_dim, embed_dim),
            nn.Dropout(dropout),
        )

    def forward(
        self, x: torch.Tensor, query_index: Optional[torch.Tensor] = None, cache: Optional[dict] = None
    ) -> torch.Tensor:
        if query_index is None:
            x = x + self.attn(self.ln1(x), cache=cache)
        else:
            x = x[:, query_index] + self.attn(self.ln1(x), query_index)
        return x + self.mlp(self.ln2(x))


class CausalTransformer(nn.Module):
    """A stack of causal GPT blocks over input embeddings ``[B, T, E] -> [B, T, E]``.

    Args:
        embed_dim: token width ``E``.

    Keyword Args:
        num_layers: blocks.
        num_heads: attention heads per block.
        max_len: the longest sequence; with ``positional=True`` the size of the learned
            position table.
        dropout: dropout on the input, attention weights and residual branches.
        activation: ``"gelu"`` or ``"relu"`` (Decision Transformer's reference uses ReLU).
        positional: add a learned position embedding (Trajectory Transformer); Decision
            Transformer adds timestep embeddings itself and passes ``False``.
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        num_layers: int = 3,
        num_heads: int = 1,
        max_len: int = 1024,
        dropout: float = 0.1,
        activation: str = "gelu",
        positional: bool = False,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
        self.max_len = int(max_len)
        self.pos = nn.Parameter(torch.zeros(1, self.max_len, embed_dim)) if positional else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(embed_dim, num_heads, dropout, activation) for _ in range(num_layers)
        )
        self.ln_f = nn.LayerNorm(embed_dim)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        x: torch.Tensor,
        output_index: Optional[torch.Tensor] = None,
        cache: Optional[list] = None,
    ) -> torch.Tensor:
        """``[B, T, E] -> [B, T, E]``, or ``[B, len(output_index), E]``: the outputs at those positions only.

        With ``output_index`` the last block computes queries, attention output and MLP
        for those positions alone (keys and values still cover every token), which is
        exact and saves most of the last block's work when few outputs are read
        (Decision Transformer reads one token in three).

        With ``cache`` (a list, empty at the first call) ``x`` holds only the tokens
        that follow those already seen; each block keeps its keys and values there,
        so generating token by token costs one token per call. Reorder or repeat the
        batch of a cache with :meth:`select_cache`.
        """
        past = 0
        if cache is not None:
            if not cache:
                cache.extend({} for _ in self.blocks)
            past = cache[0]["k"].shape[2] if "k" in cache[0] else 0
        if past + x.shape[-2] > self.max_len:
            raise ValueError(f"sequence of {past + x.shape[-2]} tokens is longer than max_len={self.max_len}")
        if self.pos is not None:
            x = x + self.pos[:, past : past + x.shape[-2]]
        x = self.drop(x)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x, output_index if i == last else None, None if cache is None else cache[i])
        return self.ln_f(x)

    @staticmethod
    def select_cache(cache: list, index: torch.Tensor) -> list:
        """The cache of batch rows ``index`` (for beam search: reorder, repeat, prune)."""
        return [{k: v[index] for k, v in layer.items()} for layer in cache]
