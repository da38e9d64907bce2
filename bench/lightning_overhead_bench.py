"""Lightning's overhead: the training shell against a plain PyTorch loop over the same parts.

Both sides train the same ``AlgorithmParts`` on the same batches (the shell's
``ReplayBufferStream``), with the same grouped Adam, per-step reseeding, gradient
clipping and target updates; the shell adds Lightning's loop, hooks, the
non-finite guard, CSV logging every ``--log-every`` steps and (with
``--progress``) the progress bar. The shell runs once per ``--steps-per-call`` value
(gradient steps per ``training_step``; default 1 and the shell's default), so the cost of
Lightning's loop per call and what spreading it over K steps saves are measured in the
same run. Within a trial the sides run in one order, in the next trial in the reverse
order (ABBA), so that drifting machine load favours none; the median steps/s of each side
is reported, and the overhead's spread over the trials (each trial's shell against the
same trial's plain loop). Steps/s are CPU time of this process (``time.process_time``),
which other jobs on a shared machine disturb less than wall time.

    python bench/lightning_overhead_bench.py --algorithms iql td3-bc --steps 600 --trials 3
    python bench/lightning_overhead_bench.py --steps-per-call 1 2 4 8 16   # the sweep that chose the default

Prints a Markdown table for docs/benchmarks.md ("Training shell").
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import warnings

import torch


def _plain_loop(parts, data, *, steps: int, warmup: int, batch_size: int, seed: int) -> float:
    """Steps per second of a hand-written loop doing the shell's work, after ``warmup`` steps."""
    from offline_plugins.algorithms.base import compute_terms, target_update_period
    from offline_plugins.lightning.data import LOSS_STREAM, ReplayBufferStream, step_seed
    from offline_plugins.lightning.module import make_grouped_adam

    stream = ReplayBufferStream(data.replay_buffer(batch_size, seed=seed), seed=seed)
    opt = make_grouped_adam(parts.optimizers)
    groups = parts.optimizers
    target_every = target_update_period(parts.target_update_every, groups)
    keys_all = parts.loss_keys()
    first_bad = None
    started = None
    for step, batch in enumerate(stream):
        if step == warmup:
            started = time.process_time()
        if step == steps:
            break
        torch.default_generator.manual_seed(step_seed(seed, 0, step, LOSS_STREAM))
        active = [g for g in groups if g.due(step)]
        keys = []
        for g in active:
            keys.extend(k for k in g.loss_keys if k not in keys)
        out = compute_terms(parts.loss, batch, keys)
        total = sum(out.get(k) for k in keys)
        opt.zero_grad(set_to_none=True)
        total.backward()
        for g in active:
            if g.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(g.params, g.max_grad_norm, foreach=True)
        opt.step()
        if parts.target_updater is not None and (step + 1) % target_every == 0:
            parts.target_updater.step()
        losses = torch.stack([out.get(k).detach().reshape(()) for k in keys_all if k in keys])
        bad = (~torch.isfinite(losses)).any()
        first_bad = bad if first_bad is None else first_bad | bad
    assert first_bad is not None and not bool(first_bad.any())
    return (steps - warmup) / (time.process_time() - started)


def _lightning(parts, data, *, steps: int, warmup: int, batch_size: int, seed: int, log_every: int, progress: bool,
               steps_per_call: int = 1) -> float:
    """Steps per second of the Lightning shell (no evaluation, no checkpoints), after ``warmup`` steps
    (from the first call that starts at or after it: calls of K steps start at multiples of K)."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.loggers import CSVLogger

    from offline_plugins.lightning.callbacks import NonFiniteGuard, StepProgressBar, TargetNetworkUpdate
    from offline_plugins.lightning.data import ReplayDataModule
    from offline_plugins.lightning.module import AlgorithmModule

    class Clock(Callback):
        started = ended = 0.0
        start_step = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.start_step is None and trainer.global_step >= warmup:
                self.start_step = trainer.global_step
                self.started = time.process_time()

        def on_train_end(self, trainer, pl_module):
            self.ended = time.process_time()

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            logger=CSVLogger(tmp, name="", version=""),
            callbacks=[*([StepProgressBar(refresh_rate=50)] if progress else []), NonFiniteGuard(100), TargetNetworkUpdate(), clock],
            log_every_n_steps=log_every,
            enable_progress_bar=progress,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        module = AlgorithmModule(parts, seed=seed, steps_per_call=steps_per_call)
        trainer.fit(module, datamodule=ReplayDataModule(data, batch_size=batch_size, seed=seed))
    return (steps - clock.start_step) / (clock.ended - clock.started)


def main() -> None:
    from offline_plugins.lightning.module import DEFAULT_STEPS_PER_CALL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["iql", "td3-bc"])
    parser.add_argument("--dataset", default="pendulum/medium-replay-v0")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps-per-call", dest="ks", type=int, nargs="+", default=None, metavar="K",
                        help=f"the shell's gradient steps per training_step to measure (default: 1 {DEFAULT_STEPS_PER_CALL})")
    parser.add_argument("--progress", action="store_true", help="include the progress bar in the shell's cost")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = list(dict.fromkeys(args.ks or [1, DEFAULT_STEPS_PER_CALL]))

    from offline_plugins.lightning.plan import build_parts, plan_run

    rows = []
    for name in args.algorithms:
        plan = plan_run(name, args.dataset, overrides=args.overrides, progress=False)
        plain: list[float] = []
        shell: dict[int, list[float]] = {k: [] for k in ks}
        for trial in range(args.trials):
            kw = dict(steps=args.steps, warmup=args.warmup, batch_size=plan.batch_size, seed=trial)

            def run_plain(kw=kw, trial=trial):
                plain.append(_plain_loop(build_parts(plan, trial), plan.data, **kw))

            def run_shell(k, kw=kw, trial=trial):
                shell[k].append(_lightning(build_parts(plan, trial), plan.data, log_every=args.log_every,
                                           progress=args.progress, steps_per_call=k, **kw))

            sides = [run_plain, *(lambda k=k: run_shell(k) for k in ks)]
            # ABBA order, so that drifting machine load does not favour the side that runs first
            for run in sides if trial % 2 == 0 else sides[::-1]:
                run()
        p = statistics.median(plain)
        cells = []
        for k in ks:
            s = statistics.median(shell[k])
            per_trial = [100.0 * (pt / st - 1.0) for pt, st in zip(plain, shell[k])]
            cells.append((k, s, 100.0 * (p / s - 1.0), min(per_trial), max(per_trial), 1000.0 * (1.0 / s - 1.0 / p)))
        rows.append((name, plan.batch_size, p, cells))
        print(f"{name}: plain {[round(x, 1) for x in plain]} "
              + " ".join(f"K={k} {[round(x, 1) for x in shell[k]]}" for k in ks), flush=True)

    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.steps} steps ({args.warmup} warm-up), median of {args.trials} ABBA trials, CPU-time steps/s, "
          f"dataset {args.dataset}, progress bar {'on' if args.progress else 'off'}"
          f"{', ' + ' '.join(args.overrides) if args.overrides else ''}; overhead = plain/shell - 1 of the medians "
          "[range over the trials], and the time it adds per step\n")
    head = " | ".join(f"shell K={k} (steps/s) | overhead K={k}" for k in ks)
    print(f"| algorithm | batch | plain loop (steps/s) | {head} |")
    print("|---|---|---|" + "---|---|" * len(ks))
    for name, batch, p, cells in rows:
        body = " | ".join(f"{s:.1f} | {over:+.1f}% [{lo:+.1f}, {hi:+.1f}], {ms:+.2f} ms" for _, s, over, lo, hi, ms in cells)
        print(f"| {name} | {batch} | {p:.1f} | {body} |")


if __name__ == "__main__":
    main()
