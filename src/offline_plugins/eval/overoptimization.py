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
from statistics import NormalDist
from typing import Optional, Sequence

__all__ = ["fit_gao", "GAO_FORMS", "hacking_signal", "ceiling_signal", "noise_interval"]

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


def _z(one_sided_alpha: float) -> float:
    return NormalDist().inv_cdf(1.0 - one_sided_alpha)


def noise_interval(a: float, b: float, n_a: Optional[int], n_b: Optional[int], *, earlier: int = 1,
                   alpha: float = 0.05) -> float:
    """How far the held-out mean ``b`` may fall below ``a`` by the noise of the held-out set alone:
    the one-sided bound on ``a - b`` for two means of scores in [0, 1] over ``n_a`` and ``n_b``
    prompts (0 where a size is unknown: the scores are taken as exact).

    - Each mean's variance is at most ``m (1 - m) / n`` (Bhatia and Davis 2000: a [0, 1] score of
      mean ``m`` varies at most as a 0/1 one, which exact match is). The two are treated as
      independent; greedy answers to the same prompts are positively correlated, so the bound is
      wider than the truth and errs towards silence.
    - ``a`` is the best of ``earlier`` evaluations, and a run checks once per evaluation: each
      check ``k`` compares against ``k`` earlier scores at level ``alpha / (k^2 (k + 1))``, so
      over a whole run the chance of a warning from noise alone is at most ``alpha`` (the levels
      sum to ``alpha``: a union bound).

    >>> round(noise_interval(0.805, 0.785, 200, 200), 4)  # issue 40's 2-point drop: inside
    0.0791
    >>> round(noise_interval(0.805, 0.785, 200, 200, earlier=8), 4)  # the 9th evaluation
    0.1515
    >>> noise_interval(0.8, 0.7, None, 200)
    0.0
    """
    if not n_a or not n_b:
        return 0.0
    var = sum(min(max(m, 0.0), 1.0) * (1.0 - min(max(m, 0.0), 1.0)) / n for m, n in ((a, n_a), (b, n_b)))
    k = max(int(earlier), 1)
    return _z(alpha / (k * k * (k + 1))) * math.sqrt(var)


def hacking_signal(history: Sequence[dict], *, gold: str, proxy: str, size: str = "heldout_n",
                   alpha: float = 0.05) -> Optional[str]:
    """A warning when, at the last evaluation, the gold score sits below the best earlier one by more
    than the noise of the held-out set while the proxy rose over the same span; else None.

    The noise is :func:`noise_interval` of the two scores over the held-out size each record
    carries (``size``; a record without it is taken as exact): over a whole run, noise alone
    warns with a chance of at most ``alpha``.

    >>> h = [{"step": 10, "g": 0.5, "p": 0.2, "heldout_n": 200}, {"step": 20, "g": 0.805, "p": 0.4, "heldout_n": 200},
    ...      {"step": 30, "g": 0.785, "p": 0.6, "heldout_n": 200}]
    >>> hacking_signal(h, gold="g", proxy="p") is None  # 2 points on 200 prompts: noise
    True
    >>> hacking_signal(h + [{"step": 40, "g": 0.66, "p": 0.7, "heldout_n": 200}], gold="g", proxy="p")
    'the gold score fell from 0.805 at step 20 to 0.66 at step 40 (-14.5 points, beyond the 13.1 points the noise of 200 held-out prompts allows at 95 % over the run) while the proxy reward rose 0.4 -> 0.7'
    """
    usable = [r for r in history if r.get(gold) is not None and r.get(proxy) is not None]
    if len(usable) < 2:
        return None
    last, earlier = usable[-1], usable[:-1]
    best = max(earlier, key=lambda r: float(r[gold]))
    drop = float(best[gold]) - float(last[gold])
    if drop <= 0 or float(last[proxy]) <= float(best[proxy]):
        return None
    width = noise_interval(float(best[gold]), float(last[gold]), best.get(size), last.get(size),
                           earlier=len(earlier), alpha=alpha)
    if drop <= width:
        return None
    noise = (f", beyond the {100 * width:.1f} points the noise of {int(last[size])} held-out prompts allows "
             f"at {100 * (1 - alpha):.0f} % over the run" if width > 0 else "")
    return (f"the gold score fell from {float(best[gold]):.3g} at step {best['step']} to {float(last[gold]):.3g} at "
            f"step {last['step']} (-{100 * drop:.1f} points{noise}) while the proxy reward rose "
            f"{float(best[proxy]):.3g} -> {float(last[proxy]):.3g}")


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
