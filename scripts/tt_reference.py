"""A plain Trajectory Transformer (Janner, Li & Levine 2021, arXiv:2106.02039), to check the package's against.

One file, one loop, nothing from ``offline_plugins`` but the dataset loader: every
dimension of ``(s, a, r, V)`` is discretised into quantile bins of its own, a GPT
(``torch.nn.TransformerEncoder`` with a causal mask) predicts the next token, action
tokens weigh more, and the policy is the paper's beam search: sample actions (least
likely ``cdf`` of the mass dropped), predict reward and value, keep the plans with the
best ``sum gamma^t r_t + gamma^(t+1) V_t``, predict the next state greedily.
``V_t`` is the discounted return after step ``t``, as in the paper.

    OMP_NUM_THREADS=1 python scripts/tt_reference.py --dataset pendulum/medium-v0 --steps 5000

Prints the planned action's distance to the data's on data states (against answering
0 and shuffled data actions) and the environment score, as JSON on the last line.
"""

import argparse
import json
import time

import numpy as np
import torch
from torch import nn

from offline_plugins.data.offline import load_offline_data

p = argparse.ArgumentParser()
p.add_argument("--dataset", default="pendulum/medium-v0")
p.add_argument("--steps", type=int, default=5000)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--K", type=int, default=10, help="transitions per training window")
p.add_argument("--windows", type=int, default=64, help="windows per batch")
p.add_argument("--bins", type=int, default=100)
p.add_argument("--embed", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--lr", type=float, default=6e-4)
p.add_argument("--warmup", type=int, default=100)
p.add_argument("--action-weight", type=float, default=5.0)
p.add_argument("--beam", type=int, default=32)
p.add_argument("--horizon", type=int, default=5)
p.add_argument("--context", type=int, default=3, help="transitions seen while planning, the current one included")
p.add_argument("--cdf", type=float, default=0.6)
p.add_argument("--episodes", type=int, default=10)
p.add_argument("--threads", type=int, default=1)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

data = load_offline_data(args.dataset, progress=False)
td = data.td
obs, act = td["observation"].float(), td["action"].float()
S, A, K, N = obs.shape[-1], act.shape[-1], args.K, args.bins
D = S + A + 2
reward = (td["next", "reward"] - 100.0 * td["next", "terminated"].float()).reshape(-1).double()
ep = td["episode"].reshape(-1).numpy()
value, starts = torch.zeros(len(ep), dtype=torch.float64), []
for e in np.unique(ep):
    idx = np.nonzero(ep == e)[0]
    g = 0.0
    for i in idx[::-1]:  # V_t: the discounted return after step t
        value[i] = g
        g = float(reward[i]) + 0.99 * g
    starts.extend(idx[: len(idx) - K + 1].tolist())
starts = torch.tensor(starts)
table = torch.cat([obs, act, reward.float()[:, None], value.float()[:, None]], -1)
srt = table.sort(0).values
edges = srt[(torch.linspace(0, 1, N + 1) * (len(srt) - 1)).round().long()].T.contiguous()  # [D, N+1] quantiles
centers = (edges[:, 1:] + edges[:, :-1]) / 2


def encode(x, start=0):
    e = edges[start:start + x.shape[-1], 1:-1].contiguous()
    return torch.searchsorted(e, x.reshape(-1, x.shape[-1]).T.contiguous(), right=True).T.reshape(x.shape)


def decode(tok, start=0):
    return centers[start:start + tok.shape[-1]].gather(1, tok.reshape(-1, tok.shape[-1]).T).T.reshape(tok.shape)


TOK = encode(table)  # [M, D]


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(D * N, args.embed)
        self.pos = nn.Parameter(torch.zeros(1, K * D, args.embed))
        layer = nn.TransformerEncoderLayer(args.embed, args.heads, 4 * args.embed, 0.1, "gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, args.layers)
        self.ln = nn.LayerNorm(args.embed)
        self.head = nn.Parameter(torch.randn(D, args.embed, N) * 0.02)  # one head per dimension

    def forward(self, tok):  # [B, T] tokens starting at a transition's first dimension -> [B, T, N]
        T = tok.shape[1]
        dim = torch.arange(T) % D
        h = self.emb(tok + dim * N) + self.pos[:, :T]
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)
        h = self.ln(self.blocks(h, mask=mask, is_causal=True))
        return torch.einsum("bte,tev->btv", h, self.head[dim])


model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
w = torch.ones(D)
w[S:S + A] = args.action_weight
wt = w[torch.arange(1, K * D) % D]
t0 = time.perf_counter()
for step in range(1, args.steps + 1):
    i0 = starts[torch.randint(len(starts), (args.windows,))]
    seq = TOK[i0[:, None] + torch.arange(K)].reshape(args.windows, K * D)
    logits = model(seq[:, :-1])
    ce = nn.functional.cross_entropy(logits.reshape(-1, N), seq[:, 1:].reshape(-1), reduction="none")
    loss = (ce.view(args.windows, -1) * wt).mean()
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % 500 == 0:
        print(f"step {step} loss {loss.item():.3f} {time.perf_counter() - t0:.0f}s", flush=True)
train_s = time.perf_counter() - t0
model.eval()


def next_logits(x):
    return model(x[:, -(K * D - 1):] if x.shape[1] >= K * D else x)[:, -1]  # sliding: whole transitions only


def cdf_sample(logits, cdf):
    probs = logits.softmax(-1)
    srt = probs.sort(-1).values
    cut = srt.gather(-1, (srt.cumsum(-1) < cdf).sum(-1, keepdim=True).clamp_max(N - 1))
    return torch.multinomial(probs * (probs >= cut), 1)


@torch.no_grad()
def plan(prefix):
    """First action tokens of the best plans after ``prefix`` [n, T0] (ending with a state's tokens)."""
    n, disc = len(prefix), 0.99 ** torch.arange(args.horizon + 1).float()
    x, rew, owner = prefix, torch.zeros(n, args.horizon + 1), torch.arange(n)
    for t in range(args.horizon):
        x, rew, owner = x.repeat(2, 1), rew.repeat(2, 1), owner.repeat(2)  # n_expand = 2
        for _ in range(A):
            x = torch.cat([x, cdf_sample(next_logits(x), args.cdf)], 1)
        for j in range(2):  # reward, then value: greedy, scored by their expectation
            logits = next_logits(x)
            rew[:, t + j] = (logits.softmax(-1) * centers[S + A + j]).sum(-1)
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], 1)
        score = (rew * disc).sum(-1)
        keep = torch.cat([torch.nonzero(owner == i).reshape(-1)[score[owner == i].argsort(descending=True)[:args.beam]]
                          for i in range(n)])
        x, rew, owner = x[keep], rew[keep], owner[keep]
        if t < args.horizon - 1:
            for _ in range(S):
                x = torch.cat([x, next_logits(x).argmax(-1, keepdim=True)], 1)
    score = (rew * disc).sum(-1)
    best = torch.stack([torch.nonzero(owner == i).reshape(-1)[score[owner == i].argmax()] for i in range(n)])
    return x[best, prefix.shape[1]:prefix.shape[1] + A + 2]  # the first action, reward and value tokens


gen = torch.Generator().manual_seed(1)
probe = torch.randperm(len(obs), generator=gen)[:128]
torch.manual_seed(args.seed)
with torch.no_grad():
    greedy = decode(model(TOK[probe, :S])[:, -1:].argmax(-1), S)  # the action model alone, from the state
    planned = decode(plan(TOK[probe, :S])[:, :A], S)
err = lambda a: float((a - act[probe]).abs().mean())  # noqa: E731
result = {"greedy": err(greedy), "planned": err(planned), "zero": err(torch.zeros_like(planned)),
          "shuffled": err(act[probe][torch.randperm(128, generator=gen)])}

envs = [data.make_env() for _ in range(args.episodes)]
o = [env.reset(seed=args.seed + i)[0] for i, env in enumerate(envs)]
total, live, t1 = np.zeros(args.episodes), list(range(args.episodes)), time.perf_counter()
context = torch.zeros(args.episodes, 0, dtype=torch.long)
while live:
    s_tok = encode(torch.as_tensor(np.stack([o[i] for i in live]), dtype=torch.float32))
    step_tok = plan(torch.cat([context[live], s_tok], 1))  # [n, A + 2]
    a = decode(step_tok[:, :A], S).numpy()
    still, rs = [], []
    for row, i in enumerate(live):
        o[i], r, term, trunc, _ = envs[i].step(np.clip(a[row], envs[i].action_space.low, envs[i].action_space.high))
        total[i] += r
        rs.append(r - 100.0 * term)
        if not (term or trunc):
            still.append(i)
    # the context holds finished transitions: the real reward, the plan's value
    step_tok[:, A] = encode(torch.tensor(rs, dtype=torch.float32)[:, None], S + A)[:, 0]
    done = torch.cat([s_tok, step_tok], 1)
    ctx = torch.zeros(args.episodes, done.shape[1], dtype=torch.long)
    ctx[live] = done
    context = torch.cat([context, ctx], 1)[:, -(args.context - 1) * D:] if args.context > 1 else context[:, :0]
    live = still
score = np.asarray(data.normalized_score(total))
result.update(score_mean=float(score.mean()), score_std=float(score.std()), return_mean=float(total.mean()),
              train_s=round(train_s, 1), eval_s=round(time.perf_counter() - t1, 1), steps=args.steps)
print(json.dumps(result))
