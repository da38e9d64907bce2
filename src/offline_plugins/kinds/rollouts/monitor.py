"""The reward-hacking monitor: proxy reward, gold score and their gap against the KL to the reference.

An online run optimises a proxy (a reward model, a reward function); what the user
wants is a gold score (the task's verifier on held-out prompts, an independent judge).
Past some KL the proxy keeps rising while the gold score falls (Gao, Schulman and Hilton
2023, arXiv:2210.10760; the seeds' 5.6.8). :class:`RewardHackingMonitor` reads each
evaluation of the run, and

* logs ``monitor/gold_gain``, ``monitor/proxy_gain`` and ``monitor/gap`` (their
  difference) with ``monitor/sqrt_kl``;
* keeps the checkpoint with the best gold score (``best_gold.ckpt``) and says at which
  step and KL it was;
* warns when the gold score fell below its best by more than the noise of the held-out set
  (an interval from its size and the two scores, :func:`~offline_plugins.eval.overoptimization.hacking_signal`)
  while the proxy rose, and when the
  proxy sits at its ceiling (every response scored alike, the run's highest) while the gold score
  has not moved (a broken or gamed reward: :func:`~offline_plugins.eval.overoptimization.ceiling_signal`);
* fits Gao et al.'s RL form ``d (alpha - beta log d)`` (and the best-of-n one) to the gold
  gains at the end, and reports the fitted peak.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Optional, Union

from lightning.pytorch import Callback

from offline_plugins.eval.overoptimization import ceiling_signal, fit_gao, hacking_signal

__all__ = ["RewardHackingMonitor", "RewardHackingWarning"]


class RewardHackingWarning(UserWarning):
    """The gold score fell while the proxy reward rose."""


class RewardHackingMonitor(Callback):
    """Watch an evaluation callback's records for over-optimisation of the proxy reward.

    Args:
        evaluation: the run's evaluation callback (its ``history`` of records, and
            ``before``: the reference's scores); place this monitor after it.

    Keyword Args:
        gold: the record's gold score (default ``"exact_match"``: held-out exact match).
        proxy: the record's proxy reward (default ``"reward_mean"``: what the policy is
            optimised on).
        kl: the record's KL to the reference (default ``"kl_to_reference"``).
        checkpoint: where the best-gold checkpoint goes (None: not saved; ``"auto"``: the run's
            ``checkpoints/best_gold.ckpt``).
        alpha: the warning's level: the gold must fall beyond the ``1 - alpha`` interval of the
            held-out noise (each record's ``heldout_n``; a record without it is taken as exact).
    """

    def __init__(self, evaluation: Any, *, gold: str = "exact_match", proxy: str = "reward_mean",
                 kl: str = "kl_to_reference", checkpoint: Union[None, str, Path] = None, alpha: float = 0.05) -> None:
        self.evaluation = evaluation
        self.gold, self.proxy, self.kl = gold, proxy, kl
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.alpha = float(alpha)
        self.best: Optional[dict] = None
        self.warnings: list[str] = []
        self._seen = 0

    @property
    def state_key(self) -> str:
        return "RewardHackingMonitor"

    def _baseline(self) -> tuple[Optional[float], Optional[float]]:
        before = getattr(self.evaluation, "before", None) or {}
        first = self.evaluation.history[0] if self.evaluation.history else {}
        gold0 = before.get(self.gold, first.get(self.gold))
        proxy0 = before.get(self.proxy, first.get(self.proxy))
        return gold0, proxy0

    def _point(self, record: dict) -> Optional[dict]:
        gold0, proxy0 = self._baseline()
        g, p, kl = record.get(self.gold), record.get(self.proxy), record.get(self.kl)
        if g is None or kl is None or gold0 is None:
            return None
        point = {"step": record["step"], "kl": float(kl), "sqrt_kl": math.sqrt(max(float(kl), 0.0)),
                 "gold": float(g), "gold_gain": float(g) - float(gold0)}
        if p is not None and proxy0 is not None:
            point["proxy_gain"] = float(p) - float(proxy0)
            point["gap"] = point["proxy_gain"] - point["gold_gain"]
        return point

    def _check(self, trainer) -> None:
        history = self.evaluation.history
        if len(history) <= self._seen or trainer.global_rank != 0:
            return
        for record in history[self._seen:]:
            point = self._point(record)
            if point is None:
                continue
            metrics = {f"monitor/{k}": v for k, v in point.items() if k not in ("step", "gold") and v is not None}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=max(point["step"] - 1, 0))
            if self.best is None or point["gold"] > self.best["gold"]:
                self.best = point
                if self.checkpoint is not None and trainer.world_size == 1:
                    trainer.save_checkpoint(self.checkpoint, weights_only=False)
        self._seen = len(history)
        gold0, _ = self._baseline()
        for signal in (hacking_signal(history, gold=self.gold, proxy=self.proxy, alpha=self.alpha),
                       None if any(w.startswith("at step") for w in self.warnings) else  # said once a run
                       ceiling_signal(history, gold=self.gold, proxy=self.proxy, baseline=gold0)):
            # a fall from the same peak is said once (its later evaluations would repeat it)
            if signal is not None and not any(w.split(" to ")[0] == signal.split(" to ")[0] for w in self.warnings):
                self.warnings.append(signal)
                warnings.warn(RewardHackingWarning(f"possible reward hacking: {signal}"), stacklevel=2)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.checkpoint == "auto":
            self.checkpoint = str(Path(trainer.default_root_dir) / "checkpoints" / "best_gold.ckpt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._check(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def report(self) -> dict[str, Any]:
        """What ``summary.json`` adds: the best-gold point, the warnings, and the fitted Gao forms."""
        points = [p for p in (self._point(r) for r in self.evaluation.history) if p is not None]
        d = [p["sqrt_kl"] for p in points]
        gains = [p["gold_gain"] for p in points]
        return {
            "best_gold": self.best,
            "best_gold_checkpoint": self.checkpoint if self.best is not None and self.checkpoint else None,
            "hacking_warnings": list(self.warnings),
            "gao_fit_rl": fit_gao(d, gains, form="rl") if len(points) >= 3 else None,
            "gao_fit_bon": fit_gao(d, gains, form="bon") if len(points) >= 3 else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "warnings": list(self.warnings), "seen": self._seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
        self.warnings = list(state_dict.get("warnings", []))
        self._seen = int(state_dict.get("seen", 0))
