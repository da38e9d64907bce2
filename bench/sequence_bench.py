"""Sequence models: Decision Transformer training throughput against TorchRL's own DT loop,
and planning latency per action of the Trajectory Transformer and Diffuser planners.

DT: both loops train the reference size (embedding 128, 3 layers, 1 head, inner
width 512, context 20, 64 windows per batch) on the same trajectories, one gradient
step per batch including sampling, with the same optimiser settings:

- ours: windows drawn by ``OfflineData.replay_buffer(sampler="slice")`` (TorchRL's
  ``SliceSampler`` over the shared flat storage), our GPT
  (``DecisionTransformerNet``), TorchRL's ``DTLoss`` (``DecisionTransformerLoss``);
- TorchRL's: ``sota-implementations/decision_transformer`` rebuilt on the same data:
  trajectories split into a padded ``[episodes, max_len]`` storage, ``RandomSampler``
  of 64 trajectories, ``RandomCropTensorDict(20)``, ``RewardScaling`` of the
  return-to-go, ``RenameTransform`` to ``*_cat`` and ``ObservationNorm`` at sampling
  time, ``DTActor`` (transformers' ``GPT2Model``) under a ``TanhDelta``
  ``ProbabilisticActor``, and ``DTLoss``.

Rounds alternate between the two so that load from other processes falls on both;
the median tokens/s (3 tokens per step: return, state, action) of the rounds is
reported. Planning: default configs of ``tt`` and ``diffuser`` (untrained networks:
latency does not depend on the weights), one call per environment step for
``--envs`` environments at once.

    python bench/sequence_bench.py [--rounds 3] [--steps 10] [--json] [--only dt|plan] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings


def synthetic_data(obs_dim: int, act_dim: int, episodes: int, length: int, seed: int = 0):
    """Hopper-sized trajectories (smooth random walks, bounded actions) as an ``OfflineData``."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import Bounded, Unbounded

    from offline_plugins.data.offline import DataStatistics, OfflineData

    g = torch.Generator().manual_seed(seed)
    N = episodes * length
    obs = torch.cumsum(0.1 * torch.randn(episodes, length + 1, obs_dim, generator=g), 1)
    act = torch.tanh(obs[:, :-1] @ torch.randn(obs_dim, act_dim, generator=g))
    rew = 1.0 + 0.1 * torch.randn(episodes, length, 1, generator=g)
    rtg = rew.flip(1).cumsum(1).flip(1)
    done = torch.zeros(episodes, length, 1, dtype=torch.bool)
    done[:, -1] = True
    td = TensorDict(
        {
            "observation": obs[:, :-1].reshape(N, obs_dim),
            "action": act.reshape(N, act_dim),
            "episode": torch.arange(episodes).repeat_interleave(length),
            "return_to_go": rtg.reshape(N, 1),
            "next": {
                "observation": obs[:, 1:].reshape(N, obs_dim),
                "reward": rew.reshape(N, 1),
                "done": done.reshape(N, 1),
                "terminated": torch.zeros(N, 1, dtype=torch.bool),
                "truncated": done.reshape(N, 1),
            },
        },
        [N],
    )
    return OfflineData(
        td=td,
        observation_spec=Unbounded((obs_dim,)),
        action_spec=Bounded(-torch.ones(act_dim), torch.ones(act_dim), (act_dim,)),
        action_space="continuous",
        dataset_id="bench/synthetic-v0",
        env_id=None,
        stats=DataStatistics(torch.zeros(obs_dim), torch.ones(obs_dim)),
        episode_returns=rew.sum((1, 2)).double(),
        episode_lengths=torch.full((episodes,), length),
    )


def ours_dt(data, windows: int, context: int, device="cpu"):
    """Our DT step: slice-sampled windows, our GPT, TorchRL's DTLoss, Adam + warm-up + clipping."""
    import torch

    from offline_plugins.algorithms.sequence.dt import DTConfig, build

    cfg = dataclasses.replace(DTConfig(), context_len=context, batch_size=windows * context, target_return=float(data.episode_returns.max()))
    parts = build(cfg, data)
    parts.loss.to(device)
    group = parts.optimizers[0]
    opt = group.make_optimizer()
    sched = parts.lr_schedulers[0](opt)
    buffer = data.replay_buffer(windows * context, sampler="slice", slice_len=context, seed=0, device=device)
    params = [p for p in group.params if p.requires_grad]
    loss_module = parts.loss

    def step():
        out = loss_module(buffer.sample())
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, group.max_grad_norm)
        opt.step()
        sched.step()

    return step, sum(p.numel() for p in params)


def torchrl_dt(data, windows: int, context: int, device="cpu"):
    """TorchRL's sota DT step on the same data (see the module docstring)."""
    import torch
    from tensordict.nn import TensorDictModule
    from torchrl.collectors.utils import split_trajectories
    from torchrl.data import RandomSampler, TensorDictReplayBuffer, TensorStorage
    from torchrl.envs import Compose, ExcludeTransform, ObservationNorm, RandomCropTensorDict, RenameTransform, RewardScaling
    from torchrl.modules import DTActor, ProbabilisticActor, TanhDelta
    from torchrl.modules.models.decision_transformer import DecisionTransformer
    from torchrl.objectives import DTLoss

    td = data.td.exclude("next").clone()
    split = split_trajectories(td, trajectory_key="episode").to(device)  # [episodes, max_len], with a "mask"
    loc, std = td["observation"].mean(0).to(device), td["observation"].std(0).to(device)
    transforms = Compose(
        RandomCropTensorDict(sub_seq_len=context, sample_dim=-1, mask_key=("collector", "mask")),
        RewardScaling(loc=0, scale=0.001, in_keys=["return_to_go"], standard_normal=False),
        RenameTransform(in_keys=["action", "observation", "return_to_go"], out_keys=["action_cat", "observation_cat", "return_to_go_cat"]),
        ExcludeTransform("episode", "collector"),
        ObservationNorm(loc=loc, scale=std, in_keys=["observation_cat"], standard_normal=True),
    )
    buffer = TensorDictReplayBuffer(storage=TensorStorage(split), sampler=RandomSampler(), batch_size=windows, transform=transforms)
    S, A = data.td["observation"].shape[-1], data.td["action"].shape[-1]
    config = DecisionTransformer.DTConfig(n_embd=128, n_layer=3, n_head=1, n_inner=512, activation="relu", n_positions=1024, resid_pdrop=0.1, attn_pdrop=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = DTActor(state_dim=S, action_dim=A, transformer_config=config)
    module = TensorDictModule(net, in_keys=["observation_cat", "action_cat", "return_to_go_cat"], out_keys=["param"])
    spec = data.action_spec
    actor = ProbabilisticActor(
        spec=spec, in_keys=["param"], out_keys=["action"], module=module, distribution_class=TanhDelta,
        distribution_kwargs={"low": spec.space.low, "high": spec.space.high}, return_log_prob=False,
    )
    loss_module = DTLoss(actor, loss_function="l2").to(device)
    loss_module.set_keys(action_target="action_cat")
    params = list(loss_module.actor_network_params.flatten_keys().values())
    opt = torch.optim.Adam(params, lr=1e-4, weight_decay=1e-4, eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 10_000, 1))

    def step():
        out = loss_module(buffer.sample())
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        opt.step()
        sched.step()

    return step, sum(p.numel() for p in net.parameters())


def bench_dt(args) -> dict:
    import torch

    data = synthetic_data(args.obs_dim, args.act_dim, args.episodes, args.length)
    loops = {"ours": ours_dt(data, args.windows, args.context, args.device),
             "torchrl": torchrl_dt(data, args.windows, args.context, args.device)}
    sync = torch.cuda.synchronize if str(args.device).startswith("cuda") else (lambda: None)
    for step, _ in loops.values():
        for _ in range(args.warmup):
            step()
    rates: dict[str, list[float]] = {k: [] for k in loops}
    tokens = 3 * args.windows * args.context
    for _ in range(args.rounds):
        for name, (step, _) in loops.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            rates[name].append(tokens * args.steps / (time.perf_counter() - t0))
    ours, theirs = statistics.median(rates["ours"]), statistics.median(rates["torchrl"])
    return {
        "dt_tokens_per_s_ours": ours,
        "dt_tokens_per_s_torchrl": theirs,
        "dt_speedup": ours / theirs,
        "dt_params_ours": loops["ours"][1],
        "dt_params_torchrl": loops["torchrl"][1],
        "dt_rounds": rates,
    }


def bench_planning(args) -> dict:
    import torch
    from tensordict import TensorDict

    from offline_plugins.algorithms.sequence.diffuser import DiffuserConfig
    from offline_plugins.algorithms.sequence.diffuser import build as build_diffuser
    from offline_plugins.algorithms.sequence.tt import TTConfig
    from offline_plugins.algorithms.sequence.tt import build as build_tt

    data = synthetic_data(args.obs_dim, args.act_dim, args.episodes, args.length)
    out = {}
    for name, parts in (("tt", build_tt(TTConfig(), data)), ("diffuser", build_diffuser(DiffuserConfig(), data))):
        planner = parts.policy.to(args.device)
        planner.eval()
        obs = data.td["observation"][: args.envs].to(args.device)
        with torch.no_grad():
            planner(TensorDict({"observation": obs}, [args.envs]))  # warm-up
            planner.planning_seconds, planner.planning_calls, planner.planned_actions = 0.0, 0, 0
            for _ in range(args.plan_steps):
                planner(TensorDict({"observation": obs, "reward": torch.zeros(args.envs, 1, device=obs.device)}, [args.envs]))
        stats = planner.planning_stats()
        out[f"{name}_plan_ms_per_step"] = stats["plan_ms_per_step"]
        out[f"{name}_plan_ms_per_action"] = stats["plan_ms_per_action"]
    out["plan_envs"] = args.envs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["dt", "plan"], default=None)
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per loop")
    p.add_argument("--steps", type=int, default=10, help="gradient steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loop first")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=20)
    p.add_argument("--obs-dim", type=int, default=11, help="Hopper's")
    p.add_argument("--act-dim", type=int, default=3, help="Hopper's")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--length", type=int, default=1000)
    p.add_argument("--envs", type=int, default=1, help="environments planned for at once")
    p.add_argument("--plan-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where both DT loops and the planners run (cpu, cuda)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict = {"threads": args.threads, "device": args.device}
    if args.only in (None, "dt"):
        result.update(bench_dt(args))
    if args.only in (None, "plan"):
        result.update(bench_planning(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "dt_speedup" in result:
        print(f"DT tokens/s  ours {result['dt_tokens_per_s_ours']:.0f}  TorchRL {result['dt_tokens_per_s_torchrl']:.0f}  "
              f"ratio {result['dt_speedup']:.2f}x  (params {result['dt_params_ours']} vs {result['dt_params_torchrl']})")
    for name in ("tt", "diffuser"):
        if f"{name}_plan_ms_per_action" in result:
            print(f"{name} planning: {result[f'{name}_plan_ms_per_step']:.1f} ms per step for {args.envs} env(s), "
                  f"{result[f'{name}_plan_ms_per_action']:.1f} ms per action")


if __name__ == "__main__":
    main()
