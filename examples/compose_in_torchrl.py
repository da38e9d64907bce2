"""Our BCQ and AWAC losses in a plain TorchRL loop: replay buffer, loss, Adam, SoftUpdate. No Lightning.

The losses are ordinary ``torchrl.objectives.LossModule`` s, so they drop into any
TorchRL training script. This one builds a small Pendulum-shaped dataset in memory
(3-d observation, 1-d action in [-2, 2]), samples it from a TorchRL replay buffer and
trains each loss for a few hundred gradient steps.

Run:  python examples/compose_in_torchrl.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict import TensorDict
from torchrl.data import Bounded, LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers import RandomSampler
from torchrl.objectives import SoftUpdate

from offline_plugins.modules.networks import make_perturbation, make_qvalue, make_tanh_gaussian_actor, make_vae
from offline_plugins.objectives.awac import AWACLoss
from offline_plugins.objectives.bcq import BCQLoss, BCQPolicy


def pendulum_like_dataset(n: int = 5000, seed: int = 0) -> TensorDict:
    """Transitions of a noisy proportional controller on pendulum-like dynamics (TED layout)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, generator=g) * 2 * torch.pi - torch.pi
    omega = torch.randn(n, generator=g)
    action = (-2.0 * theta - 0.5 * omega + 0.5 * torch.randn(n, generator=g)).clamp(-2, 2)
    new_omega = (omega + 0.05 * (-10 * torch.sin(theta) + 3 * action)).clamp(-8, 8)
    new_theta = theta + 0.05 * new_omega
    reward = -(theta**2 + 0.1 * omega**2 + 0.001 * action**2)

    def obs(th, om):
        return torch.stack([th.cos(), th.sin(), om], -1)

    done = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict(
        {
            "observation": obs(theta, omega),
            "action": action.unsqueeze(-1),
            "next": {
                "observation": obs(new_theta, new_omega),
                "reward": reward.unsqueeze(-1),
                "done": done,
                "terminated": done.clone(),
                "truncated": done.clone(),
            },
        },
        [n],
    )


def train(loss, buffer, steps: int, lr: float, tau: float = 0.005) -> TensorDict:
    loss.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss, tau=tau)
    optim = torch.optim.Adam(loss.parameters(), lr=lr)
    for _ in range(steps):
        out = loss(buffer.sample())
        # every loss_* term reaches only its own network, so one backward of the sum is exact
        total = sum(value for key, value in out.items() if key.startswith("loss_"))
        optim.zero_grad()
        total.backward()
        optim.step()
        updater.step()
    return out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    data = pendulum_like_dataset()
    buffer = ReplayBuffer(storage=LazyTensorStorage(len(data)), sampler=RandomSampler(), batch_size=256)
    buffer.extend(data)
    spec = Bounded(-2 * torch.ones(1), 2 * torch.ones(1), (1,))
    hidden = (64, 64)

    t0 = time.perf_counter()
    bcq = BCQLoss(make_perturbation(3, spec, hidden), make_qvalue(3, 1, hidden), make_vae(3, spec, hidden))
    out = train(bcq, buffer, args.steps, lr=1e-3)
    policy = BCQPolicy(bcq, num_samples=10)
    act = policy(TensorDict({"observation": data["observation"][:4]}, [4]))["action"]
    print(f"BCQ  {args.steps} steps in {time.perf_counter() - t0:.1f}s  "
          f"loss_vae={float(out['loss_vae']):.3f} loss_qvalue={float(out['loss_qvalue']):.3f} "
          f"q_data_mean={float(out['q_data_mean']):.2f}  actions={act.squeeze(-1).tolist()}")

    t0 = time.perf_counter()
    actor = make_tanh_gaussian_actor(3, spec, hidden)
    awac = AWACLoss(actor, make_qvalue(3, 1, hidden), beta=1.0)
    out = train(awac, buffer, args.steps, lr=3e-4)
    act = actor(TensorDict({"observation": data["observation"][:4]}, [4]))["action"]  # deterministic by default
    print(f"AWAC {args.steps} steps in {time.perf_counter() - t0:.1f}s  "
          f"loss_actor={float(out['loss_actor']):.3f} loss_qvalue={float(out['loss_qvalue']):.3f} "
          f"advantage_weight_mean={float(out['advantage_weight_mean']):.2f}  actions={act.squeeze(-1).tolist()}")


if __name__ == "__main__":
    main()
