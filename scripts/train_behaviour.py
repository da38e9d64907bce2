"""Train the behaviour policies of the dataset recipes (TorchRL SAC or DQN).

A maintainer's tool, not part of the installed package: run it from a checkout as
``python scripts/train_behaviour.py ENV_ID [--steps N] [--seed S]``.
It writes ``policies/<env>.pt`` (the ``medium`` and ``expert`` actors, and the
snapshots from which ``medium-replay`` is regenerated) and ``policies/<env>.json``
(script, seed, steps, returns reached, evaluation curve).

D4RL's tiers come from one training run: ``expert`` is the best snapshot, ``medium``
the snapshot whose return is closest to a third of the way from random to expert
(a normalised score of about 33), ``medium-replay`` the data collected up to the
medium snapshot. Snapshots are taken every ``--eval-every`` steps and scored with the
same stochastic policy that later collects the data.

The losses, target updates and replay buffer are TorchRL's (``SACLoss`` /
``DQNLoss``, ``SoftUpdate``, ``TensorDictReplayBuffer``); the environment is stepped
directly with Gymnasium so one environment step costs one small forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["TrainSettings", "DEFAULTS", "train", "main"]


@dataclass
class TrainSettings:
    """Hyperparameters of one behaviour-policy run (defaults per env in ``DEFAULTS``)."""

    kind: str = "sac"
    steps: int = 20_000
    warmup: int = 1_000
    eval_every: int = 500
    eval_episodes: int = 5
    hidden: tuple = (64, 64)
    critic_hidden: tuple = (256, 256)
    batch_size: int = 256
    lr: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    noise: float = 1.0  # sac: scale multiplier when collecting; dqn: final epsilon
    eps_decay_steps: int = 10_000  # dqn only
    max_replay_segments: int = 12
    random_episodes: int = 100  # episodes behind the random reference return
    reference_episodes: int = 20  # episodes behind the medium and expert returns


DEFAULTS: dict[str, TrainSettings] = {
    "Pendulum-v1": TrainSettings(steps=8_000, warmup=1_000, eval_every=500),
    "CartPole-v1": TrainSettings(
        kind="dqn", steps=40_000, warmup=1_000, eval_every=1_000, hidden=(64, 64),
        batch_size=128, lr=1e-3, tau=0.01, noise=0.05, eps_decay_steps=10_000,
    ),
    # 2 shared CPU cores: smaller critic and batch than the SAC paper's, to get further in an hour
    "Hopper-v5": TrainSettings(
        steps=100_000, warmup=5_000, eval_every=5_000, hidden=(128, 128), critic_hidden=(128, 128), batch_size=128
    ),
    "HalfCheetah-v5": TrainSettings(steps=200_000, warmup=5_000, eval_every=5_000, hidden=(128, 128)),
    "Walker2d-v5": TrainSettings(steps=200_000, warmup=5_000, eval_every=5_000, hidden=(128, 128)),
}


def _evaluate(env_id: str, policy, episodes: int, seed: int) -> float:
    import gymnasium as gym
    import torch

    env = gym.make(env_id)
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done = False
        while not done:
            a = policy.act(torch.as_tensor(obs), g)
            obs, r, term, trunc, _ = env.step(a.numpy())
            total += float(r)
            done = term or trunc
    env.close()
    return total / episodes


def _build_losses(s: TrainSettings, obs_dim: int, act_dim: int, low, high, net):
    import torch
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.data import Bounded, OneHot
    from torchrl.modules import MLP, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
    from torchrl.objectives import DQNLoss, SACLoss, SoftUpdate

    if s.kind == "sac":
        spec = Bounded(torch.as_tensor(low), torch.as_tensor(high), shape=(act_dim,))
        actor = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            spec=spec,
            distribution_class=TanhNormal,
            distribution_kwargs={"low": spec.space.low, "high": spec.space.high},
        )
        qnet = MLP(in_features=obs_dim + act_dim, out_features=1, num_cells=list(s.critic_hidden), activation_class=nn.ReLU)
        critic = ValueOperator(qnet, in_keys=["observation", "action"])
        loss = SACLoss(actor, critic, num_qvalue_nets=2, action_spec=spec, loss_function="l2")
    else:
        actor = QValueActor(net, in_keys=["observation"], spec=OneHot(act_dim))
        loss = DQNLoss(actor, action_space="one-hot", delay_value=True, double_dqn=True, loss_function="l2")
    loss.make_value_estimator(gamma=s.gamma)
    return loss, SoftUpdate(loss, tau=s.tau)


def train(env_id: str, settings: TrainSettings, *, seed: int = 0, out_dir: Optional[Path] = None, log=print) -> dict:
    """Train, pick the medium and expert snapshots, and write ``<env>.pt`` and ``<env>.json``."""
    import gymnasium as gym
    import numpy as np
    import torch
    import torchrl
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from offline_plugins.data.behaviour import POLICY_DIR, BehaviourPolicy, RandomPolicy, make_actor_net, policy_stem

    s = settings
    torch.manual_seed(seed)
    np.random.seed(seed)
    env = gym.make(env_id)
    obs_dim = int(np.prod(env.observation_space.shape))
    if s.kind == "sac":
        act_dim = int(np.prod(env.action_space.shape))
        low, high = env.action_space.low.tolist(), env.action_space.high.tolist()
    else:
        act_dim, low, high = int(env.action_space.n), None, None
    net = make_actor_net(s.kind, obs_dim, act_dim, s.hidden)
    loss, updater = _build_losses(s, obs_dim, act_dim, low, high, net)
    optim = torch.optim.Adam(loss.parameters(), lr=s.lr)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(s.steps), batch_size=s.batch_size)
    rng = torch.Generator().manual_seed(seed)
    out_dir = Path(out_dir) if out_dir is not None else POLICY_DIR
    behaviour = BehaviourPolicy(s.kind, net, low=low, high=high, noise=1.0)
    random_policy = RandomPolicy(s.kind, low=low, high=high, n_actions=act_dim)

    def epsilon(step: int) -> float:
        if s.kind == "sac":
            return s.noise
        frac = min(1.0, step / max(1, s.eps_decay_steps))
        return 1.0 + frac * (s.noise - 1.0)

    def snapshot(half: bool = False) -> dict:
        return {k: (v.detach().clone().half() if half else v.detach().clone()) for k, v in net.state_dict().items()}

    eval_cache: dict = {}

    def score(key, state_dict, policy_factory) -> float:
        # reference returns use more episodes than the snapshot scores; cached by snapshot
        if key not in eval_cache:
            net_copy = make_actor_net(s.kind, obs_dim, act_dim, s.hidden)
            if state_dict is not None:
                net_copy.load_state_dict(state_dict)
            eval_cache[key] = _evaluate(env_id, policy_factory(net_copy), *key[1:])
        return eval_cache[key]

    def finalize(quiet: bool = False) -> dict:
        # reference returns: the random policy, and the expert as it collects data
        rets = [snap["return"] for snap in snapshots]
        final_noise = s.noise
        ref_episodes = s.reference_episodes
        acting = lambda n: BehaviourPolicy(s.kind, n, low=low, high=high, noise=final_noise)  # noqa: E731
        # a few evaluation episodes are noisy: re-score the top three snapshots with more
        top = sorted(range(len(rets)), key=lambda i: rets[i], reverse=True)[:3]
        rescored = {i: score((i, ref_episodes, 20_000), snapshots[i]["state_dict"], acting) for i in top}
        best = max(rescored, key=rescored.get)
        expert_sd = snapshots[best]["state_dict"]
        expert_return = rescored[best]
        random_return = score(("random", s.random_episodes, 30_000), None, lambda n: random_policy)
        target = random_return + (expert_return - random_return) / 3
        candidates = range(1 if best > 0 else 0, best + 1)
        medium_idx = min(candidates, key=lambda i: abs(rets[i] - target))
        medium_return = score((medium_idx, ref_episodes, 20_000), snapshots[medium_idx]["state_dict"], acting)
        medium_step = snapshots[medium_idx]["step"]

        # medium-replay: what the buffer held when training reached the medium snapshot
        segments: list[dict] = []
        if medium_step > 0:
            segments.append({"steps": min(s.warmup, medium_step), "noise": 1.0, "policy": None})
        for snap, nxt in zip(snapshots[:medium_idx], snapshots[1 : medium_idx + 1]):
            start, stop = max(snap["step"], s.warmup), nxt["step"]
            if stop > start:
                segments.append({"steps": stop - start, "noise": snap["noise"], "policy": snap["state_dict"]})
        while len(segments) > s.max_replay_segments:  # keep files small: merge neighbouring snapshots
            merged = [segments[0]]
            for i in range(1, len(segments), 2):
                seg = dict(segments[i])
                if i + 1 < len(segments):
                    seg["steps"] += segments[i + 1]["steps"]
                merged.append(seg)
            segments = merged
        for seg in segments:
            if seg["policy"] is not None:
                seg["policy"] = {k: v.half() for k, v in seg["policy"].items()}

        out_dir.mkdir(parents=True, exist_ok=True)
        stem = policy_stem(env_id)
        payload = {
            "format": 1,
            "env_id": env_id,
            "kind": s.kind,
            "obs_dim": obs_dim,
            "act_dim": act_dim,
            "hidden": list(s.hidden),
            "action_low": low,
            "action_high": high,
            "noise": final_noise,
            "policies": {"medium": snapshots[medium_idx]["state_dict"], "expert": expert_sd},
            "replay": segments,
        }
        # write then rename, so a reader never sees half a file while training goes on
        torch.save(payload, out_dir / f".{stem}.pt.tmp")
        os.replace(out_dir / f".{stem}.pt.tmp", out_dir / f"{stem}.pt")
        card = {
            "env_id": env_id,
            "algorithm": "TorchRL SACLoss" if s.kind == "sac" else "TorchRL DQNLoss (double DQN)",
            # the command that reproduces these files: a run stopped early equals a shorter run
            "script": "python scripts/train_behaviour.py " + shlex.join(
                [env_id, "--steps", str(snapshots[-1]["step"]), "--seed", str(seed), "--eval-every", str(s.eval_every)]
            ),
            "seed": seed,
            "steps": s.steps,
            "steps_trained": snapshots[-1]["step"],
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(s).items()},
            "expert": {"step": snapshots[best]["step"], "return": expert_return},
            "medium": {"step": medium_step, "return": medium_return},
            "medium_replay_steps": sum(seg["steps"] for seg in segments),
            "random_return": random_return,
            "expert_return": expert_return,
            "reference_episodes": {"random": s.random_episodes, "expert": ref_episodes},
            "eval_curve": [[snap["step"], round(snap["return"], 2)] for snap in snapshots],
            "train_seconds": round(time.time() - t0, 1),
            "versions": {"torch": torch.__version__, "torchrl": torchrl.__version__, "gymnasium": gym.__version__},
        }
        (out_dir / f".{stem}.json.tmp").write_text(json.dumps(card, indent=2) + "\n")
        os.replace(out_dir / f".{stem}.json.tmp", out_dir / f"{stem}.json")
        if not quiet:
            log(
                f"expert (step {card['expert']['step']}): {expert_return:.1f}; medium (step {medium_step}): "
                f"{medium_return:.1f}; random: {random_return:.1f}; wrote {out_dir / stem}.pt/.json"
            )
        return card

    snapshots: list[dict] = []  # {"step", "return", "noise", "state_dict"}
    obs, _ = env.reset(seed=seed)
    episode = 0
    t0 = time.time()
    loss_vals = None
    for step in range(s.steps + 1):
        if step % s.eval_every == 0:
            eval_policy = BehaviourPolicy(s.kind, net, low=low, high=high, noise=s.noise)
            ret = _evaluate(env_id, eval_policy, s.eval_episodes, seed=10_000 + seed * 1000)
            net.train()
            snapshots.append({"step": step, "return": ret, "noise": epsilon(step), "state_dict": snapshot()})
            extra = "" if loss_vals is None else "  " + "  ".join(f"{k}={v:.3g}" for k, v in loss_vals.items())
            log(f"step {step:>7}  return {ret:9.1f}  {step / max(time.time() - t0, 1e-9):6.0f} steps/s{extra}")
            if step >= s.warmup + s.eval_every:  # files on disk stay usable if the run is stopped early
                finalize(quiet=True)
        if step == s.steps:
            break
        obs_t = torch.as_tensor(obs, dtype=torch.float32)
        if step < s.warmup:
            action = random_policy.act(obs_t, rng)
        else:
            behaviour.noise = epsilon(step)
            action = behaviour.act(obs_t, rng)
            net.train()
        next_obs, reward, term, trunc, _ = env.step(action.numpy())
        stored_action = action.float() if s.kind == "sac" else torch.nn.functional.one_hot(action, act_dim).to(torch.int64)
        rb.add(
            TensorDict(
                {
                    "observation": obs_t,
                    "action": stored_action,
                    "next": {
                        "observation": torch.as_tensor(next_obs, dtype=torch.float32),
                        "reward": torch.tensor([reward], dtype=torch.float32),
                        "done": torch.tensor([term or trunc]),
                        "terminated": torch.tensor([term]),
                        "truncated": torch.tensor([trunc]),
                    },
                },
                batch_size=[],
            )
        )
        obs = next_obs
        if term or trunc:
            episode += 1
            obs, _ = env.reset(seed=seed + episode)
        if step >= s.warmup:
            batch = rb.sample()
            out = loss(batch)
            total = sum(v for k, v in out.items() if k.startswith("loss"))
            optim.zero_grad()
            total.backward()
            optim.step()
            updater.step()
            if step % s.eval_every == s.eval_every - 1:
                loss_vals = {k: float(v.detach()) for k, v in out.items() if k.startswith("loss")}
    env.close()
    return finalize()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python scripts/train_behaviour.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("env_id", help=f"Gymnasium id; defaults exist for {', '.join(DEFAULTS)}")
    parser.add_argument("--steps", type=int, help="environment steps (default: per env)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, help="snapshot interval in environment steps")
    parser.add_argument("--out", type=Path, help="output folder (default: the package's policies/)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    import dataclasses

    import torch

    torch.set_num_threads(args.threads)
    settings = dataclasses.replace(DEFAULTS.get(args.env_id, TrainSettings()))
    if args.steps:
        settings.steps = args.steps
    if args.eval_every:
        settings.eval_every = args.eval_every
    train(args.env_id, settings, seed=args.seed, out_dir=args.out, log=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
