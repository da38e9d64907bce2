"""Flow Q-learning's training speed beside IQL and ReBRAC on OGBench's shapes, eager and compiled.

Gradient steps per second of ``fql``, ``iql`` and ``rebrac`` as the training shell steps them
(``bench/offline_bench.py``'s runner: only the due terms, one fused Adam, the target update on the
slowest group's steps), on the same synthetic data of cube-single's shapes (28-d observation, 5-d
action, 100k transitions) and the networks of FQL's reference code for every one of them (the
``ogbench-cube-single`` preset: 4 x 512, batch 256). The anchor in the same run is TorchRL's own
IQL loop (``IQLLoss`` on the same 4 x 512 networks, one Adam per network; TorchRL 0.14 has no FQL
loss). With ``--compile`` each of ours is also timed through ``torch.compile`` (``train --compile``).
The contenders take turns in ``--rounds`` chunks and the median chunk speed is reported.

Run: ``python bench/flow_bench.py [--steps 200] [--rounds 5] [--compile] [--device cuda]``; prints a
markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_bench  # noqa: E402  (its dataset, runner and TorchRL loop)

OBS_DIM, ACT_DIM = 28, 5  # cube-single's observation and action
PRESET = "ogbench-cube-single"


def _data(device):
    import torch

    data, td = offline_bench._dataset(OBS_DIM, ACT_DIM, device)
    # ReBRAC's critic penalty reads the data's next action (a column the loader adds from the episodes)
    td.set(("next", "action"), torch.rand(td.shape[0], ACT_DIM, generator=torch.Generator().manual_seed(1))
           .to(device) * 2 - 1)
    return data, td


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed gradient steps per contender")
    parser.add_argument("--rounds", type=int, default=5, help="turns the timed steps are split into")
    parser.add_argument("--algos", default="fql,iql,rebrac")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="also time ours through torch.compile")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from offline_plugins.presets import preset

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    data, td = _data(device)
    sample = offline_bench._sampler(td, device)
    offline_bench.HIDDEN = (512, 512, 512, 512)  # TorchRL's loop at the same widths
    runners = {}
    with torch.device(device):
        runners["torchrl iql"] = offline_bench._Runner(*offline_bench._reference("iql", data), sample)
        for name in args.algos.split(","):
            settings = {k: tuple(v) if isinstance(v, list) else v for k, v in preset(PRESET, name).items()
                        if k != "normalize_observations"}
            runners[name] = offline_bench._Runner(*offline_bench._ours(name, data, False, **settings), sample)
            if args.compile:
                runners[f"{name} compiled"] = offline_bench._Runner(
                    *offline_bench._ours(name, data, True, **settings), sample)
    speeds = {k: [] for k in runners}
    chunk = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for key, runner in runners.items():
            speeds[key].append(runner.run(chunk))
    med = {k: statistics.median(v) for k, v in speeds.items()}
    anchor = med["torchrl iql"]
    print(f"| contender ({device}, {args.threads} thread(s), 4 x 512, batch 256) | steps/s | / TorchRL's IQL loop |")
    print("|---|---|---|")
    for key, value in med.items():
        print(f"| {key} | {value:.1f} | {value / anchor:.2f}x |")
    print(json.dumps({"device": str(device), "threads": args.threads, "compile": args.compile, "steps": args.steps,
                      "median_steps_per_s": med, "chunks": speeds}))


if __name__ == "__main__":
    main()
