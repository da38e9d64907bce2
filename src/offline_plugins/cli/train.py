"""The ``train`` and ``eval`` sub-commands; cheap to import (torch and Lightning load inside them).

``train`` builds the run's :class:`~offline_plugins.lightning.run.RunSettings` (which check the
run options, the devices and the output folder) and its plan
(:func:`~offline_plugins.lightning.plan.plan_run`: the algorithm, the dataset, their
compatibility and the config), then calls ``train(plan, settings)``; each check is made
there, once, before the output folder is created, so a bad input writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from offline_plugins.cli.args import add_logger_argument as _add_logger_argument
from offline_plugins.cli.args import devices as _devices
from offline_plugins.cli.args import non_negative as _non_negative
from offline_plugins.cli.args import positive as _positive
from offline_plugins.cli.args import seed as _seed
from offline_plugins.cli.registry import registry_for as _registry
from offline_plugins.config import RUN_DEFAULTS
from offline_plugins.errors import UserError

__all__ = ["add_parsers", "cmd_train", "cmd_eval"]


def _steps_per_call(text):
    """``--steps-per-call`` as a number >= 1 (None: the default); a bad value is a one-line error."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        from offline_plugins.lightning.guards import RunError

        raise RunError(f"--steps-per-call must be a whole number >= 1, got {text!r}; "
                       "omit it for the default, or pass 1 for one gradient step per Lightning call")
    return value


def _run_option(p, key: str, help: str, *, shown=None, **kwargs) -> None:
    """``--KEY``, a run option a resumed run keeps unless it is given again; its help names a new
    run's default from :data:`offline_plugins.config.RUN_DEFAULTS` (``shown`` where the run picks it)."""
    default = RUN_DEFAULTS[key] if shown is None else shown
    p.add_argument("--" + key.replace("_", "-"), default=None, help=f"{help} (default {default}, or the resumed run's)",
                   **kwargs)


def add_parsers(subparsers) -> None:
    """Add ``train`` and ``eval`` to the ``offline-plugins`` sub-command parsers."""
    p = subparsers.add_parser(
        "train",
        help="train an algorithm on a dataset, evaluate it, save checkpoints and a summary",
        description=(
            "Train ALGO on the Minari dataset ID (a built-in recipe is made on the fly if missing), "
            "evaluating the deterministic policy in the dataset's environment. Preference algorithms (dpo, "
            "ipo, kto, orpo, simpo, reward-model...) take a preference dataset (arithmetic/preference-v0, "
            "a .jsonl file or hf:NAME) and --model, and are scored on held-out pairs and prompts. Writes "
            "summary.json, metrics.csv, learning_curve.png and checkpoints/last.ckpt to --out."
        ),
    )
    p.add_argument("algorithm", metavar="ALGO", help="algorithm name, as shown by 'offline-plugins list'")
    p.add_argument("--dataset", required=True, metavar="ID", help="dataset id, e.g. pendulum/medium-replay-v0")
    p.add_argument(
        "--model", default=None, metavar="tiny|small|PATH",
        help="language-model algorithms: the model the reference is made from: 'tiny' (built in, the default: a "
        "character tokenizer and a 0.4 M GPT-2), 'small' or 'small-pad-eos' (built in: a BPE tokenizer with a "
        "chat template and a 1.7 M Qwen2; the second pads with eos), a save_pretrained directory or a hub id",
    )
    p.add_argument(
        "--reward", default=None, action="append", metavar="MODULE:FUNCTION",
        help="algorithms trained on their own rollouts: a reward function (prompts, responses, **row) -> floats, "
        "instead of the dataset's verifier (also a reward-model folder or a reward server's http://HOST:PORT). "
        "Several rewards: --reward NAME=SPEC once each (SPEC 'task': the dataset's verifier), weighed by --set "
        "reward_weights=1,0.5 (gdpo standardises each on its own)",
    )
    p.add_argument(
        "--generator", default=None, metavar="hf|vllm",
        help="online algorithms: what samples the rollouts: hf (the policy's transformers generate, the default) "
        "or vllm (an in-process vLLM engine following the policy's weights; pip install 'offline-plugins[vllm]', "
        "on a CPU machine scripts/make_vllm_env.sh); the same as --set generator=NAME",
    )
    p.add_argument(
        "--judge", default=None, metavar="NAME|DIR|MODULE:FUNCTION",
        help="online-dpo, iterative-dpo: an AI judge picks each prompt's pair instead of the reward, asked in both "
        "display orders (a registered judge, 'offline-plugins list'; a save_pretrained folder for a rubric judge; "
        "or f(prompt, first, second) -> P(first better)); the same as --set judge=...",
    )
    _run_option(p, "steps", "gradient steps", type=_positive)
    _run_option(p, "seed", "seed of initialisation, batches and evaluation (0 to 2**32 - 1)", type=int)
    _run_option(p, "eval_every", "evaluate every K steps (0: only at the end)", shown="steps/5", type=_non_negative,
                metavar="K")
    _run_option(p, "eval_episodes", "episodes per evaluation", type=_positive, metavar="E")
    _run_option(p, "online_steps", "offline-to-online fine-tuning: after --steps on the dataset, N more steps "
                "while acting in its environment, on batches mixing the two (iql, awac, cal-ql, rebrac; "
                "--set online_ratio=...)", type=_non_negative, metavar="N")
    p.add_argument(
        "--devices", type=_devices, default=1, metavar="D",
        help="devices to train on; more than one trains with DDP (default 1)",
    )
    p.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (default auto)")
    _run_option(p, "accumulate", "split each step's batch into N micro-batches (gradient accumulation; batch_size "
                "stays per step)", type=_positive, metavar="N")
    _run_option(p, "precision", "Lightning precision: 32-true, bf16-mixed, bf16-true, 64-true; on CUDA also 16-mixed, "
                "16-true", metavar="P")
    p.add_argument(
        "--strategy", default=None, metavar="NAME",
        help="Lightning strategy: ddp (the default with several devices), ddp_spawn, fsdp (FSDP2 through "
        "ModelParallelStrategy: shards a language model layer by layer, on GPUs or CPU ranks) or, on GPUs, deepspeed",
    )
    p.add_argument("--num-nodes", type=_positive, default=1, help="nodes for multi-node DDP or FSDP (default 1)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of config overrides")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config field (repeatable; see 'offline-plugins info ALGO')",
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/ALGO-DATASET-sSEED)")
    p.add_argument(
        "--resume", nargs="?", const=True, default=None, metavar="CKPT",
        help="continue a run: from DIR/checkpoints/last.ckpt, or from CKPT; it keeps the run's own --steps, "
        "--seed, config and other settings unless given again",
    )
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace the earlier run in --out (its summary, metrics, plot, checkpoints, model; nothing else)",
    )
    p.add_argument("--checkpoint-every", type=_positive, default=None, metavar="N", help="save last.ckpt every N steps")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="also keep checkpoints/step=N.ckpt each time last.ckpt is saved (to compare them later, "
                   "e.g. with 'eval CKPT --ope fqe')")
    _run_option(p, "log_every", "log training metrics every N steps", type=_positive, metavar="N")
    p.add_argument(
        "--threads", type=_positive, default=None, metavar="N",
        help="torch CPU threads per process (default: torch's choice; 1 is fastest for small networks on a busy machine)",
    )
    p.add_argument(
        "--compile", action="store_true",
        help="run the loss through torch.compile (opt-in; the first steps wait for the compilation)",
    )
    p.add_argument(
        "--steps-per-call", default=None, metavar="K",
        help="gradient steps per Lightning training_step: the same run, with Lightning's cost per call "
        "spread over K steps (default: the shell's measured default)",
    )
    p.add_argument(
        "--drop-nonfinite", action="store_true",
        help="drop dataset episodes with NaN/inf observations, actions or rewards (counted in the summary)",
    )
    p.add_argument("--drop-empty", action="store_true", help="drop zero-length dataset episodes (counted)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_logger_argument(p)
    p.add_argument("--verbose", action="store_true", help="also show Lightning's own info lines")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser(
        "eval",
        help="re-evaluate a training checkpoint in its dataset's environment",
        description="Rebuild the policy saved in CKPT and roll it out; prints return and normalised score.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by 'train' (DIR/checkpoints/last.ckpt)")
    p.add_argument("--episodes", type=_positive, default=None, metavar="E", help="episodes (default: as in training)")
    p.add_argument("--seed", type=_seed, default=None, help="first reset seed (default: the run's seed)")
    p.add_argument("--device", default="cpu", help="device for the policy (default cpu)")
    p.add_argument(
        "--ope", default=None, metavar="fqe",
        help="estimate the return from the dataset instead of the environment: fqe (fitted Q evaluation on a "
        "held-out split of the run's dataset; no environment is made)",
    )
    p.add_argument("--ope-steps", type=_positive, default=3000, metavar="N", help="--ope fqe: gradient steps (3000)")
    p.add_argument("--ope-held-out", type=float, default=0.2, metavar="F",
                   help="--ope fqe: fraction of episodes held out of the fit, whose initial states are valued (0.2)")
    p.add_argument("--ope-gamma", type=float, default=0.99, metavar="G", help="--ope fqe: discount (0.99)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_eval)


def cmd_train(args) -> int:
    """``offline-plugins train``: the run's settings (checked as they are made), the plan (the algorithm,
    dataset and config, checked and loaded), then the run; prints the final evaluation."""
    from offline_plugins.lightning.plan import plan_run
    from offline_plugins.lightning.run import RunSettings, check_run_inputs, train

    # what the machine and the file system can refuse is refused here, before a dataset is loaded or made
    settings = RunSettings(
        steps=args.steps,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        precision=args.precision,
        accumulate=args.accumulate,
        steps_per_call=_steps_per_call(args.steps_per_call),
        logger=args.logger,
        online_steps=args.online_steps,
        out_dir=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        keep_checkpoints=args.keep_checkpoints,
        devices=args.devices,
        accelerator=args.accelerator,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        progress=not args.no_progress,
        threads=args.threads,
        compile=args.compile,
        verbose=args.verbose,
    )
    # an input inside what --overwrite removes (or the run replaces) is refused before it is loaded
    if args.reward is not None and len(args.reward) == 1:  # one reward: its spec, as before (several: the list)
        args.reward = args.reward[0]
    check_run_inputs(settings, {"--config": args.config, "--model": args.model, "--reward": args.reward,
                                "--dataset": args.dataset})
    # a bare --resume continues with the run's own config and data options (the checkpoint is read once)
    # --generator is a config field of the online algorithms (kept in checkpoints, so a resume keeps it)
    overrides = list(args.overrides)
    if args.generator is not None:
        _check_generator_option(args)
        overrides.append(f"generator={args.generator}")
    if args.judge is not None:  # a config field as --generator is (online-dpo, iterative-dpo)
        _check_generator_option(args, "judge", "--judge picks the AI judge that labels the pairs of an online "
                                "preference algorithm (online-dpo, iterative-dpo)", "it labels no pairs: its reward "
                                "or its data does; drop --judge")
        overrides.append(f"judge={args.judge}")
    plan = plan_run(args.algorithm, args.dataset, config=args.config, overrides=overrides, model=args.model,
                    reward=args.reward, drop_nonfinite=args.drop_nonfinite, drop_empty=args.drop_empty,
                    registry=_registry(args), progress=settings.progress, resumed=settings.resumed_run())
    summary = train(plan, settings, inputs={"--config": args.config} if args.config else None)
    if not summary:  # a DDP rank other than 0
        return 0
    if summary.get("already_complete"):
        print(f"offline-plugins: the run in {summary.get('out_dir')} already finished its {summary.get('steps')} "
              "steps: nothing was trained and its files are kept as they were; give a larger --steps to train on",
              file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    sys.stderr.flush()
    print(plan.kind.describe(summary))
    return 0


def _check_generator_option(args, field: str = "generator", what: str = "--generator picks what samples the "
                            "rollouts of an online algorithm (grpo, ppo-rlhf, online-dpo, ...)",
                            why: str = "it samples no rollouts, or only with the policy's own generate): drop "
                            "--generator") -> None:
    """``--generator`` names the sampler of an algorithm that samples its own rollouts (its config has a
    ``generator`` field), ``--judge`` the judge of one that labels pairs (a ``judge`` field); elsewhere
    each is refused in one line (an unknown algorithm is the plan's error)."""
    spec = _registry(args).algorithms.get(args.algorithm)
    config = getattr(spec, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return
    if field not in {f.name for f in dataclasses.fields(config)}:
        raise UserError(f"{what}; {args.algorithm!r} has no such choice ({why}")


def cmd_eval(args) -> int:
    """``offline-plugins eval``: roll out a checkpoint's policy."""
    from offline_plugins.lightning.checkpoints import evaluate_checkpoint
    from offline_plugins.lightning.guards import quiet_lightning

    registry = _registry(args)
    if args.ope is not None:
        return _cmd_ope(args, registry)
    with quiet_lightning():
        result = evaluate_checkpoint(
            args.checkpoint, episodes=args.episodes, seed=args.seed, device=args.device, registry=registry
        )
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(registry.data_kind(result["data_kind"]).describe(result))
    return 0


def _cmd_ope(args, registry) -> int:
    """``offline-plugins eval CKPT --ope fqe``: the policy's return estimated from the dataset alone."""
    from offline_plugins.lightning.checkpoints import estimate_checkpoint
    from offline_plugins.lightning.guards import quiet_lightning

    with quiet_lightning():
        r = estimate_checkpoint(args.checkpoint, method=args.ope, device=args.device, registry=registry,
                                seed=args.seed, progress=not args.json, steps=args.ope_steps,
                                held_out=args.ope_held_out, gamma=args.ope_gamma)
    if args.json:
        print(json.dumps(r, indent=2, default=str))
        return 0
    est = r["normalized_score_estimate"]
    score = f"estimated normalised score {est:.1f}, " if est is not None else ""
    ret = f"return {r['return_estimate']:.1f}; " if r["return_estimate"] is not None else ""
    print(f"{r['algorithm']} on {r['dataset']}, step {r['step']}, by FQE ({r['steps']} steps): {score}{ret}"
          f"discounted value {r['value']:.1f} at gamma {r['gamma']} over {r['held_out_episodes']} held-out episodes "
          f"(their data: value {r['data_value']:.1f}, return {r['data_return']:.1f}); no environment was run")
    return 0
