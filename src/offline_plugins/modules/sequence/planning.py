"""What the planning policies (Trajectory Transformer's beam search, Diffuser's sampler) share:
the ``plan_every`` setting and their wall-clock accounting.

>>> planner = PlannerMixin()
>>> planner._init_planning(plan_every=2, horizon=5)
>>> planner.count_planning(start=clock_now() - 0.5, actions=4)
>>> stats = planner.planning_stats()
>>> stats["planned_actions"], round(stats["plan_ms_per_step"] / stats["plan_ms_per_action"])
(4, 4)
>>> planner._init_planning(plan_every=6, horizon=5)
Traceback (most recent call last):
...
ValueError: plan_every=6 must be between 1 and horizon=5
"""

from __future__ import annotations

import time

__all__ = ["PlannerMixin", "clock_now"]

clock_now = time.perf_counter


class PlannerMixin:
    """A planning policy's ``plan_every`` (plan on every k-th call, 1 to the horizon) and its
    wall-clock planning cost: :attr:`planning_seconds` over :attr:`planning_calls` calls that
    chose :attr:`planned_actions` actions (one per environment a call served)."""

    def _init_planning(self, plan_every: int, horizon: int) -> None:
        """Check and set ``plan_every``; zero the clock. Called from the planner's ``__init__``."""
        if not 1 <= int(plan_every) <= int(horizon):
            raise ValueError(f"plan_every={plan_every} must be between 1 and horizon={horizon}")
        self.plan_every = int(plan_every)
        self.planning_seconds, self.planning_calls, self.planned_actions = 0.0, 0, 0

    def count_planning(self, start: float, actions: int) -> None:
        """Count one call, begun at ``start`` (:func:`clock_now`), that chose ``actions`` actions."""
        self.planning_seconds += clock_now() - start
        self.planning_calls += 1
        self.planned_actions += actions

    def planning_stats(self) -> dict:
        """Wall-clock planning cost: ``plan_ms_per_step`` (one call, all envs) and ``plan_ms_per_action``."""
        calls, actions = max(self.planning_calls, 1), max(self.planned_actions, 1)
        return {
            "plan_ms_per_step": 1000 * self.planning_seconds / calls,
            "plan_ms_per_action": 1000 * self.planning_seconds / actions,
            "planned_actions": self.planned_actions,
        }
