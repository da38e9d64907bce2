"""The round of rollouts of an online run, in one place: :class:`RolloutDataModule`.

A ``text-rollouts`` run trains on responses the policy samples while it trains. The
data module owns that stream: each round it samples ``group_size`` responses to each of
``prompts_per_round`` prompts from the policy as it is then (the run's collector,
:meth:`~offline_plugins.text.data.rollouts.RolloutData.collector_for`), has the loss write the
advantages (``RolloutPlan.process``), turns the rollouts into the round's training rows
(``RolloutPlan.training_rows``, or the rollouts themselves), writes them into a TorchRL
replay buffer and hands out ``epochs`` passes of minibatches; its checkpoint state is the
round being trained on.

Why the batches are made right before their step: Lightning fetches one batch ahead, and
with several steps per call a call's batches at once, so a batch made when it is fetched
would come from a policy a step or a call old. The stream therefore yields step numbers
(``StepBatches`` of them with several steps per call), and ``on_before_batch_transfer``,
which Lightning calls right before the step, turns them into minibatches, sampling a new
round first where one starts. A round ends a call (its length is one of the stream's periods).

The plan's ``sync_check`` (:class:`~offline_plugins.text.collectors.sync_check.SyncCheck`; on by default with
``--generator vllm``) scores some of a due round's responses with the trainer after it is sampled
and compares with the sampler's log-probs: it warns, or stops the run, when the sampler does not
hold the trainer's weights.

With ``--generator vllm`` (the algorithm's ``RolloutPlan.generator``, a
:class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`) the
rounds are sampled by an in-process vLLM engine; the data module starts it before the first
round and loads the policy's weights into it before a round once ``sync_every`` optimiser
steps have passed since the last load, and shuts it down when the fit ends.

Minibatch ``m`` of epoch ``e`` of round ``r`` is a slice of a permutation seeded by
``(seed, rank, r, e)``; prompts and sampling are seeded by ``(seed, rank, r)``, and the
round being trained on is saved in checkpoints, so a resumed run trains on exactly the
rollouts of the uninterrupted one. Under DDP each rank samples its own prompts, and the
checkpoint (written by rank 0) gathers every rank's round, so a resume there is exact too.

:class:`~offline_plugins.kinds.rollouts.evaluation.RolloutEvaluation` scores greedy responses to the
held-out prompts and watches for reward hacking
(:class:`~offline_plugins.kinds.rollouts.monitor.RewardHackingMonitor`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule
from tensordict import NonTensorStack, TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from offline_plugins.errors import UserError
from offline_plugins.lightning.data import StepBatches, StepStream
from offline_plugins.lightning.guards import RunFolderLock
from offline_plugins.objectives.llm.estimators import group_statistics
from offline_plugins.text.collectors.async_sampler import AsyncSampler
from offline_plugins.text.sources.prompts import RolloutError, rollout_seed

__all__ = ["RolloutDataModule"]


class RolloutDataModule(LightningDataModule):
    """Rounds of rollouts from the policy being trained, and their minibatches.

    Args:
        data: the run's :class:`~offline_plugins.text.data.rollouts.RolloutData` (not changed).
        parts: the algorithm's parts: ``parts.model`` samples, ``parts.rollout`` (a
            :class:`~offline_plugins.algorithms.base.RolloutPlan`) says how a round is made.

    Keyword Args:
        batch_size: training rows per gradient step; must divide the rows of a round.
        seed: the run's seed.

    Raises:
        UserError: the algorithm has no rollout plan, or ``batch_size`` does not divide a round.
    """

    def __init__(self, data: Any, parts: Any, *, batch_size: int, seed: int = 0) -> None:
        super().__init__()
        plan = getattr(parts, "rollout", None)
        if plan is None:
            raise UserError(f"{type(parts.loss).__name__} has no rollout plan (AlgorithmParts.rollout); the "
                            "text-rollouts kind trains online algorithms only")
        self.data = data
        self.plan = plan
        self.model = parts.model
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.collector = data.collector_for(plan, seed=self.seed)
        # --generator vllm: an engine that samples the rounds from its own copy of the policy's weights,
        # loaded before a round (every sync_every optimiser steps); None: the policy's own generate
        self.generator = plan.generator
        self.collector.generator = self.generator
        # SIGINT/SIGTERM end a wait on a reward function at once (the trainer's flag, set by both)
        self.collector.reward_guard.should_stop = self._stop_requested
        self.rows_per_round = self.collector.rows if plan.rows_per_round is None else int(plan.rows_per_round)
        n, what = self.rows_per_round, (plan.rows_what if plan.training_rows is not None else
                                        f"rollouts (prompts_per_round {self.collector.prompts_per_round} x "
                                        f"group_size {self.collector.group_size})")
        if self.batch_size < 1 or n % self.batch_size:
            raise RolloutError(f"batch_size {self.batch_size} must divide the {n} {what} of a round; fix it with "
                               f"--set batch_size={math.gcd(n, max(self.batch_size, 1))} or change prompts_per_round")
        self.minibatches = n // self.batch_size
        self.updates_per_round = int(plan.epochs) * self.minibatches
        self.buffer = None
        self.stream: Optional[StepStream] = None
        self.round = -1
        self.rank = 0
        self.rollouts: Optional[TensorDict] = None
        self.history: list[dict] = []
        self._pending: Optional[dict] = None
        # async_rollouts: the worker that samples the next round while this one trains, the step at which
        # it is given the weights for it, and a round it sampled before a checkpoint (state, resume)
        self.sampler = None
        self._snapshot_at: Optional[tuple[int, int]] = None  # (step, round)
        self._prefetched: Optional[dict] = None

    def _stop_requested(self) -> bool:
        trainer = self.trainer
        return bool(trainer is not None and trainer.received_sigterm)

    # -- what evaluation reads -------------------------------------------------------------------
    @property
    def source(self):
        """The prompt source the rounds sample from (the plan's, else the data's)."""
        return self.collector.source

    @property
    def reference(self):
        return self.collector.reference

    # -- Lightning's data hooks ------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.buffer is not None:
            return
        trainer = self.trainer
        if self.generator is not None and trainer is not None and trainer.world_size > 1:
            raise UserError(f"--generator vllm samples with one in-process engine, and this run has "
                            f"{trainer.world_size} processes (devices x nodes); train on one device, or sample "
                            "with --generator hf")
        if self.plan.max_staleness is not None and trainer is not None and trainer.world_size > 1:
            raise UserError(f"async_rollouts runs one sampler process beside one trainer, and this run has "
                            f"{trainer.world_size} processes (devices x nodes); train on one device, or drop "
                            "async_rollouts")
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        self.buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(self.rows_per_round, device=device),
                                             batch_size=self.batch_size)
        # the step numbers themselves: on_before_batch_transfer makes each step's minibatch
        self.stream = StepStream(int, start_step=lambda: int(self.trainer.global_step) if self.trainer is not None else 0)

    def train_dataloader(self) -> StepStream:
        assert self.stream is not None, "setup() must run before train_dataloader()"
        # overlapped rounds: a call also ends where the next round's weights are taken
        phases = ((self.updates_per_round, -self._staleness()),) if self.plan.max_staleness is not None else ()
        self.stream.configure(self.trainer, extra_periods=(self.updates_per_round,), extra_phases=phases)
        return self.stream

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        rank = int(self.trainer.global_rank) if self.trainer is not None else 0
        if isinstance(batch, StepBatches):
            steps = batch.batches
            self._ensure_round(steps[0] // self.updates_per_round)  # a call never spans two rounds
            self._maybe_prefetch(int(steps[0]))
            return StepBatches(batch.start, [self._minibatch(int(s), rank) for s in steps])
        self._ensure_round(int(batch) // self.updates_per_round)
        self._maybe_prefetch(int(batch))
        return self._minibatch(int(batch), rank)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # the buffer lives on the trainer's device already
        return batch if getattr(batch, "device", None) == device else batch.to(device, non_blocking=True)

    # -- the round -------------------------------------------------------------------------------
    def _write(self, rollouts: TensorDict) -> None:
        # the losses read tokens: the strings stay in the round's rollouts (checkpoint state,
        # process_rollouts); kept in the buffer, a NonTensorStack per column made every write and
        # minibatch build one Python object per row (the shell's GRPO ran 17-20 % more steps/s
        # without them, docs/benchmarks.md)
        rows = rollouts if self.plan.training_rows is None else self.plan.training_rows(rollouts)
        rows = rows.exclude("text")
        self.buffer.empty()
        self.buffer.extend(rows.to(self.buffer.storage.device))
        self.rollouts = rollouts

    def _ensure_round(self, r: int) -> None:
        trainer = self.trainer
        rank = int(trainer.global_rank) if trainer is not None else 0
        if self._pending is not None:
            state, self._pending = self._pending, None
            if state["rank"] == rank and state["round"] == r:
                self._write(state["td"])
                self.round, self.rank = r, rank
        if r == self.round:
            return
        step = int(trainer.global_step) if trainer is not None else 0
        if self.plan.max_staleness is not None:  # sampled beside the last round's training, processed here
            td, stats, version = self._async_round(r, rank, step)
            stats["sampler_lag_steps"] = float(step - version)
            # the check compares with the weights the sampler was given (still in its shared copy, unless a
            # resume made a new sampler: then it is skipped for this round)
            check_model, check_lag = self.sampler.model, (0 if self.sampler.version == version else 1)
        else:
            if self.generator is not None:  # the engine samples from the policy as of its last weight load
                self.generator.before_round(self.model, step)
            td, stats = self.collector.collect(self.model, round=r, rank=rank, process=self.plan.process,
                                               dynamic_sampling=bool(self.plan.dynamic_sampling))
            check_model, check_lag = self.model, 0
            if self.generator is not None:
                # optimiser steps the sampling weights lag the policy by (0 with sync_every=1)
                check_lag = step - int(self.generator.synced_step)
                stats["sampler_lag_steps"] = float(check_lag)
        self._write(td)
        self.round, self.rank = r, rank
        if self.plan.sync_check is not None:  # the sampler's log-probs against the weights it should hold, when due
            stats.update(self.plan.sync_check.after_round(check_model, td, round=r, step=step, lag=check_lag) or {})
        self.history.append({"step": step, "round": r, **stats})
        if trainer is None:
            return
        metrics = {f"rollout/{k}": v for k, v in stats.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        # the step bar counts updates; its title counts the rounds of rollouts and their reward
        bar = getattr(getattr(trainer, "progress_bar_callback", None), "train_progress_bar", None)
        if bar is not None and hasattr(bar, "set_description") and not getattr(bar, "disable", True):
            bar.set_description(f"train (rollouts {len(self.history)}, reward {stats['reward_mean']:.2f})",
                                refresh=False)

    # -- overlapped rounds (async_rollouts) ---------------------------------------------------------
    def _staleness(self) -> int:
        k = int(self.plan.max_staleness)
        return self.updates_per_round if k < 0 else min(k, self.updates_per_round)

    def _async_round(self, r: int, rank: int, step: int) -> tuple[TensorDict, dict, int]:
        """Round ``r`` from the sampler process: the one it sampled beside the last round's training (or
        kept in a checkpoint), else sampled now from the policy as it is; the loss's ``process_rollouts``
        runs here, on the trainer's weights (its rollout correction weighs the sampler's lag)."""
        if self.sampler is None:
            loss = getattr(self.plan.process, "__self__", None)

            self.sampler = AsyncSampler(self.collector, self.model, signal=_signal_of(loss),
                                        dynamic_sampling=bool(self.plan.dynamic_sampling),
                                        after_fork=RunFolderLock.close_inherited, generator=self.generator)
        got = None
        if self._prefetched is not None:
            kept, self._prefetched = self._prefetched, None
            if kept["round"] == r and kept["rank"] == rank:
                got = (kept["version"], kept["td"], dict(kept["stats"]))
        if got is None and self.sampler.pending is not None:
            done_round, version, td, stats = self.sampler.result()
            if done_round == r:
                got = (version, td, stats)
        if got is None:  # nothing sampled ahead (the first round, a resume): sample it now
            self.sampler.snapshot(self.model, step)
            self.sampler.request(r, rank)
            _, version, td, stats = self.sampler.result()
            got = (version, td, stats)
        version, td, stats = got
        td = self.plan.process(td)
        # the next round's weights: taken at the step that leaves it max_staleness steps old when trained on.
        # Asked for even past the run's last step: a checkpoint then holds the next round as the uninterrupted
        # run samples it, so a run continued from it (--resume with more --steps) is the same run
        start = (r + 1) * self.updates_per_round
        self._snapshot_at = (start - self._staleness(), r + 1)
        return td, stats, version

    def _maybe_prefetch(self, step: int) -> None:
        """At the first batch of step ``step`` at or past the chosen step, give the sampler the policy's
        weights and ask for the next round (a call of several steps: at its first step, never later than
        the weights chosen, so the lag stays within max_staleness)."""
        if self._snapshot_at is None or self.sampler is None or step < self._snapshot_at[0]:
            return
        _, r = self._snapshot_at
        self._snapshot_at = None
        if step >= r * self.updates_per_round:  # the round starts now: it is sampled there
            return
        self.sampler.snapshot(self.model, step)
        self.sampler.request(r, self.rank)

    def teardown(self, stage: str) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        # the engine's memory goes back when the fit ends; a later fit starts it again
        if self.generator is not None:
            self.generator.close()
        self.collector.reward_guard.close()  # a reward worker process, where reward_workers=process

    def _minibatch(self, step: int, rank: int) -> TensorDict:
        r, j = divmod(step, self.updates_per_round)
        epoch, m = divmod(j, self.minibatches)
        g = torch.Generator().manual_seed(rollout_seed(self.seed, rank, r, epoch, 7))
        order = torch.randperm(self.rows_per_round, generator=g)
        return self.buffer[order[m * self.batch_size:(m + 1) * self.batch_size]]

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = self._rank_state()
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            # Lightning writes rank 0's checkpoint; every rank calls this when a checkpoint is
            # saved, so the ranks' rounds are gathered into it (each rank samples its own prompts)
            ranks: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, state)
            state = {**state, "ranks": ranks}
        return state

    def _rank_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"seed": self.seed, "round": self.round, "rank": self.rank,
                                 "history": list(self.history)}
        if self.plan.sync_check is not None:
            state["sync_check"] = self.plan.sync_check.state_dict()
        if self.sampler is not None and self.sampler.pending is not None:
            # the round being sampled beside training: waited for and kept, so a resume trains on it as is
            r, version, td, stats = self.sampler.result()
            self._prefetched = {"round": r, "rank": self.rank, "version": version, "td": td, "stats": stats}
        if self._prefetched is not None:
            kept = self._prefetched
            state["prefetched"] = {"round": kept["round"], "rank": kept["rank"], "version": kept["version"],
                                   "stats": dict(kept["stats"]), "tensors": kept["td"].exclude("text").cpu().to_dict(),
                                   "text": {k: [str(x) for x in kept["td"].get(("text", k)).tolist()]
                                            for k in ("prompt", "response")}}
        if self._snapshot_at is not None:
            state["snapshot_at"] = list(self._snapshot_at)
        if self.rollouts is not None:
            td = self.rollouts
            state["tensors"] = td.exclude("text").cpu().to_dict()
            state["text"] = {k: [str(x) for x in td.get(("text", k)).tolist()] for k in ("prompt", "response")}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise UserError(f"the checkpoint was trained with seed {state_dict['seed']}, this run uses seed "
                            f"{self.seed}; resume with the same --seed")
        trainer = self.trainer
        rank = int(trainer.global_rank) if trainer is not None else 0
        ranks = state_dict.get("ranks") or []
        # this rank's own round where the checkpoint has it (a run saved on as many ranks or more);
        # otherwise rank 0's, which _ensure_round keeps for rank 0 only (the others sample theirs)
        own = next((r for r in ranks if int(r.get("rank", -1)) == rank), state_dict)
        self.history = list(own.get("history", []))
        if self.plan.sync_check is not None and "sync_check" in own:
            self.plan.sync_check.load_state_dict(own["sync_check"])
        if "prefetched" in own:
            kept = own["prefetched"]
            m = len(kept["text"]["prompt"])
            td = TensorDict(kept["tensors"], batch_size=[m])
            for k, values in kept["text"].items():
                td.set(("text", k), NonTensorStack(*values, batch_size=[m]))
            self._prefetched = {**kept, "td": td}
        if own.get("snapshot_at") is not None:
            self._snapshot_at = tuple(own["snapshot_at"])
        if "tensors" not in own:
            return
        n = self.collector.rows
        td = TensorDict(own["tensors"], batch_size=[n])
        for k, values in own.get("text", {}).items():
            td.set(("text", k), NonTensorStack(*values, batch_size=[n]))
        self._pending = {"round": int(own["round"]), "rank": int(own.get("rank", 0)), "td": td}


def _signal_of(loss: Any):
    """``signal(rows) -> rows`` with ``"has_signal"``: whether each row's group has rewards that differ,
    from the loss's ``rollout_rewards`` (a function of the rows, no forward), for dynamic sampling in the
    sampler process."""
    rewards_of = getattr(loss, "rollout_rewards", None)

    def signal(td: TensorDict) -> TensorDict:
        rewards = rewards_of(td) if rewards_of is not None else td.get(("next", "reward")).reshape(-1).float()
        _, std, size = group_statistics(rewards, td.get("group"))
        td.set("has_signal", (std > 1e-6) & (size > 1))
        return td

    return signal
