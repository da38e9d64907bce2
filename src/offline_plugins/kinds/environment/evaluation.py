"""The evaluation of a policy trained on an environment's data: the deterministic policy rolled out in the
dataset's Gymnasium environment every few steps and at the end (:class:`PolicyEvaluation`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from offline_plugins.eval.rollout import evaluate_policy
from offline_plugins.lightning.callbacks import ScheduledEvaluation

__all__ = ["PolicyEvaluation"]


class PolicyEvaluation(ScheduledEvaluation):
    """Evaluate the deterministic policy in the dataset's environment.

    Runs every ``every`` gradient steps (0: only at the end) and when training ends,
    on global rank 0; logs ``eval/return_mean``, ``eval/return_std`` and
    ``eval/normalized_score`` against the step. The evaluation history is saved in
    checkpoints, so a resumed run's learning curve continues.

    Args:
        make_env: builds one Gymnasium environment.

    Keyword Args:
        every: evaluate every this many gradient steps (0: only at the end).
        episodes: episodes per evaluation.
        seed: first environment reset seed.
        normalize: the training data's observation normalisation.
        score: per-episode normalised score from returns (None: not reported).
    """

    def __init__(
        self,
        make_env: Callable[[], Any],
        *,
        every: int = 0,
        episodes: int = 10,
        seed: int = 0,
        normalize: Optional[Callable] = None,
        score: Optional[Callable] = None,
    ) -> None:
        self.make_env = make_env
        self.every = int(every)
        self.episodes = int(episodes)
        self.seed = int(seed)
        self.normalize = normalize
        self.score = score
        self.history: list[dict] = []
        self.last = None

    @property
    def state_key(self) -> str:
        return "PolicyEvaluation"

    def _score(self, trainer, pl_module) -> tuple[dict, dict]:
        result = evaluate_policy(
            pl_module.policy,
            self.make_env,
            episodes=self.episodes,
            seed=self.seed,
            normalize=self.normalize,
            device=pl_module.device,
            score=self.score,
        )
        self.last = result
        metrics = {"eval/return_mean": result.return_mean, "eval/return_std": result.return_std}
        if result.normalized_score is not None:
            metrics["eval/normalized_score"] = result.normalized_score
        # what the env adds of its own (a benchmark's success rate), logged beside the return
        metrics.update({f"eval/{k}": v for k, v in result.extra.items() if isinstance(v, (int, float))})
        return {k: v for k, v in result.to_dict().items() if k != "returns"}, metrics
