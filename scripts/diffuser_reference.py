"""A plain Diffuser (Janner, Du, Tenenbaum & Levine 2022, arXiv:2205.09991), to check the package's against.

One file, one loop, nothing from ``offline_plugins`` but the dataset loader: a temporal
U-Net denoises windows of ``[action, state]`` (scaled to [-1, 1] per channel by the data's
range, as the paper's locomotion runs do), DDPM with a cosine schedule, the first state
inpainted at every reverse step, an optional return model whose gradient guides sampling.

    OMP_NUM_THREADS=1 python scripts/diffuser_reference.py --dataset pendulum/medium-v0 --steps 5000

Prints the unguided planned first action's distance to the data's (against answering 0
and against shuffled data actions) and the environment score, as JSON on the last line.
"""

import argparse
import json
import math
import time

import numpy as np
import torch
from torch import nn

from offline_plugins.data.offline import load_offline_data

p = argparse.ArgumentParser()
p.add_argument("--dataset", default="pendulum/medium-v0")
p.add_argument("--steps", type=int, default=5000)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--horizon", type=int, default=32)
p.add_argument("--windows", type=int, default=32, help="windows per batch")
p.add_argument("--T", type=int, default=20, help="diffusion steps")
p.add_argument("--dim", type=int, default=32)
p.add_argument("--mults", default="1,2,4")
p.add_argument("--lr", type=float, default=2e-4)
p.add_argument("--action-weight", type=float, default=10.0)
p.add_argument("--predict-epsilon", action="store_true", help="predict the noise (default: the clean window)")
p.add_argument("--ema", type=float, default=0.995, help="decay of the averaged denoiser, stepped every step")
p.add_argument("--guide-scale", type=float, default=0.0, help="0: no return model, plan unguided")
p.add_argument("--samples", type=int, default=1, help="plans per state; the best by the return model acts")
p.add_argument("--episodes", type=int, default=10)
p.add_argument("--threads", type=int, default=1)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
np.random.seed(args.seed)

data = load_offline_data(args.dataset, progress=False)
td = data.td
obs, act = td["observation"].float(), td["action"].float()
S, A, H = obs.shape[-1], act.shape[-1], args.horizon
traj = torch.cat([act, obs], -1)
lo, hi = traj.amin(0), traj.amax(0)
norm = lambda x: 2 * (x - lo) / (hi - lo).clamp_min(1e-6) - 1  # noqa: E731
unnorm = lambda x: (x + 1) / 2 * (hi - lo).clamp_min(1e-6) + lo  # noqa: E731
X = norm(traj)
ep = td["episode"].reshape(-1).numpy()
reward = td["next", "reward"].reshape(-1).numpy().astype(np.float64)
starts, returns = [], np.zeros(len(ep))
for e in np.unique(ep):
    idx = np.nonzero(ep == e)[0]
    g = 0.0
    for i in idx[::-1]:
        g = reward[i] + 0.99 * g
        returns[i] = g
    starts.extend(idx[: len(idx) - H + 1].tolist())
starts = torch.tensor(starts)
ret = torch.tensor(returns, dtype=torch.float32)
ret_loc, ret_scale = ret.mean(), ret.std()

betas = (lambda ac: (1 - ac[1:] / ac[:-1]).clamp(0, 0.999))(
    torch.cos((torch.linspace(0, 1, args.T + 1, dtype=torch.float64) + 0.008) / 1.008 * math.pi / 2) ** 2)
abar = torch.cumprod(1 - betas, 0)
abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
coef_x0 = (betas * abar_prev.sqrt() / (1 - abar)).float()
coef_xt = ((1 - abar_prev) * (1 - betas).sqrt() / (1 - abar)).float()
post_std = (betas * (1 - abar_prev) / (1 - abar)).clamp_min(1e-20).sqrt().float()
abar = abar.float()


def conv(ci, co):
    return nn.Sequential(nn.Conv1d(ci, co, 5, padding=2), nn.GroupNorm(8, co), nn.Mish())


class Res(nn.Module):
    def __init__(self, ci, co, e):
        super().__init__()
        self.a, self.b, self.t = conv(ci, co), conv(co, co), nn.Sequential(nn.Mish(), nn.Linear(e, co))
        self.skip = nn.Conv1d(ci, co, 1) if ci != co else nn.Identity()

    def forward(self, x, e):
        return self.b(self.a(x) + self.t(e)[..., None]) + self.skip(x)


def step_embedding(t, dim):
    f = torch.exp(-math.log(10000) * torch.arange(dim // 2) / (dim // 2 - 1))
    return torch.cat([(t.float()[:, None] * f).sin(), (t.float()[:, None] * f).cos()], -1)


class UNet(nn.Module):
    def __init__(self, C, dim, mults, out=None):
        super().__init__()
        d = [C] + [dim * m for m in mults]
        self.dim, self.value = dim, out == 1
        self.emb = nn.Sequential(nn.Linear(dim, 4 * dim), nn.Mish(), nn.Linear(4 * dim, dim))
        self.down = nn.ModuleList(nn.ModuleList([Res(a, b, dim), Res(b, b, dim), nn.Conv1d(b, b, 3, 2, 1)
                                                 if i < len(mults) - 1 or self.value else nn.Identity()])
                                  for i, (a, b) in enumerate(zip(d[:-1], d[1:])))
        if self.value:  # the return model: the downsampling half, pooled, then an MLP
            self.head = nn.Sequential(nn.Linear(d[-1] + dim, d[-1] // 2), nn.Mish(), nn.Linear(d[-1] // 2, 1))
            return
        self.mid = nn.ModuleList([Res(d[-1], d[-1], dim), Res(d[-1], d[-1], dim)])
        self.up = nn.ModuleList(nn.ModuleList([Res(2 * b, a, dim), Res(a, a, dim), nn.ConvTranspose1d(a, a, 4, 2, 1)])
                                for a, b in reversed(list(zip(d[1:-1], d[2:]))))
        self.out = nn.Sequential(conv(dim, dim), nn.Conv1d(dim, C, 1))

    def forward(self, x, t):
        e, h, skips = self.emb(step_embedding(t, self.dim)), x.transpose(1, 2), []
        for r1, r2, down in self.down:
            h = r2(r1(h, e), e)
            skips.append(h)
            h = down(h)
        if self.value:
            return self.head(torch.cat([h.mean(-1), e], -1))
        h = self.mid[1](self.mid[0](h, e), e)
        for r1, r2, up in self.up:
            h = up(r2(r1(torch.cat([h, skips.pop()], 1), e), e))
        return self.out(h).transpose(1, 2)


mults = tuple(int(m) for m in args.mults.split(","))
model = UNet(S + A, args.dim, mults)
ema = UNet(S + A, args.dim, mults)
ema.load_state_dict(model.state_dict())
value = UNet(S + A, args.dim, mults, out=1)
opt = torch.optim.Adam(model.parameters(), lr=args.lr)
vopt = torch.optim.Adam(value.parameters(), lr=args.lr)
weight = torch.ones(H, S + A)
weight[0, :A] = args.action_weight

t0 = time.perf_counter()
for step in range(1, args.steps + 1):
    i0 = starts[torch.randint(len(starts), (args.windows,))]
    x0 = X[i0[:, None] + torch.arange(H)]
    t = torch.randint(args.T, (args.windows,))
    noise = torch.randn_like(x0)
    xt = abar[t].sqrt()[:, None, None] * x0 + (1 - abar[t]).sqrt()[:, None, None] * noise
    xt[:, 0, A:] = x0[:, 0, A:]
    loss = ((model(xt, t) - (noise if args.predict_epsilon else x0)) ** 2 * weight).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - args.ema)
    if args.guide_scale > 0:
        vloss = ((value(xt, t).squeeze(-1) - (ret[i0] - ret_loc) / ret_scale) ** 2).mean()
        vopt.zero_grad()
        vloss.backward()
        vopt.step()
    if step % 500 == 0:
        print(f"step {step} loss {loss.item():.4f} {time.perf_counter() - t0:.0f}s", flush=True)
train_s = time.perf_counter() - t0


def plan(s, samples):
    """First actions (raw units) of plans from raw states ``s`` ``[n, S]``."""
    s0 = norm(torch.cat([torch.zeros(len(s), A), s], -1))[:, A:].repeat_interleave(samples, 0)
    x = torch.randn(len(s0), H, S + A)
    x[:, 0, A:] = s0
    for i in reversed(range(args.T)):
        t = torch.full((len(x),), i)
        if args.guide_scale > 0 and i >= 2:
            with torch.enable_grad():
                xg = x.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(value(xg, t).sum(), xg)
            x = x + args.guide_scale * post_std[i] ** 2 * grad
            x[:, 0, A:] = s0
        with torch.no_grad():
            out = ema(x, t)
            x0 = (x - (1 - abar[i]).sqrt() * out) / abar[i].sqrt() if args.predict_epsilon else out
            x = coef_x0[i] * x0.clamp(-1, 1) + coef_xt[i] * x + (post_std[i] * torch.randn_like(x) if i > 0 else 0)
        x[:, 0, A:] = s0
    with torch.no_grad():
        best = value(x, torch.zeros(len(x), dtype=torch.long)).reshape(-1, samples).argmax(-1) if samples > 1 else 0
    first = unnorm(x[:, 0].reshape(len(s), samples, -1)[torch.arange(len(s)), best])
    return first[:, :A]


gen = torch.Generator().manual_seed(1)
probe = torch.randperm(len(obs), generator=gen)[:128]
with torch.no_grad():
    planned = plan(obs[probe], 1)
err = lambda a: float((a - act[probe]).abs().mean())  # noqa: E731
result = {"planned": err(planned), "zero": err(torch.zeros_like(planned)),
          "shuffled": err(act[probe][torch.randperm(128, generator=gen)])}

envs = [data.make_env() for _ in range(args.episodes)]
o = [env.reset(seed=args.seed + i)[0] for i, env in enumerate(envs)]
total, live, t1 = np.zeros(args.episodes), list(range(args.episodes)), time.perf_counter()
torch.manual_seed(args.seed)
while live:
    a = plan(torch.as_tensor(np.stack([o[i] for i in live]), dtype=torch.float32), args.samples).numpy()
    still = []
    for row, i in enumerate(live):
        o[i], r, term, trunc, _ = envs[i].step(np.clip(a[row], envs[i].action_space.low, envs[i].action_space.high))
        total[i] += r
        if not (term or trunc):
            still.append(i)
    live = still
score = np.asarray(data.normalized_score(total))
result.update(score_mean=float(score.mean()), score_std=float(score.std()), return_mean=float(total.mean()),
              train_s=round(train_s, 1), eval_s=round(time.perf_counter() - t1, 1), steps=args.steps)
print(json.dumps(result))
