"""Offline-RL training speed: our losses against TorchRL's reference loop and d3rlpy.

Gradient steps per second, side by side in one run, on the same synthetic data
(Hopper shapes by default: 11-d observation, 3-d action, 100k transitions), batch 256,
2x256 networks, one CPU thread. For each algorithm:

* ``torchrl``: TorchRL's loss (``IQLLoss``, ``TD3BCLoss``, ``CQLLoss``) on networks built as
  TorchRL's ``sota-implementations`` build them, one Adam per network, ``SoftUpdate``; for
  TD3+BC, as its ``td3_bc`` script: the critic term (``qvalue_loss``) every step, ``actor_loss`` and the target
  update on the delayed actor's steps only;
* ``ours``: ``build(config, data)`` of our registered algorithm, stepped as the training
  shell steps ``AlgorithmParts`` (only the due ``loss_*`` terms, ``compute_terms``; their
  sum, one backward, the shell's one fused Adam over all groups; the algorithm's target
  updater on the slowest group's steps);
* ``d3rlpy`` (with ``--d3rlpy-python``, a separate venv with d3rlpy 2.x): the same
  algorithm's ``update`` on a ``TransitionMiniBatch`` of the same shapes.

The contenders take turns in ``--rounds`` chunks and the median chunk speed is reported,
so a load spike on a shared machine hits all of them alike. Each chunk's batches are drawn
before its clock starts, for every contender (d3rlpy's bench loop always did so): the
figures are update steps per second, sampling excluded.

With ``--plain`` a hand-written plain PyTorch IQL (no TensorDict, no TorchRL) joins the IQL turns.

SAC-N and EDAC (``--algos sac-n,edac --critics 10,50``) have no TorchRL reference loop; their
contenders are ours (the N critics as one vmapped ensemble), a plain PyTorch loop over N
separate critic modules (``_PlainEnsemble``: what one writes without vmap), and d3rlpy's
``SAC`` with ``n_critics=N`` (its critics are a ``ModuleList`` run one by one; d3rlpy has no
EDAC). All on the registered defaults: 3x256 networks, batch 256.

Run: ``python bench/offline_bench.py [--steps 300] [--rounds 5] [--algos iql,td3-bc,cql]
[--d3rlpy-python /path/to/venv/bin/python] [--compile] [--plain]``; ``--compile`` adds ours
through ``torch.compile`` (``train --compile``) as a further contender. Prints a markdown table and a
JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time

BATCH = 256
HIDDEN = (256, 256)
N_DATA = 100_000


def _dataset(obs_dim: int, act_dim: int, device):
    import torch
    from tensordict import TensorDict
    from torchrl.data import Bounded, Unbounded
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    done = torch.rand(N_DATA, 1, generator=g) < 0.001
    td = TensorDict(
        {
            "observation": torch.randn(N_DATA, obs_dim, generator=g),
            "action": torch.rand(N_DATA, act_dim, generator=g) * 2 - 1,
            "next": {
                "observation": torch.randn(N_DATA, obs_dim, generator=g),
                "reward": torch.randn(N_DATA, 1, generator=g),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros_like(done),
            },
        },
        [N_DATA],
    ).to(device)
    spec = Bounded(-torch.ones(act_dim), torch.ones(act_dim), (act_dim,), device=device)
    data = SimpleNamespace(observation_spec=Unbounded((obs_dim,)), action_spec=spec, action_space="continuous")
    return data, td


def _sampler(td, device):
    import torch

    n = td.shape[0]

    def sample():
        # indices drawn on the device: no host round trip per step
        return td[torch.randint(n, (BATCH,), device=device)]

    return sample


def _reference(name: str, data):
    """TorchRL's loss on networks built the way TorchRL's sota-implementations build them."""
    import torch
    from torch import nn
    from torchrl.modules import MLP, NormalParamExtractor, ProbabilisticActor, TanhModule, TanhNormal, ValueOperator
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.objectives import CQLLoss, IQLLoss, SoftUpdate, TD3BCLoss

    obs_dim, act_dim = data.observation_spec.shape[-1], data.action_spec.shape[-1]
    spec = data.action_spec

    def gaussian_actor():
        net = nn.Sequential(MLP(in_features=obs_dim, num_cells=list(HIDDEN), out_features=2 * act_dim, activation_class=nn.ReLU),
                            NormalParamExtractor(scale_lb=1e-4))
        module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
        return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal,
                                  distribution_kwargs={"low": spec.space.low, "high": spec.space.high,
                                                       "tanh_loc": False})

    def qvalue():
        return ValueOperator(MLP(in_features=obs_dim + act_dim, num_cells=list(HIDDEN), out_features=1,
                                 activation_class=nn.ReLU), in_keys=["observation", "action"])

    if name == "iql":
        value = ValueOperator(MLP(in_features=obs_dim, num_cells=list(HIDDEN), out_features=1, activation_class=nn.ReLU),
                              in_keys=["observation"], out_keys=["state_value"])
        actor = gaussian_actor()
        loss = IQLLoss(actor, qvalue(), value, loss_function="l2", temperature=3.0, expectile=0.7)
        groups = [(loss.actor_network_params, ("loss_actor",), 1), (loss.qvalue_network_params, ("loss_qvalue",), 1),
                  (loss.value_network_params, ("loss_value",), 1)]
    elif name == "td3-bc":
        actor = TensorDictSequential(
            TensorDictModule(MLP(in_features=obs_dim, num_cells=list(HIDDEN), out_features=act_dim,
                                 activation_class=nn.ReLU),
                             in_keys=["observation"], out_keys=["param"]),
            TanhModule(in_keys=["param"], out_keys=["action"], spec=spec),
        )
        loss = TD3BCLoss(actor, qvalue(), action_spec=spec, loss_function="l2", alpha=2.5)
        groups = [(loss.actor_network_params, ("loss_actor",), 2), (loss.qvalue_network_params, ("loss_qvalue",), 1)]
    elif name == "cql":
        loss = CQLLoss(gaussian_actor(), qvalue(), loss_function="l2", min_q_weight=5.0, num_random=10,
                       action_spec=spec)
        groups = [(loss.actor_network_params, ("loss_actor",), 1),
                  (loss.qvalue_network_params, ("loss_qvalue", "loss_cql"), 1),
                  ([loss.log_alpha], ("loss_alpha",), 1)]
    else:
        raise ValueError(name)
    loss.make_value_estimator(gamma=0.99)
    opts = []
    for params, keys, every in groups:
        plist = list(params.parameters()) if hasattr(params, "parameters") else list(params)
        opts.append((torch.optim.Adam(plist, lr=3e-4), every))
    def compute(batch, keys):
        if name != "td3-bc":
            return loss(batch)
        # as TorchRL's sota-implementations/td3_bc loop: the actor term only on the actor's steps
        out = {"loss_qvalue": loss.qvalue_loss(batch)[0]}
        if "loss_actor" in keys:
            out["loss_actor"] = loss.actor_loss(batch)[0]
        return out

    terms = [(keys, every) for _, keys, every in groups]
    return compute, terms, opts, SoftUpdate(loss, tau=0.005), max(every for _, _, every in groups)


def _ours(name: str, data, compile_: bool, **overrides):
    from offline_plugins.algorithms.base import compute_terms, target_update_period
    from offline_plugins.lightning.module import compile_terms, make_shell_optimizer
    from offline_plugins.plugins.manager import load_registry

    spec = load_registry().algorithm(name)
    config = dataclasses.replace(spec.default_config(), **overrides)
    parts = spec.load_build()(config, data)
    terms = [(g.loss_keys, g.every) for g in parts.optimizers]
    # the training shell's optimiser: one fused Adam over every group (a group not due has
    # no gradients that step, and Adam leaves it alone)
    opts = [(make_shell_optimizer(parts.optimizers), 1)]
    # as the training shell (``train --compile``): only the due terms, through torch.compile if asked
    compute = compile_terms(parts.loss) if compile_ else functools.partial(compute_terms, parts.loss)
    target_every = parts.target_period()
    return compute, terms, opts, parts.target_updater, target_every


class _PlainIQL:
    """IQL as one would write it by hand in plain PyTorch: ``nn.Sequential`` networks, one
    default Adam per network, Polyak targets; no TensorDict, no TorchRL. The issue's third
    reference point (its "hand-written plain PyTorch IQL")."""

    def __init__(self, obs_dim: int, act_dim: int, sample, warmup: int = 20) -> None:
        import copy

        import torch
        from torch import nn

        def mlp(i, o):
            return nn.Sequential(nn.Linear(i, HIDDEN[0]), nn.ReLU(), nn.Linear(HIDDEN[0], HIDDEN[1]), nn.ReLU(),
                                 nn.Linear(HIDDEN[1], o))

        self.q1, self.q2, self.v = mlp(obs_dim + act_dim, 1), mlp(obs_dim + act_dim, 1), mlp(obs_dim, 1)
        self.actor = mlp(obs_dim, 2 * act_dim)
        self.q1_t, self.q2_t = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        self.opts = [torch.optim.Adam(m.parameters(), lr=3e-4) for m in (self.q1, self.q2, self.v, self.actor)]
        self.sample = sample
        self.run(warmup)

    def _one(self, b) -> None:
        import torch
        import torch.nn.functional as F

        obs, act = b["observation"], b["action"]
        nobs, rew = b["next", "observation"], b["next", "reward"]
        not_done = 1.0 - b["next", "terminated"].float()
        sa = torch.cat([obs, act], -1)
        with torch.no_grad():
            q_t = torch.minimum(self.q1_t(sa), self.q2_t(sa))
            target = rew + 0.99 * not_done * self.v(nobs)
        v = self.v(obs)
        u = q_t - v
        loss_v = (torch.abs(0.7 - (u < 0).float()) * u.pow(2)).mean()
        loss_q = F.mse_loss(self.q1(sa), target) + F.mse_loss(self.q2(sa), target)
        weight = torch.exp(3.0 * u.detach()).clamp(max=100.0)
        loc, log_scale = self.actor(obs).chunk(2, -1)
        scale = F.softplus(log_scale) + 1e-4
        x = torch.atanh(act.clamp(-1 + 1e-6, 1 - 1e-6))
        log_prob = (torch.distributions.Normal(loc, scale).log_prob(x) - torch.log1p(-act.pow(2) + 1e-6)).sum(-1, True)
        loss_pi = -(weight * log_prob).mean()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        (loss_v + loss_q + loss_pi).backward()
        for opt in self.opts:
            opt.step()
        with torch.no_grad():
            for net, tgt in ((self.q1, self.q1_t), (self.q2, self.q2_t)):
                for p, pt in zip(net.parameters(), tgt.parameters()):
                    pt.lerp_(p, 0.005)

    def run(self, steps: int) -> float:
        batches = [self.sample() for _ in range(steps)]  # drawn before the clock, as for d3rlpy
        t0 = time.perf_counter()
        for b in batches:
            self._one(b)
        return steps / (time.perf_counter() - t0)


class _PlainEnsemble:
    """SAC-N (and EDAC with ``eta``) as one writes it without vmap: N ``nn.Sequential`` critics
    in a list, each run in turn; one Adam for the critics, one for the actor, one for the
    temperature; CORL's update order (critics, then actor and temperature). EDAC's action
    gradients are one ``autograd.grad`` per critic."""

    def __init__(self, obs_dim: int, act_dim: int, n: int, sample, eta=None, hidden=(256, 256, 256),
                 warmup: int = 5) -> None:
        import copy

        import torch
        from torch import nn

        def mlp(i, o):
            layers, last = [], i
            for h in hidden:
                layers += [nn.Linear(last, h), nn.ReLU()]
                last = h
            return nn.Sequential(*layers, nn.Linear(last, o))

        self.critics = nn.ModuleList([mlp(obs_dim + act_dim, 1) for _ in range(n)])
        self.targets = copy.deepcopy(self.critics)
        self.actor = mlp(obs_dim, 2 * act_dim)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.opt_q = torch.optim.Adam(self.critics.parameters(), lr=3e-4)
        self.opt_pi = torch.optim.Adam(self.actor.parameters(), lr=3e-4)
        self.opt_alpha = torch.optim.Adam([self.log_alpha], lr=3e-4)
        self.eta, self.target_entropy, self.sample = eta, -float(act_dim), sample
        self.run(warmup)

    def _policy(self, obs):
        import torch
        import torch.nn.functional as F

        loc, log_scale = self.actor(obs).chunk(2, -1)
        dist = torch.distributions.Normal(loc, F.softplus(log_scale) + 1e-4)
        x = dist.rsample()
        a = torch.tanh(x)
        return a, (dist.log_prob(x) - torch.log1p(-a.pow(2) + 1e-6)).sum(-1, keepdim=True)

    def _one(self, b) -> None:
        import torch
        import torch.nn.functional as F

        obs, act = b["observation"], b["action"]
        nobs, rew = b["next", "observation"], b["next", "reward"]
        not_done = 1.0 - b["next", "terminated"].float()
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            a2, lp2 = self._policy(nobs)
            sa2 = torch.cat([nobs, a2], -1)
            q_next = torch.stack([t(sa2) for t in self.targets]).min(0).values - alpha * lp2
            y = rew + 0.99 * not_done * q_next
        loss_q, grads = 0.0, []
        for critic in self.critics:
            a = act.clone().requires_grad_(self.eta is not None)
            q = critic(torch.cat([obs, a], -1))
            loss_q = loss_q + F.mse_loss(q, y)
            if self.eta is not None:
                grads.append(torch.autograd.grad(q.sum(), a, create_graph=True)[0])
        if self.eta is not None:
            g = torch.stack(grads)
            g = g / (g.norm(dim=-1, keepdim=True) + 1e-10)
            gram = torch.einsum("ibk,jbk->bij", g, g) * (1 - torch.eye(len(grads)))
            loss_q = loss_q + self.eta * gram.sum((1, 2)).mean() / (len(grads) - 1)
        self.opt_q.zero_grad(set_to_none=True)
        loss_q.backward()
        self.opt_q.step()
        a, lp = self._policy(obs)
        sa = torch.cat([obs, a], -1)
        q_pi = torch.stack([c(sa) for c in self.critics]).min(0).values
        loss_pi = (alpha * lp - q_pi).mean()
        loss_alpha = -(self.log_alpha * (lp.detach() + self.target_entropy)).mean()
        self.opt_pi.zero_grad(set_to_none=True)
        self.opt_alpha.zero_grad(set_to_none=True)
        (loss_pi + loss_alpha).backward()
        self.opt_pi.step()
        self.opt_alpha.step()
        with torch.no_grad():
            for p, pt in zip(self.critics.parameters(), self.targets.parameters()):
                pt.lerp_(p, 0.005)

    def run(self, steps: int) -> float:
        batches = [self.sample() for _ in range(steps)]
        t0 = time.perf_counter()
        for b in batches:
            self._one(b)
        return steps / (time.perf_counter() - t0)


class _Runner:
    """Steps one contender in chunks, so contenders can take turns under the same machine load."""

    def __init__(self, compute, terms, opts, updater, target_every, sample, warmup: int = 20) -> None:
        """``terms``: ``[(loss keys, every)]`` per group; ``opts``: ``[(optimizer, every)]``."""
        self.compute, self.terms, self.opts, self.updater, self.sample = compute, terms, opts, updater, sample
        self.target_every = target_every
        self.step = 0
        self.run(warmup)

    def _one(self, batch) -> None:
        step, opts = self.step, self.opts
        keys = [k for ks, every in self.terms if (step + 1) % every == 0 for k in ks]
        out = self.compute(batch, keys)
        total = sum(out[k] for k in keys)
        for opt, _ in opts:
            opt.zero_grad(set_to_none=True)
        total.backward()
        for opt, every in opts:
            if (step + 1) % every == 0:
                opt.step()
        # targets move on the slowest group's steps (TD3+BC: with the delayed actor)
        if self.updater is not None and (step + 1) % self.target_every == 0:
            self.updater.step()
        self.step += 1

    def run(self, steps: int) -> float:
        import torch

        batches = [self.sample() for _ in range(steps)]  # drawn before the clock, as for d3rlpy
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches:
            self._one(b)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return steps / (time.perf_counter() - t0)


_D3RLPY = r"""
import json, sys, time, numpy as np, torch
torch.set_num_threads(1)
import d3rlpy
name, obs_dim, act_dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
n = 100_000
term = (rng.random(n) < 0.001).astype(np.float32)
ds = d3rlpy.dataset.MDPDataset(rng.standard_normal((n, obs_dim)).astype(np.float32),
    (rng.random((n, act_dim)) * 2 - 1).astype(np.float32), rng.standard_normal(n).astype(np.float32), term,
    action_space=d3rlpy.constants.ActionSpace.CONTINUOUS)
enc = d3rlpy.models.VectorEncoderFactory([256, 256])
kw = dict(batch_size=256, actor_encoder_factory=enc, critic_encoder_factory=enc)
if name == "iql":
    algo = d3rlpy.algos.IQLConfig(value_encoder_factory=enc, expectile=0.7, weight_temp=3.0, **kw).create(device="cpu:0")
elif name == "td3-bc":
    algo = d3rlpy.algos.TD3PlusBCConfig(alpha=2.5, **kw).create(device="cpu:0")
elif name.startswith("sac-n:"):  # SAC-N: d3rlpy's SAC with N critics (3x256 networks, as ours)
    enc = d3rlpy.models.VectorEncoderFactory([256, 256, 256])
    algo = d3rlpy.algos.SACConfig(n_critics=int(name.split(":")[1]), batch_size=256, actor_encoder_factory=enc,
                                  critic_encoder_factory=enc).create(device="cpu:0")
else:
    algo = d3rlpy.algos.CQLConfig(conservative_weight=5.0, n_action_samples=10, **kw).create(device="cpu:0")
algo.build_with_dataset(ds)
for _ in range(20):
    algo.update(ds.sample_transition_batch(256))
print(json.dumps({"ready": d3rlpy.__version__}), flush=True)
for line in sys.stdin:
    steps = int(line)
    batches = [ds.sample_transition_batch(256) for _ in range(steps)]
    t0 = time.perf_counter()
    for b in batches:
        algo.update(b)
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - t0)}), flush=True)
"""


class _D3rlpyRunner:
    """d3rlpy's ``update`` in its own venv, driven chunk by chunk over a pipe."""

    def __init__(self, python: str, name: str, obs_dim: int, act_dim: int) -> None:
        self.proc = subprocess.Popen([python, "-c", _D3RLPY, name, str(obs_dim), str(act_dim)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.version = self._read("ready")

    def _read(self, key: str):
        # d3rlpy and gym print their own lines to stdout; ours are JSON objects holding `key`
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                msg = json.loads(line)
                if key in msg:
                    return msg[key]
        err = self.proc.stderr.read().strip().splitlines()
        raise RuntimeError(err[-1] if err else "d3rlpy process exited")

    def run(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return self._read("steps_per_s")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed gradient steps per contender")
    parser.add_argument("--rounds", type=int, default=5, help="turns the timed steps are split into")
    parser.add_argument("--algos", default="iql,td3-bc,cql")
    parser.add_argument("--obs-dim", type=int, default=11)
    parser.add_argument("--act-dim", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true",
                        help="also time ours through torch.compile, as `train --compile` (opt-in)")
    parser.add_argument("--d3rlpy-python", default=None, help="python of a venv with d3rlpy 2.x")
    parser.add_argument("--plain", action="store_true", help="also time a hand-written plain PyTorch IQL")
    parser.add_argument("--critics", default="10,50", help="SAC-N / EDAC: ensemble sizes N to time")
    parser.add_argument("--ensemble-steps", type=int, default=60, help="SAC-N / EDAC: timed steps per contender and N")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    data, td = _dataset(args.obs_dim, args.act_dim, device)
    sample = _sampler(td, device)
    rows = []
    ensemble_rows = _ensemble_rows(args, data, sample, device)
    for name in [a for a in args.algos.split(",") if a not in ("sac-n", "edac")]:
        with torch.device(device):
            runners = {"torchrl": _Runner(*_reference(name, data), sample), "ours": _Runner(*_ours(name, data, False), sample)}
            if args.compile:
                runners["compiled"] = _Runner(*_ours(name, data, True), sample)
            if name == "iql" and args.plain:
                runners["plain"] = _PlainIQL(args.obs_dim, args.act_dim, sample)
        d3_err = "not run"
        if args.d3rlpy_python:
            try:
                runners["d3rlpy"] = _D3rlpyRunner(args.d3rlpy_python, name, args.obs_dim, args.act_dim)
                d3_err = None
            except Exception as exc:  # a broken d3rlpy venv should not stop the rest
                d3_err = str(exc)
        speeds, med = _race(runners, args.steps, args.rounds)
        d3 = med.get("d3rlpy")
        rows.append({"algo": name, "ours": med["ours"], "torchrl": med["torchrl"], "d3rlpy": d3,
                     "plain": med.get("plain"), "ours/plain": med["ours"] / med["plain"] if "plain" in med else None,
                     "ours/torchrl": med["ours"] / med["torchrl"], "ours/d3rlpy": med["ours"] / d3 if d3 else None,
                     "compiled": med.get("compiled"),
                     "compiled/torchrl": med["compiled"] / med["torchrl"] if "compiled" in med else None,
                     "compiled/d3rlpy": med["compiled"] / d3 if d3 and "compiled" in med else None,
                     "d3rlpy_error": d3_err, "chunks": speeds})
    if rows:
        print("| algorithm | ours (steps/s) | TorchRL loop | d3rlpy | ours / TorchRL | ours / d3rlpy |")
        print("|---|---|---|---|---|---|")
    for r in rows:
        d3 = f"{r['d3rlpy']:.1f}" if r["d3rlpy"] else "-"
        rd = f"{r['ours/d3rlpy']:.2f}x" if r["ours/d3rlpy"] else "-"
        print(f"| {r['algo']} | {r['ours']:.1f} | {r['torchrl']:.1f} | {d3} | {r['ours/torchrl']:.2f}x | {rd} |")
        if r["compiled"]:
            cd = f", {r['compiled/d3rlpy']:.2f}x d3rlpy" if r["compiled/d3rlpy"] else ""
            print(f"\n{r['algo']}: ours with --compile {r['compiled']:.1f} steps/s; {r['compiled/torchrl']:.2f}x TorchRL{cd}")
        if r["plain"]:
            print(f"\n{r['algo']}: hand-written plain PyTorch {r['plain']:.1f} steps/s; ours / plain {r['ours/plain']:.2f}x")
    ceiling = _cql_ceiling(args.obs_dim, args.act_dim, device) if "cql" in args.algos.split(",") else None
    if ceiling:
        print(f"\ncql: arithmetic floor {ceiling['floor_ms']:.0f} ms per step at the measured GEMM rate "
              f"({ceiling['gflops']:.0f} GFLOP/s), so at most {ceiling['max_steps_per_s']:.1f} steps/s for anyone")
    print(json.dumps({"device": str(device), "compile": args.compile, "steps": args.steps, "rows": rows,
                      "ensemble_rows": ensemble_rows, "cql_ceiling": ceiling}))


def _race(runners: dict, steps: int, rounds: int) -> tuple[dict, dict]:
    """Run ``steps`` steps of each runner, the contenders taking turns chunk by chunk over ``rounds`` rounds (closing
    d3rlpy's after); the speeds of every chunk and each runner's median, which is robust to load spikes."""
    speeds = {k: [] for k in runners}
    chunk = max(1, steps // rounds)
    for _ in range(rounds):
        for key, runner in runners.items():
            speeds[key].append(runner.run(chunk))
    if "d3rlpy" in runners:
        runners["d3rlpy"].close()
    return speeds, {k: statistics.median(v) for k, v in speeds.items()}


def _ensemble_rows(args, data, sample, device) -> list:
    """SAC-N / EDAC at each ``--critics`` N: ours (vmapped), the plain per-critic loop, d3rlpy's SAC (SAC-N only)."""
    import torch

    rows = []
    for name in [a for a in args.algos.split(",") if a in ("sac-n", "edac")]:
        for n in [int(c) for c in args.critics.split(",")]:
            with torch.device(device):
                runners = {"ours": _Runner(*_ours(name, data, False, num_critics=n), sample, warmup=5),
                           "plain": _PlainEnsemble(args.obs_dim, args.act_dim, n, sample,
                                                   eta=1.0 if name == "edac" else None)}
            d3_err = "not run" if name == "sac-n" else "d3rlpy has no EDAC"
            if args.d3rlpy_python and name == "sac-n":
                try:
                    runners["d3rlpy"] = _D3rlpyRunner(args.d3rlpy_python, f"sac-n:{n}", args.obs_dim, args.act_dim)
                    d3_err = None
                except Exception as exc:
                    d3_err = str(exc)
            speeds, med = _race(runners, args.ensemble_steps, args.rounds)
            rows.append({"algo": name, "critics": n, **med, "ours/plain": med["ours"] / med["plain"],
                         "ours/d3rlpy": med["ours"] / med["d3rlpy"] if "d3rlpy" in med else None,
                         "d3rlpy_error": d3_err, "chunks": speeds})
    if not rows:
        return rows
    print("| algorithm | N | ours, vmapped (steps/s) | plain loop over N critics | d3rlpy SAC, N critics | ours / plain | ours / d3rlpy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d3 = f"{r['d3rlpy']:.2f}" if r.get("d3rlpy") else "-"
        rd = f"{r['ours/d3rlpy']:.2f}x" if r["ours/d3rlpy"] else "-"
        print(f"| {r['algo']} | {r['critics']} | {r['ours']:.2f} | {r['plain']:.2f} | {d3} | {r['ours/plain']:.2f}x | {rd} |")
    for name in sorted({r["algo"] for r in rows}):
        by_n = {r["critics"]: r for r in rows if r["algo"] == name}
        if len(by_n) > 1:
            lo, hi = min(by_n), max(by_n)
            for who in ("ours", "plain", "d3rlpy"):
                if by_n[lo].get(who) and by_n[hi].get(who):
                    print(f"\n{name}, {who}: a step at N={hi} costs {by_n[lo][who] / by_n[hi][who]:.1f}x one at N={lo} "
                          f"({hi / lo:.0f}x the critics)")
    return rows


def _cql_ceiling(obs_dim: int, act_dim: int, device) -> dict:
    """The least time a CQL step can take here: the conservative term's critic passes alone.

    Per state, both critics score 3 x 10 sampled actions (forward, and backward to the
    weights: about 3x the forward's multiply-adds, minus the first layer's input
    gradient). Timed as plain GEMMs of the same sizes at the machine's own rate.
    """
    import torch

    rows, h1, h2 = BATCH * 30, HIDDEN[0], HIDDEN[1]
    x, w = torch.randn(rows, h1, device=device), torch.randn(h1, h2, device=device)
    for _ in range(3):
        x @ w
    reps = 10
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        x @ w
    if device.type == "cuda":
        torch.cuda.synchronize()
    gflops = 2 * rows * h1 * h2 * reps / (time.perf_counter() - t0) / 1e9
    macs_fwd = rows * ((obs_dim + act_dim) * h1 + h1 * h2 + h2)  # one critic
    flops = 2 * 2 * macs_fwd * 3  # two critics, forward + backward
    floor = flops / (gflops * 1e9)
    return {"gflops": gflops, "gflop_per_step": flops / 1e9, "floor_ms": floor * 1e3, "max_steps_per_s": 1 / floor}


if __name__ == "__main__":
    sys.exit(main())
