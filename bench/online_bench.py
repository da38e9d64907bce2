"""Rollout and update throughput of our GRPO against bare ``generate`` and TRL's ``GRPOTrainer``.

Same tiny model (``load_causal_lm("tiny")``), same task (2-digit addition prompts),
``G`` responses to each of ``P`` prompts of up to ``max_new_tokens`` tokens, CPU, median
over interleaved rounds, responses/s:

* ``generate``: one batched ``model.generate`` of the ``P*G`` responses (KV cache, sampling),
  nothing else: the floor any online trainer pays for its samples;
* ``sample``: the collector's generation stage, the same ``generate`` through
  :func:`~offline_plugins.text.backends.generation.generate_left_padded` with its clean sampling config and
  the log-prob recorder (the sampling log-probs come out of this call);
* ``collect``: our :class:`~offline_plugins.text.data.rollouts.RolloutCollector` round: ``sample``,
  decoding, the verifier, the reference's log-probs (one forward) and the GRPO advantages,
  written as TED rows;
* ``round``: ``collect`` plus the round's updates (``TextGRPOLoss``, backward, Adam) for
  ``ppo_epochs`` passes in minibatches of ``batch_size`` (default: the whole round, one step,
  as TRL's default of one optimizer step per generation batch): one GRPO step;
* ``shell``: ``offline-plugins train grpo`` (the Lightning shell: the rollout callback, K steps
  per call, checkpoints, the monitor) on the same saved model and settings, the final
  evaluation's time taken out;
* ``trl``: TRL's ``GRPOTrainer`` with the same model (saved and loaded from a folder, as its
  reference model is), prompts, G, budget, beta and reward, one optimizer step per batch of
  ``P*G`` completions, timed from its second to its last step (skipped when ``trl`` is not
  installed).

* ``ppo_rlhf``: ``offline-plugins train ppo-rlhf`` steps/s (``bench/ppo_rlhf_bench.py``), and
  whether the installed TRL ships a PPO trainer to time against (1.16.0: no);

Responses/s and generated tokens/s are reported; a GRPO step is one round of ``P*G``
responses, so ``round`` and ``trl`` responses/s divided by ``P*G`` are steps/s.

    python bench/online_bench.py [--threads 1] [--rounds 5] [--group-size 8] [--prompts 16] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning
import torch

AUTOCAST = contextlib.nullcontext
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def setup(prompts: int, group_size: int, max_new_tokens: int, model_size: str = "tiny"):
    from offline_plugins.text.data.rollouts import RolloutCollector, task_prompt_source
    from offline_plugins.text.tasks import ArithmeticTask

    # the preference bench's models: tiny, a 12-layer GPT-2, or the Qwen2.5-0.5B shape on small's tokenizer
    sys.path.insert(0, str(Path(__file__).parent))
    from preference_bench import base_model

    model, tok = base_model(model_size)
    model = model.to(DEVICE)
    task = ArithmeticTask()
    source = task_prompt_source(task, n_held_out=8)
    collector = RolloutCollector(source, tok, copy.deepcopy(model).eval(), group_size=group_size,
                                 prompts_per_round=prompts, max_new_tokens=max_new_tokens, seed=0)
    return model, tok, task, source, collector


def _left_padded(tok, source, collector, round_: int):
    from offline_plugins.tokens import prompt_token_ids

    rows = source.sample(collector.prompts_per_round, round_)
    ids = [prompt_token_ids(tok, r["prompt"]) for r in rows for _ in range(collector.group_size)]
    width = max(len(i) for i in ids)
    left = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for k, i in enumerate(ids):
        left[k, width - len(i):] = torch.tensor(i)
        mask[k, width - len(i):] = 1
    return left, mask


def _generated_tokens(out, width: int, eos: int) -> int:
    gen = out[:, width:]
    is_eos = gen == eos
    lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, torch.full_like(gen[:, 0], gen.shape[1]))
    return int(lengths.sum())


def time_generate(model, tok, source, collector, round_: int, *, ours: bool = False) -> tuple[float, float]:
    """Responses/s and generated tokens/s of one batched ``generate``: bare, or (``ours``) the
    collector's generation stage (``generate_left_padded``, clean config, log-prob recorder)."""
    from offline_plugins.text.backends.generation import SampledLogProbs, generate_left_padded, generation_kwargs

    left, mask = _left_padded(tok, source, collector, round_)
    left, mask = left.to(DEVICE), mask.to(DEVICE)
    torch.manual_seed(round_)
    _sync()
    t0 = time.perf_counter()
    with torch.no_grad(), AUTOCAST():
        if ours:
            recorder = SampledLogProbs()
            kwargs = generation_kwargs(max_new_tokens=collector.max_new_tokens, pad_id=collector.pad_id,
                                       eos_id=tok.eos_token_id, temperature=collector.temperature,
                                       top_p=collector.top_p, recorder=recorder)
            out = generate_left_padded(model, left, mask, **kwargs)
            recorder.finish(out[:, left.shape[1]:])
        else:
            out = model.generate(input_ids=left, attention_mask=mask, do_sample=True, top_k=0,
                                 max_new_tokens=collector.max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
    _sync()
    dt = time.perf_counter() - t0
    return len(left) / dt, _generated_tokens(out, left.shape[1], tok.eos_token_id) / dt


def time_collect(model, collector, loss, round_: int) -> float:
    _sync()
    t0 = time.perf_counter()
    with AUTOCAST():
        collector.collect(model, round=round_, process=loss.process_rollouts)
    _sync()
    return collector.rows / (time.perf_counter() - t0)


def time_round(model, collector, loss, opt, round_: int, batch_size: int, ppo_epochs: int) -> float:
    _sync()
    t0 = time.perf_counter()
    with AUTOCAST():
        td, _ = collector.collect(model, round=round_, process=loss.process_rollouts)
    for _ in range(ppo_epochs):
        for idx in torch.randperm(collector.rows).split(batch_size):
            with AUTOCAST():
                out = loss(td[idx])
                total = out["loss_objective"] + out.get("loss_kl", 0.0)
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
    _sync()
    return collector.rows / (time.perf_counter() - t0)


def bench_trl(folder: str, tok, task, source, collector, steps: int, beta: float, precision: str = "fp32"):
    try:
        import trl
        from datasets import Dataset
    except ImportError:
        return None
    from transformers import TrainerCallback

    rows = source.sample(collector.prompts_per_round * (steps + 2), 0)
    data = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    times: list[float] = []
    tokens: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                tokens.append(float(logs["completions/mean_length"]))

    def reward(prompts, completions, **kw):
        return task.rewards(prompts, completions)

    with tempfile.TemporaryDirectory() as run_dir:
        args = trl.GRPOConfig(output_dir=run_dir, per_device_train_batch_size=collector.rows,
                              num_generations=collector.group_size, max_completion_length=collector.max_new_tokens,
                              max_steps=steps + 1, logging_steps=1, report_to=[], save_strategy="no",
                              use_cpu=DEVICE.type == "cpu", beta=beta, temperature=collector.temperature, top_p=collector.top_p,
                              top_k=0, learning_rate=1e-5, disable_tqdm=True, gradient_checkpointing=False,
                              bf16=precision == "bf16")
        trainer = trl.GRPOTrainer(model=folder, reward_funcs=[reward], args=args, train_dataset=data,
                                  processing_class=tok, callbacks=[Clock()])
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs without tqdm
            trainer.train()
    if len(times) < 2:
        return None
    steps_per_s = (len(times) - 1) / (times[-1] - times[0])
    mean_len = statistics.mean(tokens[1:] or tokens) if tokens else None
    return {"responses_per_s": round(collector.rows * steps_per_s, 1), "steps_per_s": round(steps_per_s, 3),
            "tokens_per_s": None if mean_len is None else round(collector.rows * mean_len * steps_per_s, 1),
            "version": trl.__version__}


class _StepClock(lightning.Callback):
    """A Lightning callback that notes the time at the end of every gradient step (``on_gradient_step``:
    it keeps the shell's several steps per call)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_gradient_step(self, trainer, pl_module, losses) -> None:
        self.times.append(time.perf_counter())


def bench_shell(folder: str, collector, steps: int, batch_size: int, beta: float, threads: int,
                precision: str = "fp32") -> dict:
    """``offline-plugins train grpo`` through the Lightning shell, on the same saved model and settings.

    ``steps_per_s`` is the steady rate, as TRL's is timed: from the end of the first step to the end
    of the last (each step of a round of ``batch_size`` rollouts samples that round first), so the
    Trainer's set-up, the reference's held-out score at the start and the final checkpoint, export
    and evaluation are left out; ``fit_steps_per_s`` is the whole fit's, final evaluation taken out."""
    from offline_plugins.lightning.run import train_algorithm

    clock = _StepClock()
    with tempfile.TemporaryDirectory() as out:
        summary = train_algorithm("grpo", "arithmetic", model=folder, steps=steps, seed=0, out_dir=out, progress=False,
                                  threads=threads, eval_every=0, accelerator="gpu" if DEVICE.type == "cuda" else "cpu",
                                  precision="bf16-mixed" if precision == "bf16" else "32-true", callbacks=[clock],
                                  overrides={"group_size": collector.group_size,
                                             "prompts_per_round": collector.prompts_per_round,
                                             "batch_size": batch_size, "max_new_tokens": collector.max_new_tokens,
                                             "eval_prompts": 8, "beta": beta, "lr": 1e-5})
    fit_steps_per_s = summary["steps"] / (summary["train_s"] - summary.get("eval_s", 0.0))
    times = clock.times
    steps_per_s = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else fit_steps_per_s
    return {"responses_per_s": round(steps_per_s * batch_size, 1), "steps_per_s": round(steps_per_s, 3),
            "fit_steps_per_s": round(fit_steps_per_s, 3), "tokens_per_s": summary.get("tokens_per_s"),
            "peak_memory_mb": summary.get("peak_memory_mb")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=None, help="rollouts per update (default: the round)")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--trl-steps", type=int, default=5)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-ppo", action="store_true", help="do not time ppo-rlhf (bench/ppo_rlhf_bench.py)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model-size", choices=("tiny", "100m", "500m"), default="tiny",
                        help="100m: a 12-layer, 768-wide GPT-2 from a config; 500m: the Qwen2.5-0.5B shape (for a GPU)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast here, bf16-mixed in the shell, bf16=True in TRL")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global AUTOCAST, DEVICE
    DEVICE = torch.device(args.device)
    if args.precision == "bf16":
        AUTOCAST = lambda: torch.autocast(DEVICE.type, dtype=torch.bfloat16)  # noqa: E731
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.objectives.llm.online import TextGRPOLoss

    model, tok, task, source, collector = setup(args.prompts, args.group_size, args.max_new_tokens, args.model_size)
    batch_size = args.batch_size or collector.rows
    trl_model = copy.deepcopy(model)
    loss = TextGRPOLoss(CausalLMLogProbs(model), beta=args.beta).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    results: dict[str, list] = {"generate": [], "sample": [], "collect": [], "round": []}
    time_generate(model, tok, source, collector, 999)  # warm-up
    time_generate(model, tok, source, collector, 998, ours=True)
    for r in range(args.rounds):  # interleaved, so drift on a shared machine hits every column alike
        results["generate"].append(time_generate(model, tok, source, collector, r))
        results["sample"].append(time_generate(model, tok, source, collector, r, ours=True))
        results["collect"].append(time_collect(model, collector, loss, r))
        results["round"].append(time_round(model, collector, loss, opt, r, batch_size, args.ppo_epochs))
    summary: dict = {}
    for key, values in results.items():
        if isinstance(values[0], tuple):
            summary[key] = {"responses_per_s": round(statistics.median(v[0] for v in values), 1),
                            "tokens_per_s": round(statistics.median(v[1] for v in values), 1)}
        else:
            summary[key] = {"responses_per_s": round(statistics.median(values), 1)}
    rounds_per_s = summary["round"]["responses_per_s"] / collector.rows
    summary["round"]["steps_per_s"] = round(rounds_per_s * (collector.rows // batch_size) * args.ppo_epochs, 3)
    with tempfile.TemporaryDirectory() as folder:
        # TRL builds its reference model from the policy's path (beta > 0), and the shell's --model
        # reads one: the untrained tiny model, saved. TRL 1.16 reads ``config.auto_map``, which
        # transformers 5 configs have only when it is set
        if not hasattr(trl_model.config, "auto_map"):
            trl_model.config.auto_map = {}
        trl_model.save_pretrained(folder)
        tok.save_pretrained(folder)
        summary["shell"] = bench_shell(folder, collector, args.trl_steps * 4, batch_size, args.beta, args.threads,
                                       args.precision)
        summary["trl"] = None if args.skip_trl else bench_trl(folder, tok, task, source, collector, args.trl_steps,
                                                               args.beta, args.precision)
    if not args.skip_ppo:  # issue 14: PPO-RLHF through the shell, and TRL's PPO trainer where it ships one
        sys.path.insert(0, str(Path(__file__).parent))
        from ppo_rlhf_bench import ppo_rlhf_steps_per_s, trl_ppo_trainer

        summary["ppo_rlhf"] = ppo_rlhf_steps_per_s(24, threads=args.threads)
        summary["trl_ppo"] = trl_ppo_trainer()
    gen = summary["generate"]["responses_per_s"]
    summary["sample_over_generate"] = round(summary["sample"]["responses_per_s"] / gen, 3)
    summary["collect_over_generate"] = round(summary["collect"]["responses_per_s"] / gen, 3)
    if summary["trl"]:
        summary["round_over_trl"] = round(summary["round"]["responses_per_s"] / summary["trl"]["responses_per_s"], 2)
        summary["shell_over_trl"] = round(summary["shell"]["steps_per_s"] / summary["trl"]["steps_per_s"], 2)
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "json"} | {"batch_size": batch_size}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"responses/s ({args.prompts} prompts x G={args.group_size}, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)):")
    for key in ("generate", "sample", "collect", "round", "shell"):
        print(f"  {key:9s} {summary[key]}")
    print(f"  trl       {'not installed' if summary['trl'] is None else summary['trl']}")
    if "ppo_rlhf" in summary:
        print(f"  ppo-rlhf  {summary['ppo_rlhf']['steps_per_s']:.1f} steps/s; TRL's PPO trainer: {summary['trl_ppo']}")
    print(f"  sample / generate = {summary['sample_over_generate']}, collect / generate = "
          f"{summary['collect_over_generate']}, round / trl = {summary.get('round_over_trl')}, shell / trl = "
          f"{summary.get('shell_over_trl')}")


if __name__ == "__main__":
    main()
