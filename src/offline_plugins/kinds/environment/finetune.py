"""Offline-to-online fine-tuning: after the offline phase the same run keeps training while it acts.

``offline-plugins train iql --dataset pendulum/medium-v0 --steps 20000 --online-steps 20000`` trains
20,000 steps on the dataset, then 20,000 more on batches mixing the dataset with transitions the
policy collects in the dataset's environment (Nakamoto et al. 2023, Cal-QL; Ball et al. 2023,
RLPD, arXiv:2302.02948). :class:`FineTuneDataModule` owns both phases:

- the offline phase draws exactly the batches of a plain offline run
  (:class:`~offline_plugins.lightning.data.ReplayBufferStream`'s seeds), so the two runs are the
  same up to the switch;
- the online phase runs in rounds. A round starts by collecting ``online_frames_per_round``
  environment steps with a TorchRL ``Collector`` (the dataset's Gymnasium environment through
  ``GymWrapper``, observations normalised and rewards scaled as the data layer did, the actor
  sampled from its distribution or, for a deterministic actor, TorchRL's ``AdditiveGaussianModule``)
  into an online ``TensorDictReplayBuffer``, and then trains ``online_updates_per_round`` steps on
  batches of which ``online_ratio`` come from that buffer and the rest from the dataset.

A round's environment resets and its action noise are seeded by ``(seed, rank, round)``, the episode
in progress is cut (truncated) at the round's end, and the online buffer is saved in checkpoints, so a
run resumed in either phase trains on exactly the transitions and batches of the uninterrupted run.
Columns a loss reads that the data layer does not store (``mc_return``, the Monte-Carlo return
discounted at the loss's gamma that Cal-QL's bound and every loss's Monte-Carlo diagnostics read;
ReBRAC's next action) are computed for each round by the loss's
:class:`~offline_plugins.objectives.columns.DatasetColumns` and filled into the dataset's part of
each batch before the two parts are joined.

One process only: under DDP each rank would collect its own transitions, and a checkpoint holds
rank 0's (refused with a clear error).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule
from tensordict import TensorDict
from tensordict.nn import ProbabilisticTensorDictSequential, TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer
from torchrl.envs import Compose, DoubleToFloat, GymWrapper, ObservationNorm, RewardScaling, TransformedEnv
from torchrl.envs.utils import ExplorationType
from torchrl.modules import AdditiveGaussianModule

from offline_plugins.errors import UserError
from offline_plugins.lightning.data import SAMPLE_STREAM, ReplayBufferStream, StepBatches, StepStream, step_seed
from offline_plugins.objectives.columns import discounted_returns
from offline_plugins.plugins import shared_registry

__all__ = ["FineTuneDataModule", "check_online", "exploration_policy", "online_algorithms"]

#: the seed streams of the online phase (beside data.SAMPLE_STREAM and LOSS_STREAM)
ONLINE_SAMPLE_STREAM = 3
ROUND_STREAM = 4

def online_algorithms(registry: Any = None) -> list[str]:
    """The installed algorithms with an online phase: those whose config declares one (it mixes in
    :class:`~offline_plugins.config.FineTuneConfig`, whose ``online_ratio`` and other ``online_*`` fields
    the phase reads) and that act with continuous actions (the phase's), by name."""
    registry = registry or shared_registry()
    return sorted(name for name, spec in registry.algorithms.items()
                  if dataclasses.is_dataclass(spec.config) and "continuous" in (spec.action_spaces or ("continuous",))
                  and "online_ratio" in {f.name for f in dataclasses.fields(spec.config)})

#: what a round keeps of the collector's output: the offline data's layout
_STEP_KEYS = ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
              ("next", "terminated"), ("next", "truncated"))


class OnlineError(UserError, ValueError):
    """An online phase that cannot run as asked."""


def check_online(spec: Any, config: Any, data: Any, *, online_steps: int) -> None:
    """Refuse ``--online-steps`` where it cannot run: an algorithm without an online phase, data without
    an environment or with discrete actions. Nothing is built before. (Several processes are refused
    when the data module is set up, where the trainer's world size is known.)"""
    if not online_steps:
        return
    name = getattr(spec, "name", spec)
    if not hasattr(config, "online_ratio"):
        raise OnlineError(f"--online-steps: {name!r} has no online phase; fine-tune online with one of "
                          f"{', '.join(online_algorithms())} (their configs have online_ratio and the other "
                          "online_* fields), or drop --online-steps")
    if not hasattr(data, "make_env") or getattr(data, "action_space", None) is None:
        raise OnlineError(f"--online-steps: {name!r} acts in the dataset's environment, and this dataset "
                          f"({type(data).__name__}) has none; use a Minari dataset with an environment")
    if data.action_space != "continuous":
        raise OnlineError(f"--online-steps: the online phase acts with continuous actions, and dataset "
                          f"{data.dataset_id!r} has {data.action_space} ones; drop --online-steps")


def exploration_policy(parts: Any, data: Any, noise: float):
    """The actor the online phase acts with: a stochastic actor as it is (the collector samples it),
    a deterministic one followed by TorchRL's ``AdditiveGaussianModule`` with std ``noise`` times half
    the action range, projected into the action bounds."""
    actor = getattr(parts.policy, "module", parts.policy)
    if isinstance(actor, ProbabilisticTensorDictSequential):
        return actor
    spec = data.action_spec
    half = ((spec.space.high - spec.space.low) / 2).to(torch.float32)
    gauss = AdditiveGaussianModule(spec=spec, sigma_init=1.0, sigma_end=1.0, annealing_num_steps=1, std=1.0,
                                   device=half.device)
    gauss.std = half * float(noise)  # a std per action dimension, in the action's units
    return TensorDictSequential(actor, gauss)


class _RoundStream(StepStream):
    """Step numbers, whose calls of several steps also end where the offline phase ends and where each
    online round ends (a round collects with the policy as it is when it starts)."""

    def __init__(self, module: "FineTuneDataModule", **kwargs: Any) -> None:
        super().__init__(int, **kwargs)
        self.boundaries = module

    def _call_end(self, step: int) -> int:
        return min(super()._call_end(step), self.boundaries.next_boundary(step))


class FineTuneDataModule(LightningDataModule):
    """The dataset's batches for ``offline_steps`` steps, then rounds of collection and mixed batches.

    Args:
        data: the run's :class:`~offline_plugins.data.offline.OfflineData` (not changed).
        parts: the algorithm's parts (its policy acts; its loss's ``columns``, if any, are computed
            for the online transitions).

    Keyword Args:
        batch_size: transitions per gradient step, in both phases.
        seed: the run's seed.
        offline_steps: gradient steps before the online phase.
        config: the algorithm's config (its ``online_*`` fields and ``exploration_noise``).
        online_steps: gradient steps of the online phase (sizes the online buffer: every
            transition collected is kept).
    """

    def __init__(self, data: Any, parts: Any, *, batch_size: int, seed: int, offline_steps: int, online_steps: int,
                 config: Any) -> None:
        super().__init__()
        self.data = data
        self.parts = parts
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.offline_steps = int(offline_steps)
        self.online_steps = int(online_steps)
        self.ratio = float(config.online_ratio)
        self.frames = int(config.online_frames_per_round)
        self.updates = int(config.online_updates_per_round)
        self.noise = float(config.exploration_noise)
        self.online_rows = round(self.batch_size * self.ratio)
        self.rounds = -(-self.online_steps // self.updates)
        self.columns = getattr(parts.loss, "columns", None)
        self.offline: Optional[ReplayBufferStream] = None
        self.buffer = None
        self.generator: Optional[torch.Generator] = None
        self.stream: Optional[_RoundStream] = None
        self.collector = None
        self._iterator = None
        self.collected = 0  # rounds in the online buffer
        self.episodes = 0  # online episodes started so far (their ids follow the dataset's)
        self.history: list[dict] = []
        self._pending: Optional[dict] = None
        self._episode_base = int(data.td.get("episode").max()) + 1 if len(data) else 0

    # -- phases ----------------------------------------------------------------------------------
    def round_of(self, step: int) -> Optional[int]:
        """The online round step ``step`` trains in (None: the offline phase)."""
        return None if step < self.offline_steps else (step - self.offline_steps) // self.updates

    def next_boundary(self, step: int) -> int:
        """The first step after ``step`` that starts a phase or a round."""
        r = self.round_of(step)
        return self.offline_steps if r is None else self.offline_steps + (r + 1) * self.updates

    # -- Lightning's data hooks ------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        trainer = self.trainer
        world = int(trainer.world_size) if trainer is not None else 1
        if world > 1:
            raise OnlineError(f"--online-steps collects with one environment in one process, and this run has "
                              f"{world} processes (devices x nodes); fine-tune on one device")
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        rank = int(trainer.global_rank) if trainer is not None else 0
        buffer = self.data.replay_buffer(self.batch_size, sampler="random", seed=self.seed, device=device)
        self.offline = ReplayBufferStream(buffer, seed=self.seed, rank=rank)
        # the dataset's part of an online-phase batch: the same storage, its own size and generator
        self.mixed = self.data.replay_buffer(max(self.batch_size - self.online_rows, 1), sampler="random",
                                             seed=self.seed, device=device)
        self.mixed_rng = torch.Generator(device=device)
        self.mixed.set_rng(self.mixed_rng)
        capacity = max(1, self.rounds * self.frames)
        self.generator = torch.Generator(device=device)
        self.buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity, device=device),
                                             sampler=RandomSampler(), batch_size=max(self.online_rows, 1))
        self.buffer.set_rng(self.generator)
        self.stream = _RoundStream(self, start_step=self._current_step)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def _current_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else 0

    def train_dataloader(self) -> _RoundStream:
        assert self.stream is not None, "setup() must run before train_dataloader()"
        self.stream.configure(self.trainer)
        return self.stream

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, StepBatches):
            return StepBatches(batch.start, [self.batch_of(int(s)) for s in batch.batches])
        return self.batch_of(int(batch))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch if getattr(batch, "device", None) == device else batch.to(device, non_blocking=True)

    # -- batches ---------------------------------------------------------------------------------
    def batch_of(self, step: int) -> TensorDict:
        """Step ``step``'s batch: the dataset's alone in the offline phase; in the online phase,
        ``online_ratio`` of it from the online buffer (its round collected first, if it is not yet)."""
        r = self.round_of(step)
        if r is None:
            return self.offline._sample(step)
        while self.collected <= r:
            self._collect(self.collected)
        rank = self.offline.rank
        online = None
        if self.online_rows:
            self.generator.manual_seed(step_seed(self.seed, rank, step, ONLINE_SAMPLE_STREAM))
            online = self.buffer.sample()
            if self.online_rows == self.batch_size:
                return online.exclude("index")
        self.mixed_rng.manual_seed(step_seed(self.seed, rank, step, SAMPLE_STREAM))
        part = self.mixed.sample()
        if self.columns is not None:
            part = self.columns.fill(part)
        if online is None:
            return part
        keys = [k for k in online.keys(True, True) if k != "index"]
        return torch.cat([part.select(*keys), online.select(*keys)], 0)

    # -- rounds ----------------------------------------------------------------------------------
    def _make_collector(self) -> None:
        stats = self.data.stats
        env = TransformedEnv(
            GymWrapper(self.data.make_env(), device="cpu"),
            Compose(DoubleToFloat(),
                    ObservationNorm(loc=stats.obs_loc.detach().cpu(), scale=stats.obs_scale.detach().cpu(),
                                    standard_normal=True, in_keys=["observation"]),
                    RewardScaling(loc=float(stats.reward_shift), scale=float(stats.reward_scale))),
        )
        device = self.buffer.storage.device
        policy = exploration_policy(self.parts, self.data, self.noise)
        # building the collector runs the policy once; the run's own random stream is left as it was
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            self.collector = Collector(env, policy, frames_per_batch=self.frames, total_frames=-1,
                                       reset_at_each_iter=True, exploration_type=ExplorationType.RANDOM,
                                       auto_register_policy_transforms=False,
                                       policy_device=device, storing_device=device, env_device="cpu")
        self._iterator = iter(self.collector)

    def _collect(self, r: int) -> None:
        """Collect round ``r`` into the online buffer and log its episodes."""
        if self.collector is None:
            self._make_collector()
        device = self.buffer.storage.device
        seed = step_seed(self.seed, self.offline.rank, r, ROUND_STREAM)
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            self.collector.set_seed(seed % (2 ** 31))
            out = next(self._iterator)
        rows, stats = self._rows(out, r)
        self.buffer.extend(rows)
        self.collected = r + 1
        step = self._current_step()
        record = {"step": step, "round": r, **stats}
        self.history.append(record)
        trainer = self.trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics({f"online/{k}": v for k, v in stats.items()}, step=step)

    def _rows(self, out: TensorDict, r: int) -> tuple[TensorDict, dict]:
        """The collector's steps in the dataset's layout (the round's end cuts its last episode), with the
        loss's extra columns, and the round's figures."""
        rows = out.select(*_STEP_KEYS).to(self.buffer.storage.device)
        last = torch.zeros_like(rows.get(("next", "truncated")))
        last[-1] = True
        rows.set(("next", "truncated"), rows.get(("next", "truncated")) | last)
        rows.set(("next", "done"), rows.get(("next", "done")) | last)
        traj = out.get(("collector", "traj_ids")).to(rows.device)
        _, local = torch.unique_consecutive(traj, return_inverse=True)
        rows.set("episode", local + self._episode_base + self.episodes)
        finished = int(local.max()) + 1
        self.episodes += finished
        # the data layer's undiscounted return_to_go, so the online rows have the dataset's keys; the
        # loss's columns (mc_return at its gamma, ...) follow from their makers
        rows.set("return_to_go", discounted_returns(rows, 1.0))
        if self.columns is not None:
            for key, value in self.columns.compute(rows).items():
                rows.set(key, value)
        # the raw (unscaled) return of each episode the environment ended inside the round
        stats = self.data.stats
        raw = (rows.get(("next", "reward")).reshape(-1) - stats.reward_shift) / stats.reward_scale
        ended = out.get(("next", "done")).reshape(-1).to(rows.device)
        returns = torch.zeros(finished, dtype=raw.dtype, device=raw.device).index_add_(0, local, raw)
        complete = torch.zeros(finished, dtype=torch.bool, device=raw.device).index_fill_(0, local[ended], True)
        figures = {"frames": float((r + 1) * self.frames), "episodes": float(self.episodes)}
        if bool(complete.any()):
            done_returns = returns[complete].double().cpu().numpy()
            figures["return_mean"] = float(done_returns.mean())
            if stats.ref_min_score is not None and stats.ref_max_score is not None:
                figures["normalized_score"] = float(self.data.normalized_score(done_returns).mean())
        return rows, figures

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"seed": self.seed, "collected": self.collected, "episodes": self.episodes,
                                 "history": list(self.history)}
        if self.buffer is not None and len(self.buffer):
            state["online"] = self.buffer.storage.get(range(len(self.buffer))).cpu().to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise UserError(f"the checkpoint was trained with seed {state_dict['seed']}, this run uses seed "
                            f"{self.seed}; resume with the same --seed")
        if self.buffer is None:  # restored once setup() made the buffer
            self._pending = state_dict
        else:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self.collected = int(state.get("collected", 0))
        self.episodes = int(state.get("episodes", 0))
        self.buffer.empty()
        if "online" in state:
            rows = TensorDict(state["online"], batch_size=[])
            rows.batch_size = rows.get("observation").shape[:1]
            self.buffer.extend(rows.to(self.buffer.storage.device))

