"""Per-dimension discretisation of continuous vectors into tokens (Trajectory Transformer).

Each dimension gets its own ``bins`` intervals: equal-width between the data's
minimum and maximum (``"uniform"``), or holding equal shares of the data
(``"quantile"``, the Trajectory Transformer's default). A value maps to the index of
its interval and decodes to the interval's midpoint, so the round trip of an
in-range value is off by at most half that interval's width.

>>> import torch
>>> x = torch.tensor([[0.0, 10.0], [1.0, 20.0], [2.0, 40.0], [3.0, 80.0]])
>>> d = Discretizer.fit(x, bins=3, method="uniform")
>>> d.encode(x).tolist()
[[0, 0], [1, 0], [2, 1], [2, 2]]
>>> d.decode(d.encode(x))[:, 0].tolist()
[0.5, 1.5, 2.5, 2.5]
>>> bool(((d.decode(d.encode(x)) - x).abs() <= d.max_error()).all())
True
>>> Discretizer.fit(x, bins=1)
Traceback (most recent call last):
...
offline_plugins.errors.DiscretizationError: Discretizer: bins=1 is too few; each dimension needs at least 2 bins (the Trajectory Transformer uses 100): set bins=100
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from offline_plugins.errors import DiscretizationError

__all__ = ["Discretizer"]

METHODS = ("uniform", "quantile")


class Discretizer(nn.Module):
    """Maps ``[..., D]`` floats to ``[..., D]`` int64 tokens in ``[0, bins)`` and back.

    Build it with :meth:`fit`; the edges are buffers, so they are saved with the model
    and move with ``.to()``.

    Args:
        edges: ``[D, bins + 1]`` non-decreasing interval edges per dimension.
    """

    def __init__(self, edges: torch.Tensor) -> None:
        super().__init__()
        if edges.ndim != 2 or edges.shape[1] < 3:
            bins = edges.shape[-1] - 1 if edges.ndim else 0
            raise DiscretizationError(
                f"Discretizer: bins={bins} is too few; each dimension needs at least 2 bins "
                "(the Trajectory Transformer uses 100): set bins=100"
            )
        self.register_buffer("edges", edges.to(torch.float32).contiguous())
        self.register_buffer("centers", (edges[:, 1:] + edges[:, :-1]).to(torch.float32) / 2)

    @property
    def bins(self) -> int:
        return self.edges.shape[1] - 1

    @property
    def dim(self) -> int:
        return self.edges.shape[0]

    @classmethod
    def fit(cls, data: torch.Tensor, bins: int, method: str = "quantile") -> "Discretizer":
        """Edges from ``data`` ``[M, D]``: ``"uniform"`` (equal width) or ``"quantile"`` (equal mass)."""
        if int(bins) < 2:
            raise DiscretizationError(
                f"Discretizer: bins={bins} is too few; each dimension needs at least 2 bins "
                "(the Trajectory Transformer uses 100): set bins=100"
            )
        if method not in METHODS:
            raise DiscretizationError(f"Discretizer: method={method!r} is not one of {', '.join(METHODS)}")
        x = data.reshape(-1, data.shape[-1]).to(torch.float64)
        q = torch.linspace(0, 1, int(bins) + 1, dtype=torch.float64, device=x.device)
        if method == "uniform":
            lo, hi = x.min(0).values, x.max(0).values
            edges = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * q
        else:
            # torch.quantile refuses very large inputs; sort once and index instead
            xs = x.sort(0).values
            pos = q * (xs.shape[0] - 1)
            lo_i, hi_i = pos.floor().long(), pos.ceil().long()
            frac = (pos - lo_i).unsqueeze(-1)
            edges = (xs[lo_i] * (1 - frac) + xs[hi_i] * frac).T
        return cls(edges.contiguous())

    def encode(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Index of the interval of each value (values outside the range go to the end bins).

        ``x`` ``[..., k]`` holds dimensions ``start .. start + k - 1``.
        """
        k = x.shape[-1]
        edges = self.edges[start : start + k, 1:-1].contiguous()
        flat = x.reshape(-1, k).T.contiguous().to(edges.dtype)
        return torch.searchsorted(edges, flat, right=True).T.reshape(x.shape)

    def decode(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Midpoint of each token's interval (``tokens`` ``[..., k]`` of dimensions ``start ..``)."""
        k = tokens.shape[-1]
        flat = tokens.reshape(-1, k).T
        return self.centers[start : start + k].gather(1, flat.long()).T.reshape(tokens.shape)

    def expectation(self, probs: torch.Tensor, dims: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``sum_i p_i * center_i``: the mean of distributions ``[..., n, bins]`` over dimensions ``dims``."""
        centers = self.centers if dims is None else self.centers[list(dims)]
        return (probs * centers.to(probs.dtype)).sum(-1)

    def max_error(self) -> torch.Tensor:
        """``[D]``: the largest round-trip error of an in-range value (half the widest bin)."""
        return (self.edges[:, 1:] - self.edges[:, :-1]).max(-1).values / 2

    def check_resolution(self, data: torch.Tensor, names: Sequence[str], tolerance: float) -> None:
        """Raise :class:`DiscretizationError` when a dimension's median round-trip error exceeds
        ``tolerance`` times its standard deviation: too few bins for the data.

        The median, not the mean, so that a few outliers in a wide end bin (terminal
        rewards with a termination penalty) do not condemn an otherwise fine grid.
        """
        x = data.reshape(-1, self.dim).to(torch.float32)
        err = (self.decode(self.encode(x)) - x).abs().median(0).values
        rel = err / x.std(0).clamp_min(1e-8)
        worst = int(rel.argmax())
        if float(rel[worst]) > tolerance:
            need = int(self.bins * float(rel[worst]) / tolerance) + 1
            raise DiscretizationError(
                f"Discretizer: {self.bins} bins reconstruct {names[worst]} with a median error of "
                f"{float(rel[worst]):.2f} standard deviations (tolerance {tolerance:g}); too few bins for this "
                f"data: use more bins, at least {max(need, self.bins + 1)} (the Trajectory Transformer uses 100)"
            )
