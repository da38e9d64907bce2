"""The evaluation callback of the step-labels kind (:mod:`offline_plugins.kinds.steps`), apart so that
listing the kinds imports no Lightning."""

from __future__ import annotations

from typing import Any

from offline_plugins.eval.search import evaluate_prm
from offline_plugins.lightning.callbacks import ScheduledEvaluation

__all__ = ["StepEvaluation"]


class StepEvaluation(ScheduledEvaluation):
    """Score the PRM on the held-out rows every ``every`` steps and at the end: ``eval/step_accuracy``
    and ``eval/first_error_accuracy`` (:func:`offline_plugins.eval.search.evaluate_prm`)."""

    def __init__(self, data: Any, *, every: int = 0) -> None:
        self.data, self.every, self.history = data, int(every), []

    @property
    def state_key(self) -> str:
        return "StepEvaluation"

    def _score(self, trainer, pl_module) -> tuple[dict, dict]:
        scores = evaluate_prm(pl_module.policy, self.data.test)
        return scores, {f"eval/{k}": v for k, v in scores.items() if k != "heldout_rows"}
