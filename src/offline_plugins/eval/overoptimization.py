"""Reward over-optimisation: the gold score against the KL to the reference, and where it peaks.

Gao, Schulman and Hilton 2023, "Scaling Laws for Reward Model Overoptimization"
(arXiv:2210.10760) measure the gold reward of policies optimised against a proxy
reward model as a function of ``d = sqrt(KL(pi || pi_init))`` and fit

* best-of-n: ``R(d) = d (alpha - beta d)``, peaking at ``d* = alpha / (2 beta)``;
* RL:        ``R(d) = d (alpha - beta log d)``, peaking at ``d* = exp(alpha / beta - 1)``;

with ``R`` the gold score's gain over the initial policy (``R(0) = 0``). Both are linear
in ``(alpha, beta)``, so a least-squares fit over a run's evaluations gives them and the
KL ``d*^2`` at which more optimisation starts to hurt. The proxy keeps rising past that
point: the seeds' 5.6.8 ("reward hacking").

>>> import math
>>> d = [0.5, 1.0, 1.5, 2.0]
>>> fit = fit_gao(d, [x * (1.0 - 0.5 * x) for x in d], form="bon")
>>> round(fit["alpha"], 6), round(fit["beta"], 6), round(fit["peak_d"], 6), round(fit["peak_kl"], 6)
(1.0, 0.5, 1.0, 1.0)
>>> fit = fit_gao(d, [x * (2.0 - math.log(x)) for x in d], form="rl")
>>> round(fit["alpha"], 6), round(fit["beta"], 6), round(fit["peak_d"], 4)
(2.0, 1.0, 2.7183)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["fit_gao", "GAO_FORMS", "hacking_signal", "ceiling_signal"]

GAO_FORMS = ("bon", "rl")


def _basis(d: float, form: str) -> tuple[float, float]:
    if form == "bon":
        return d, -d * d
    return d, -d * math.log(d) if d > 0 else 0.0


def fit_gao(d: Sequence[float], gain: Sequence[float], *, form: str = "rl") -> Optional[dict]:
    """Least-squares ``alpha, beta`` of Gao et al.'s ``form`` (``"bon"`` or ``"rl"``) through the origin.

    Args:
        d: ``sqrt(KL)`` of each evaluated policy to the initial one (> 0 for ``"rl"``).
        gain: its gold score minus the initial policy's.

    Returns:
        ``alpha``, ``beta``, ``r2`` (of the fit, against the mean gain), ``peak_d``,
        ``peak_kl`` and ``peak_gain`` (None when ``beta <= 0``: no peak within the form),
        ``points``; None with fewer than two usable points or a singular fit.
    """
    if form not in GAO_FORMS:
        raise ValueError(f"form must be one of {', '.join(GAO_FORMS)}, got {form!r}")
    pts = [(float(x), float(y)) for x, y in zip(d, gain)
           if math.isfinite(x) and math.isfinite(y) and (x > 0 or form == "bon")]
    if len(pts) < 2:
        return None
    # normal equations of y = alpha * u + beta * v
    suu = suv = svv = suy = svy = 0.0
    for x, y in pts:
        u, v = _basis(x, form)
        suu, suv, svv, suy, svy = suu + u * u, suv + u * v, svv + v * v, suy + u * y, svy + v * y
    det = suu * svv - suv * suv
    if abs(det) < 1e-12 * max(suu * svv, 1e-300):
        return None
    alpha = (suy * svv - svy * suv) / det
    beta = (svy * suu - suy * suv) / det
    mean = sum(y for _, y in pts) / len(pts)
    ss_res = sum((y - (alpha * _basis(x, form)[0] + beta * _basis(x, form)[1])) ** 2 for x, y in pts)
    ss_tot = sum((y - mean) ** 2 for _, y in pts)
    out = {"form": form, "alpha": alpha, "beta": beta, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None,
           "points": len(pts), "peak_d": None, "peak_kl": None, "peak_gain": None}
    if beta > 1e-9 * max(abs(alpha), 1e-12):  # a beta at rounding level is no curvature: no peak
        peak = alpha / (2 * beta) if form == "bon" else math.exp(alpha / beta - 1.0)
        if peak > 0:
            u, v = _basis(peak, form)
            out.update(peak_d=peak, peak_kl=peak * peak, peak_gain=alpha * u + beta * v)
    return out


def hacking_signal(history: Sequence[dict], *, gold: str, proxy: str, window: int = 2) -> Optional[str]:
    """A warning when, over the last ``window`` evaluations, the gold score fell while the proxy rose; else None.

    >>> h = [{"step": 10, "g": 0.5, "p": 0.2}, {"step": 20, "g": 0.6, "p": 0.4}, {"step": 30, "g": 0.55, "p": 0.6}]
    >>> hacking_signal(h, gold="g", proxy="p", window=1)
    'between steps 20 and 30 the gold score fell 0.6 -> 0.55 while the proxy reward rose 0.4 -> 0.6'
    >>> hacking_signal(h[:2], gold="g", proxy="p", window=1) is None
    True
    """
    usable = [r for r in history if r.get(gold) is not None and r.get(proxy) is not None]
    if len(usable) < window + 1:
        return None
    a, b = usable[-window - 1], usable[-1]
    if b[gold] < a[gold] and b[proxy] > a[proxy]:
        return (f"between steps {a['step']} and {b['step']} the gold score fell {a[gold]:.3g} -> {b[gold]:.3g} "
                f"while the proxy reward rose {a[proxy]:.3g} -> {b[proxy]:.3g}")
    return None


def ceiling_signal(history: Sequence[dict], *, gold: str, proxy: str, baseline: Optional[float] = None,
                   signal_key: str = "groups_without_signal", min_gap: float = 0.5) -> Optional[str]:
    """A warning when the proxy sits at its ceiling while the gold score has not moved; else None.

    At the last evaluation: every group of the round scored its responses alike (``signal_key`` at 1:
    no advantage left to learn from), the proxy reward is the highest of the run and above 0, the gold
    score is no higher than where it started (``baseline``, else the first evaluation's) and sits at
    least ``min_gap`` under the proxy. A verifier that answers its maximum on every response does this
    (the proxy says 1.0, the exact match stays 0 %); a policy that solved the task does not (its gold
    rose with it). Needs two evaluations.

    >>> h = [{"step": 5, "g": 0.0, "p": 1.0, "groups_without_signal": 1.0},
    ...      {"step": 10, "g": 0.0, "p": 1.0, "groups_without_signal": 1.0}]
    >>> ceiling_signal(h, gold="g", proxy="p")
    'at step 10 the proxy reward is at its ceiling (1 on every response: no group has a signal left) while the gold score has not moved from 0 (now 0); the reward may be broken or gamed'
    >>> ceiling_signal([dict(r, g=0.9) for r in h], gold="g", proxy="p") is None  # the gold is with it
    True
    """
    usable = [r for r in history if r.get(gold) is not None and r.get(proxy) is not None]
    if len(usable) < 2:
        return None
    last = usable[-1]
    start = usable[0][gold] if baseline is None else baseline
    top = max(float(r[proxy]) for r in usable)
    if (last.get(signal_key) is not None and float(last[signal_key]) >= 0.999 and float(last[proxy]) >= top > 0
            and float(last[gold]) <= float(start) and float(last[proxy]) - float(last[gold]) >= min_gap):
        return (f"at step {last['step']} the proxy reward is at its ceiling ({float(last[proxy]):.3g} on every "
                f"response: no group has a signal left) while the gold score has not moved from {float(start):.3g} "
                f"(now {float(last[gold]):.3g}); the reward may be broken or gamed")
    return None
