"""Roll a deterministic policy out in a Gymnasium environment and score it.

The episodes run side by side: every live environment is stepped once per policy
call, so ``E`` episodes of length ``T`` cost ``T`` batched forward passes instead
of ``E * T`` single ones. Observations go through the same normalisation as the
training data before the policy sees them.

>>> import gymnasium as gym, torch
>>> from tensordict.nn import TensorDictModule
>>> policy = TensorDictModule(lambda obs: torch.zeros(obs.shape[0], 1), ["observation"], ["action"])
>>> result = evaluate_policy(policy, lambda: gym.make("Pendulum-v1", max_episode_steps=20), episodes=2, seed=0)
>>> result.returns.shape, result.lengths.tolist()
((2,), [20, 20])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["EvalResult", "evaluate_policy", "actions_for_env"]


@dataclass
class EvalResult:
    """Returns and lengths of evaluation episodes, with their normalised scores.

    Attributes:
        returns: undiscounted return of each episode.
        lengths: number of steps of each episode.
        normalized: ``100 * (return - random) / (expert - random)`` per episode when the
            dataset has reference scores, else None.
    """

    returns: np.ndarray
    lengths: np.ndarray
    normalized: Optional[np.ndarray] = None
    extra: dict = field(default_factory=dict)
    policy_s: float = 0.0
    policy_calls: int = 0

    @property
    def ms_per_action(self) -> float:
        """Policy time per action taken, averaged over every step of every episode (a planner
        that plans every k-th step spreads its plans over k actions)."""
        return 1000.0 * self.policy_s / max(int(np.sum(self.lengths)), 1)

    @property
    def ms_per_call(self) -> float:
        """Policy time per batched call (one call acts in every live episode at once)."""
        return 1000.0 * self.policy_s / max(self.policy_calls, 1)

    @property
    def return_mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def return_std(self) -> float:
        return float(np.std(self.returns))

    @property
    def normalized_score(self) -> Optional[float]:
        return None if self.normalized is None else float(np.mean(self.normalized))

    @property
    def normalized_score_std(self) -> Optional[float]:
        return None if self.normalized is None else float(np.std(self.normalized))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary: means, standard deviations and the per-episode returns."""
        return {
            "episodes": int(len(self.returns)),
            "return_mean": self.return_mean,
            "return_std": self.return_std,
            "normalized_score": self.normalized_score,
            "normalized_score_std": self.normalized_score_std,
            "length_mean": float(np.mean(self.lengths)),
            "ms_per_action": round(self.ms_per_action, 3),
            "ms_per_call": round(self.ms_per_call, 3),
            "returns": [float(r) for r in self.returns],
            **self.extra,
        }


def actions_for_env(action: torch.Tensor, action_space) -> np.ndarray:
    """Turn a batch of policy actions into what ``env.step`` takes, one row per env.

    Continuous actions are clipped to the space's bounds; discrete actions may be
    indices or one-hot vectors (TorchRL's default for ``QValueActor``).
    """
    a = action.detach().to("cpu")
    if isinstance(action_space, gym.spaces.Discrete):
        if a.ndim >= 2 and a.shape[-1] == int(action_space.n) and a.shape[-1] > 1:
            a = a.argmax(-1)
        return a.reshape(a.shape[0]).long().numpy() + int(action_space.start)
    if isinstance(action_space, gym.spaces.Box):
        arr = a.to(torch.float64).numpy().reshape((a.shape[0],) + tuple(action_space.shape))
        return np.clip(arr, action_space.low, action_space.high).astype(action_space.dtype)
    return a.numpy()


def evaluate_policy(
    policy: Callable,
    make_env: Callable[[], Any],
    *,
    episodes: int = 10,
    seed: int = 0,
    normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    device: torch.device | str = "cpu",
    score: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    max_steps: Optional[int] = None,
) -> EvalResult:
    """Run ``episodes`` episodes of a deterministic policy and return their returns.

    Args:
        policy: a TensorDict module reading ``"observation"`` and writing ``"action"``.
        make_env: builds one Gymnasium environment (called ``episodes`` times).

    A policy with a ``reset()`` method is reset first; every call's TensorDict also
    holds ``env_index`` (which episode each row is; rows drop out as episodes end)
    and, after the first step, ``reward`` (each row's previous reward, ``[n, 1]``).

    An env that reports ``info["success"]`` (OGBench's) has the share of episodes whose last
    step reports it in ``extra["success_rate"]`` (the score its benchmark reports).

    An env whose episode holds several in-context episodes (:mod:`offline_plugins.envs.icl`)
    reports their returns in its last step's ``info["in_context_returns"]``; their mean
    over the evaluation episodes is ``extra["in_context_return_mean"]``.

    Keyword Args:
        episodes: how many episodes; episode ``i`` resets with seed ``seed + i``.
        seed: the first reset seed.
        normalize: the training data's observation normalisation (None: identity).
        device: where the policy runs.
        score: per-episode normalised score from returns (e.g. ``data.normalized_score``).
        max_steps: stop every episode after this many steps (None: the env's own limit).
    """
    if episodes < 1:
        raise ValueError(f"episodes must be at least 1, got {episodes}")
    envs = [make_env() for _ in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    returns = np.zeros(episodes, dtype=np.float64)
    lengths = np.zeros(episodes, dtype=np.int64)
    last_reward = np.zeros(episodes, dtype=np.float32)
    live = list(range(episodes))
    curves: list = []
    success = np.zeros(episodes, dtype=bool)
    reports_success = False
    policy_s, calls = 0.0, 0
    # stateful policies (Decision Transformer's rolling context) start a new episode here
    if hasattr(policy, "reset"):
        policy.reset()
    was_training = getattr(policy, "training", False)
    if hasattr(policy, "eval"):
        policy.eval()
    # the policy is deterministic, but its modules may still draw (dropout, noise
    # layers); forking keeps evaluation from shifting the training random stream
    dev = torch.device(device)
    fork_devices = [dev.index or 0] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
            torch.manual_seed(seed)
            while live:
                batch = torch.as_tensor(np.stack([obs[i] for i in live]), dtype=torch.float32, device=dev)
                if normalize is not None:
                    batch = normalize(batch)
                # env_index and the previous reward let a stateful policy track each episode
                td = TensorDict(
                    {"observation": batch, "env_index": torch.tensor(live, device=dev)},
                    batch_size=[len(live)],
                    device=dev,
                )
                if lengths[live[0]] > 0:
                    td["reward"] = torch.as_tensor(last_reward[live], device=dev).unsqueeze(-1)
                t0 = time.perf_counter()
                action = policy(td)["action"]
                act = actions_for_env(action, envs[live[0]].action_space)  # waits for the device
                policy_s += time.perf_counter() - t0
                calls += 1
                still = []
                for row, i in enumerate(live):
                    obs[i], reward, terminated, truncated, info = envs[i].step(act[row])
                    returns[i] += float(reward)
                    last_reward[i] = float(reward)
                    lengths[i] += 1
                    if not (terminated or truncated or (max_steps is not None and lengths[i] >= max_steps)):
                        still.append(i)
                        continue
                    if "success" in info:
                        reports_success, success[i] = True, bool(info["success"])
                    if "in_context_returns" in info:
                        curves.append(info["in_context_returns"])
                live = still
    finally:
        for env in envs:
            env.close()
        if was_training and hasattr(policy, "train"):
            policy.train()
    normalized = None
    if score is not None:
        normalized = np.asarray(score(returns), dtype=np.float64)
    extra = {"in_context_return_mean": np.mean(curves, 0).tolist()} if curves else {}
    if reports_success:
        extra["success_rate"] = float(success.mean())
    return EvalResult(returns=returns, lengths=lengths, normalized=normalized, extra=extra, policy_s=policy_s,
                      policy_calls=calls)
