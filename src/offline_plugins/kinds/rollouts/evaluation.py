"""The evaluation of an online text run: greedy responses to the held-out prompts, scored every few
steps, with the reward-hacking monitor reading each score (:class:`RolloutEvaluation`)."""

from __future__ import annotations

from typing import Any, Optional

from offline_plugins.kinds.rollouts.monitor import RewardHackingMonitor
from offline_plugins.kinds.rollouts.rounds import RolloutDataModule
from offline_plugins.lightning.callbacks import ScheduledEvaluation
from offline_plugins.lightning.fsdp import is_sharded

__all__ = ["RolloutEvaluation"]


class RolloutEvaluation(ScheduledEvaluation):
    """Greedy responses to the held-out prompts every ``every`` steps and at the end.

    Logs ``eval/exact_match`` (against the rows' answers), ``eval/heldout_reward`` (the
    rollouts' reward: with ``--reward DIR`` the reward model, the proxy), ``eval/response_chars``
    and, where ``--reward`` replaced a built-in task's verifier, ``eval/heldout_gold`` (that
    verifier on the same responses: the gold score the policy never sees); the
    record also carries the last round's rollout figures (``reward_mean``,
    ``kl_to_reference``, ``response_length``, ``groups_without_signal``), read from the run's
    :class:`RolloutDataModule` (``rounds``). ``before`` holds the reference's scores, measured
    when training starts. ``monitor`` (a
    :class:`~offline_plugins.kinds.rollouts.monitor.RewardHackingMonitor`) reads the records after
    each evaluation: the proxy is the rollouts' mean reward, the gold score ``gold``.

    Args:
        data: the run's :class:`~offline_plugins.text.data.rollouts.RolloutData`.

    Keyword Args:
        every: evaluate every this many gradient steps (0: only at the end).
        gold: the record's gold score the monitor watches (the data's ``gold_key``):
            ``"heldout_gold"`` where a reward replaced the task's verifier, ``"exact_match"`` where
            the reward is exact match against the rows' answers, else ``"heldout_reward"``; None:
            no monitor (SFT, which samples no rollouts).
    """

    def __init__(self, data: Any, *, every: int = 0, gold: Optional[str] = "exact_match") -> None:
        self.data = data
        self.every = int(every)
        self.history: list[dict] = []
        self.before: Optional[dict] = None
        self.rounds: Optional[RolloutDataModule] = None
        self.monitor = (RewardHackingMonitor(self, gold=gold, proxy="reward_mean", checkpoint="auto")
                        if gold is not None else None)

    @property
    def state_key(self) -> str:
        return "RolloutEvaluation"

    def _plan(self, pl_module):
        return getattr(getattr(pl_module, "parts", None), "rollout", None)

    def on_fit_start(self, trainer, pl_module) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        self.rounds = datamodule if isinstance(datamodule, RolloutDataModule) else None
        if self.monitor is not None:
            self.monitor.on_fit_start(trainer, pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.before is None:
            plan = self._plan(pl_module)
            reference = self.rounds.reference if self.rounds is not None else self.data.reference
            # a LoRA reference under --strategy fsdp is the sharded policy with its adapters off:
            # every rank takes part in its forwards, rank 0 keeps the scores
            if trainer.global_rank == 0 or is_sharded(reference):
                before = self.data.held_out_scores(reference, plan=plan, guard=self._guard())
                self.before = before if trainer.global_rank == 0 else None

    def _guard(self):
        """The run's reward guard (its time limit and its stop signal), where the rounds have one."""
        return self.rounds.collector.reward_guard if self.rounds is not None else None

    def _score(self, trainer, pl_module):
        scores = self.data.held_out_scores(pl_module.parts.model, plan=self._plan(pl_module), guard=self._guard())
        last = self.rounds.history[-1] if self.rounds is not None and self.rounds.history else {}
        fields = {**scores, **{k: last.get(k) for k in ("reward_mean", "kl_to_reference", "response_length",
                                                        "groups_without_signal")}}
        metrics = {f"eval/{k}": v for k, v in scores.items() if v is not None and k != "heldout_n"}
        return fields, metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.monitor is not None:
            self.monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.monitor is not None:
            self.monitor.on_train_end(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        state = {"history": list(self.history), "before": self.before}
        if self.monitor is not None:
            state["monitor"] = self.monitor.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self.before = state_dict.get("before")
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict.get("monitor", {}))
