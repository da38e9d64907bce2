"""Algorithm Distillation beside its source learner and expert distillation, on held-out tasks, several seeds.

    python scripts/ad_results.py run --root runs/results-ad --steps 2000 --seeds 0 1 2
    python scripts/ad_results.py table --root runs/results-ad
    python scripts/ad_results.py plot --root runs/results-ad --out docs/img/results_ad.png

``run`` makes the learning-history recipes (seed 0: UCB1 on 200 training bandits, tabular
Q-learning in 60 training dark rooms), and from them expert-episode datasets
(``RUNS``): the last in-context episodes of every history (the learner at its best), and
for bandits also the last pulls of the arm each history pulled most (the learner's
answer), each history's kept steps a Minari episode of its own. It trains ``ad`` on each
through the CLI (one thread, one run at a time, registered defaults unless stated in
``RUNS``) into ``ROOT/FAMILY/RUN/sSEED``, then rolls each policy out on held-out tasks
(reset seeds 1000...) for a whole history with its context carried over and no weight
update, into ``curve.json``. The source learner and uniform random actions are rolled out
on the same held-out tasks (``ROOT/FAMILY/baselines.json``). The expert run is Laskin et
al.'s "expert distillation" baseline: the same transformer trained on expert episodes
only, which stands in for a Decision Transformer on those episodes (ours takes continuous
actions only, and on expert-only data its return token carries nothing). ``table`` prints the tables of docs/results-history.md; ``plot`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

#: family -> histories recipe, held-out tasks, episode length
FAMILIES = {
    "bandit": ("offline-plugins/bandit/histories-v0", 200, 1),
    "darkroom": ("offline-plugins/darkroom/histories-v0", 20, 20),
}
#: family -> run -> (dataset name, --set overrides, which steps of a history it keeps: None for all; else
#: ("last", episodes) or ("best-arm", pulls)); registered defaults otherwise
RUNS = {
    "bandit": {
        "ad": ("histories-v0", [], None),
        "expert": ("expert-v0", ["context_len=50"], ("last", 50)),
        "best-arm": ("best-arm-v0", ["context_len=20"], ("best-arm", 20)),
    },
    "darkroom": {"ad": ("histories-v0", [], None), "expert": ("expert-v0", [], ("last", 5))},
}
HELD_OUT_SEED = 1000
COLORS = {"ad": "C0", "expert": "C1", "best-arm": "C2", "source": "C3", "random": "C7"}


def _kept(ep, cut, episode_len: int):
    """Indices of the steps of history ``ep`` that ``cut`` keeps, in order."""
    import numpy as np

    how, n = cut
    if how == "last":
        return np.arange(len(ep.actions) - n * episode_len, len(ep.actions))
    # the learner's final answer: the arm it pulled most (at least 20 of 100 pulls of 5 arms)
    best = np.bincount(ep.actions).argmax()
    return np.flatnonzero(ep.actions == best)[-n:]


def expert_dataset(family: str, run: str) -> str:
    """Write ``offline-plugins/FAMILY/NAME``: the kept steps of every history, one episode each (once)."""
    import minari
    import numpy as np
    from minari.data_collector import EpisodeBuffer

    from offline_plugins.data.histories import HISTORY_RECIPES, reference_returns
    from offline_plugins.data.store import is_local, make_dataset
    from offline_plugins.envs.icl import env_spec

    recipe, _, episode_len = FAMILIES[family]
    name, _, cut = RUNS[family][run]
    out = f"offline-plugins/{family}/{name}"
    source = make_dataset(recipe, seed=0, progress=False) if not is_local(recipe) else minari.load_dataset(recipe)
    if cut is None or is_local(out):
        return out
    buffers = []
    for ep in source.iterate_episodes():
        i = _kept(ep, cut, episode_len)
        buffers.append(EpisodeBuffer(id=ep.id, observations=np.concatenate([ep.observations[i], ep.observations[i[-1:] + 1]]),
                                     actions=ep.actions[i], rewards=ep.rewards[i], terminations=ep.terminations[i],
                                     truncations=np.arange(len(i)) == len(i) - 1))
    options = dict(HISTORY_RECIPES[family])
    kwargs = dict(options["env_kwargs"])
    low, high = reference_returns(env_spec(options["env"], **kwargs, split="test"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*author_email.*")  # Minari asks for an e-mail; there is none
        minari.create_dataset_from_buffers(
            dataset_id=out, buffer=buffers, env=env_spec(options["env"], **kwargs, split="train"),
            eval_env=env_spec(options["env"], **kwargs, split="test"), algorithm_name=f"{cut} of {recipe}",
            author="offline-plugins", code_permalink="scripts/ad_results.py", ref_min_score=low, ref_max_score=high,
            description=f"The steps {cut} of every learning history of {recipe} (expert distillation).",
        )
    return out


def baselines(family: str) -> dict:
    """Per-episode mean returns of the source learner and of random actions on the held-out tasks."""
    import gymnasium as gym
    import numpy as np

    from offline_plugins.data.histories import HISTORY_RECIPES, _learner
    from offline_plugins.envs.icl import UniformActions, env_spec, learning_history

    options = dict(HISTORY_RECIPES[family])
    env = gym.make(env_spec(options["env"], **dict(options["env_kwargs"]), split="test"))
    tasks = FAMILIES[family][1]
    rng = np.random.default_rng(0)
    curves = {"source": [], "random": []}
    for k in range(tasks):
        for name, learner in (("source", _learner(options["learner"], env)), ("random", UniformActions(env.action_space.n))):
            curves[name].append(learning_history(env, learner, rng, seed=HELD_OUT_SEED + k)["episode_returns"])
    return {name: np.mean(c, 0).tolist() for name, c in curves.items()}


def in_context_curve(out: Path, tasks: int) -> list:
    import numpy as np
    import torch

    from offline_plugins.algorithms.sequence.ad import in_context_returns
    from offline_plugins.lightning.checkpoints import load_trained_run

    torch.set_num_threads(1)
    run = load_trained_run(out / "checkpoints" / "last.ckpt")
    returns = in_context_returns(run.module.policy, run.plan.data.make_env, tasks=tasks, seed=HELD_OUT_SEED)
    return np.mean(returns, 0).tolist()


def cmd_run(args) -> None:
    for family in args.families:
        base = args.root / family / "baselines.json"
        if not base.exists():
            base.parent.mkdir(parents=True, exist_ok=True)
            base.write_text(json.dumps(baselines(family)))
        for seed in args.seeds:
            for name, (_, overrides, _) in RUNS[family].items():
                out = args.root / family / name / f"s{seed}"
                if not (out / "curve.json").exists() or args.overwrite:
                    cmd = ["offline-plugins", "train", "ad", "--dataset", expert_dataset(family, name),
                           "--steps", str(args.steps), "--seed", str(seed), "--eval-every", "0", "--eval-episodes", "5",
                           "--threads", "1", "--no-progress", "--out", str(out), "--overwrite",
                           *(x for o in overrides for x in ("--set", o))]
                    start = time.perf_counter()
                    subprocess.run(cmd, check=True)
                    curve = in_context_curve(out, FAMILIES[family][1])
                    (out / "curve.json").write_text(json.dumps({"curve": curve, "wall_s": time.perf_counter() - start}))
                    print(f"{family} {name} s{seed}: {time.perf_counter() - start:.0f} s", flush=True)


def _load(root: Path, family: str) -> dict:
    """run -> list of per-seed curves, plus the baselines (one curve each)."""
    runs = {name: [json.loads(p.read_text())["curve"] for p in sorted((root / family / name).glob("s*/curve.json"))]
            for name in RUNS[family]}
    base = json.loads((root / family / "baselines.json").read_text())
    return {**runs, **{k: [v] for k, v in base.items()}}


def _spans(n: int) -> list:
    # first and last tenth of the in-context episodes, and the whole history
    k = max(1, n // 10)
    return [(f"episodes 1-{k}", 0, k), (f"episodes {n - k + 1}-{n}", n - k, n), ("all", 0, n)]


def _mean_sd(values: list) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def cmd_table(args) -> None:
    names = {"ad": "AD (histories)", "expert": "expert distillation (last episodes of each history)",
             "best-arm": "expert distillation (last 20 pulls of each history's most-pulled arm)",
             "source": "source learner", "random": "random actions"}
    for family in args.families:
        curves = _load(args.root, family)
        n = len(curves["source"][0])
        spans = _spans(n)
        print(f"\n{family}: mean return per in-context episode on {FAMILIES[family][1]} held-out tasks\n")
        print("| run | seeds | " + " | ".join(s[0] for s in spans) + " | gain (last - first) |")
        print("|---|---|" + "---|" * (len(spans) + 1))
        for run, per_seed in curves.items():
            if not per_seed:
                continue
            cells = [_mean_sd([statistics.mean(c[a:b]) for c in per_seed]) for _, a, b in spans]
            gain = _mean_sd([statistics.mean(c[spans[1][1]:spans[1][2]]) - statistics.mean(c[:spans[0][2]])
                             for c in per_seed])
            print(f"| {names[run]} | {len(per_seed)} | " + " | ".join(cells) + f" | {gain} |")


def cmd_plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(args.families), figsize=(6 * len(args.families), 4))
    for ax, family in zip(np.atleast_1d(axes), args.families):
        curves = _load(args.root, family)
        smooth = max(1, len(curves["source"][0]) // 20)
        for run, per_seed in curves.items():
            if not per_seed:
                continue
            c = np.asarray(per_seed)
            c = c[:, : c.shape[1] // smooth * smooth].reshape(c.shape[0], -1, smooth).mean(-1)
            x = (np.arange(c.shape[1]) + 0.5) * smooth
            color = COLORS[run]
            ax.plot(x, c.mean(0), label=run, color=color)
            if c.shape[0] > 1:
                ax.fill_between(x, c.min(0), c.max(0), alpha=0.2, color=color)
        ax.set_title(f"{family}: held-out tasks, no weight update")
        ax.set_xlabel("in-context episode")
        ax.set_ylabel("return (mean over tasks)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["run", "table", "plot"])
    p.add_argument("--root", type=Path, default=Path("runs/results-ad"))
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--out", type=Path, default=Path("docs/img/results_ad.png"))
    args = p.parse_args(argv)
    {"run": cmd_run, "table": cmd_table, "plot": cmd_plot}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
