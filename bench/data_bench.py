"""Dataset benchmarks: build throughput, load time, batch-sampling time.

Compares, on the same Pendulum-v1 data and behaviour policy:

* build: our recipe (``minari.create_dataset_from_buffers``) against Minari's
  ``DataCollector`` (needs jax: pass ``--jax-python`` of a venv with ``minari[create]``);
* load: ``load_offline_data`` (whole dataset into a TED TensorDict) against
  ``minari.load_dataset`` + ``iterate_episodes`` into the same numpy arrays;
* sampling: our replay buffer (random and slice) against TorchRL's plain
  ``TensorDictReplayBuffer(LazyTensorStorage, RandomSampler)`` filled with ``extend``,
  and d3rlpy's ``ReplayBuffer.sample_transition_batch`` / ``sample_trajectory_batch``
  (d3rlpy pins its own gymnasium: pass ``--d3rlpy-python`` of a separate venv).

Run: ``python bench/data_bench.py [--steps 20000] [--jax-python PY] [--d3rlpy-python PY]``;
``python bench/data_bench.py --tiers pendulum,cartpole,hopper`` makes every tier in the
current Minari store and prints the table of ``docs/datasets.md``.
It uses a private Minari store in a temporary folder and prints a markdown table
and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH = 256
SLICE = 20
REPEATS = 2000


def _timeit(fn, repeats: int) -> float:
    """Mean seconds per call after 20 warm-up calls."""
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def part_collector(steps: int) -> dict:
    """Build with minari.DataCollector (run in a venv with jax)."""
    import gymnasium as gym
    import minari
    import torch
    from minari import DataCollector

    from offline_plugins.data.behaviour import load_policy_file

    torch.set_num_threads(1)
    policy = load_policy_file("Pendulum-v1").policy("medium")
    g = torch.Generator().manual_seed(0)
    env = DataCollector(gym.make("Pendulum-v1"), record_infos=False)
    t = time.perf_counter()
    done_steps, k = 0, 0
    while done_steps < steps:
        obs, _ = env.reset(seed=k)
        done = False
        while not done:
            a = policy.act(torch.as_tensor(obs), g).numpy()
            obs, r, term, trunc, _ = env.step(a)
            done = term or trunc
            done_steps += 1
        k += 1
    env.create_dataset("bench/collector-v0", algorithm_name="bench", author="bench")
    seconds = time.perf_counter() - t
    return {"collector_build_steps_per_s": done_steps / seconds, "collector_build_seconds": seconds}


def part_d3rlpy(npz: str) -> dict:
    """Sample with d3rlpy's replay buffer from the same arrays (run in d3rlpy's venv)."""
    import numpy as np
    import d3rlpy

    d = np.load(npz)
    dataset = d3rlpy.dataset.MDPDataset(
        observations=d["observations"],
        actions=d["actions"],
        rewards=d["rewards"],
        terminals=d["terminals"],
        timeouts=d["timeouts"],
    )
    t_transition = _timeit(lambda: dataset.sample_transition_batch(BATCH), REPEATS // 4)
    t_traj = _timeit(lambda: dataset.sample_trajectory_batch(BATCH // SLICE, SLICE), REPEATS // 10)
    return {
        "d3rlpy_version": d3rlpy.__version__,
        "d3rlpy_random_ms": 1e3 * t_transition,
        "d3rlpy_trajectory_ms": 1e3 * t_traj,
    }


def main_bench(args) -> dict:
    import numpy as np
    import minari
    import torch
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    from offline_plugins.data import load_offline_data
    from offline_plugins.data.store import make_dataset

    torch.set_num_threads(1)
    results: dict = {"steps": args.steps, "batch_size": BATCH, "slice_len": SLICE, "torch_threads": 1}

    # build
    t = time.perf_counter()
    ds = make_dataset("offline-plugins/pendulum/medium-v0", steps=args.steps, progress=False, force=True)
    seconds = time.perf_counter() - t
    results["ours_build_steps_per_s"] = ds.total_steps / seconds
    results["ours_build_seconds"] = seconds
    make_dataset("offline-plugins/pendulum/medium-v0", steps=args.steps, progress=False, force=True, save_as="bench/arrow-v0", data_format="arrow")

    # load
    for fmt, dataset_id in (("hdf5", "offline-plugins/pendulum/medium-v0"), ("arrow", "bench/arrow-v0")):
        t = time.perf_counter()
        data = load_offline_data(dataset_id, progress=False)
        results[f"ours_load_{fmt}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        md = minari.load_dataset(dataset_id)
        obs, act, rew, term, trunc = [], [], [], [], []
        for ep in md.iterate_episodes():
            obs.append(ep.observations[:-1])
            act.append(ep.actions)
            rew.append(ep.rewards)
            term.append(ep.terminations)
            trunc.append(ep.truncations)
        arrays = {k: np.concatenate(v) for k, v in zip(("o", "a", "r", "t", "u"), (obs, act, rew, term, trunc))}
        results[f"minari_load_{fmt}_s"] = time.perf_counter() - t
    data = load_offline_data("offline-plugins/pendulum/medium-v0", progress=False)

    # sampling: interleaved rounds, median per buffer, so background load hits all alike
    ours = data.replay_buffer(BATCH, seed=0)
    plain = TensorDictReplayBuffer(storage=LazyTensorStorage(len(data)), sampler=RandomSampler(), batch_size=BATCH)
    plain.extend(data.td)
    sl = data.replay_buffer(BATCH // SLICE * SLICE, sampler="slice", slice_len=SLICE, seed=0)
    rounds: dict = {"ours_random_ms": [], "torchrl_plain_random_ms": [], "ours_slice_ms": []}
    for _ in range(5):
        rounds["ours_random_ms"].append(1e3 * _timeit(ours.sample, REPEATS // 5))
        rounds["torchrl_plain_random_ms"].append(1e3 * _timeit(plain.sample, REPEATS // 5))
        rounds["ours_slice_ms"].append(1e3 * _timeit(sl.sample, REPEATS // 20))
    results.update({k: float(np.median(v)) for k, v in rounds.items()})

    if args.jax_python:
        results.update(_subprocess(args.jax_python, ["--part", "collector", "--steps", str(args.steps)]))
    if args.d3rlpy_python:
        npz = os.path.join(os.environ["MINARI_DATASETS_PATH"], "bench.npz")
        np.savez(
            npz,
            observations=arrays["o"],
            actions=arrays["a"],
            rewards=arrays["r"],
            terminals=arrays["t"].astype(np.float32),
            timeouts=arrays["u"].astype(np.float32),
        )
        results.update(_subprocess(args.d3rlpy_python, ["--part", "d3rlpy", "--npz", npz]))
    return results


def _subprocess(python: str, argv: list[str]) -> dict:
    env = os.environ.copy()
    # the other venv sees this one's packages through a .pth file, which skips editable installs
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([python, __file__, *argv], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {f"error_{argv[1]}": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(r: dict) -> str:
    def row(label, ours_key, anchor, anchor_key, fmt, higher_is_better=False):
        ours, other = r.get(ours_key), r.get(anchor_key)
        if ours is None:
            return f"| {label} | not run | {anchor} | not run | |"
        if other is None:
            return f"| {label} | {fmt.format(ours)} | {anchor} | not run | |"
        ratio = ours / other if higher_is_better else other / ours
        return f"| {label} | {fmt.format(ours)} | {anchor} | {fmt.format(other)} | {ratio:.2f}x |"

    steps, batch, windows = r["steps"], BATCH, BATCH // SLICE
    return "\n".join(
        [
            "| measure | offline-plugins | anchor | anchor value | speed-up (ours vs anchor) |",
            "|---|---|---|---|---|",
            row(f"build, env steps/s ({steps} steps)", "ours_build_steps_per_s", "minari `DataCollector`",
                "collector_build_steps_per_s", "{:.0f}", higher_is_better=True),
            row("load hdf5 to memory, s", "ours_load_hdf5_s", "`minari.load_dataset` + `iterate_episodes`", "minari_load_hdf5_s", "{:.2f}"),
            row("load arrow to memory, s", "ours_load_arrow_s", "`minari.load_dataset` + `iterate_episodes`", "minari_load_arrow_s", "{:.2f}"),
            row(f"random batch of {batch}, ms", "ours_random_ms", "TorchRL `LazyTensorStorage` + `RandomSampler`", "torchrl_plain_random_ms", "{:.3f}"),
            row(f"random batch of {batch}, ms", "ours_random_ms", "d3rlpy `sample_transition_batch`", "d3rlpy_random_ms", "{:.3f}"),
            row(f"{windows} windows of {SLICE} steps, ms", "ours_slice_ms", "d3rlpy `sample_trajectory_batch`", "d3rlpy_trajectory_ms", "{:.3f}"),
        ]
    )


def tier_table(envs: list[str], seed: int = 0) -> str:
    """Make every tier of ``envs`` in the current Minari store and tabulate what it holds."""
    import torch

    from offline_plugins.data.store import dataset_info
    from offline_plugins.data.store import make_dataset
    from offline_plugins.plugins import load_registry

    torch.set_num_threads(1)
    registry = load_registry()
    rows = [
        "| dataset | env | steps | episodes | mean return | normalised score | build s |",
        "|---|---|---|---|---|---|---|",
    ]
    wanted: dict = {}  # env -> tiers (None: all); "hopper:medium+medium-replay" picks tiers
    for item in envs:
        env, _, tiers = item.partition(":")
        wanted[env] = tiers.split("+") if tiers else None
    for spec in sorted(registry.datasets.values(), key=lambda s: (s.env_id, s.id)):
        env = spec.id.split("/")[1]
        if env not in wanted or (wanted[env] is not None and spec.tier not in wanted[env]):
            continue
        t = time.perf_counter()
        make_dataset(spec.id, registry, seed=seed, progress=False, force=True)
        seconds = time.perf_counter() - t
        info = dataset_info(spec.id, registry)
        rows.append(
            f"| `{spec.id}` | {spec.env_id} | {info['steps']} | {info['episodes']} | {info['return_mean']:.1f} "
            f"| {info['normalized_score_mean']:.1f} | {seconds:.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--jax-python", help="python of a venv with minari[create] (jax) for the DataCollector anchor")
    parser.add_argument("--d3rlpy-python", help="python of a venv with d3rlpy for its sampler anchor")
    parser.add_argument(
        "--tiers", help="instead: make every tier of these recipe envs (comma separated, e.g. pendulum,hopper) "
        "in the current Minari store and print the docs/datasets.md table; 'hopper:medium+medium-replay' picks tiers"
    )
    parser.add_argument("--part", choices=("collector", "d3rlpy"), help=argparse.SUPPRESS)
    parser.add_argument("--npz", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiers:
        print(tier_table([e.strip() for e in args.tiers.split(",") if e.strip()]))
        return 0
    if args.part == "collector":
        print(json.dumps(part_collector(args.steps)))
        return 0
    if args.part == "d3rlpy":
        print(json.dumps(part_d3rlpy(args.npz)))
        return 0
    with tempfile.TemporaryDirectory() as store:
        os.environ["MINARI_DATASETS_PATH"] = store
        results = main_bench(args)
    print(_table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
