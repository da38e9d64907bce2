"""Rollout and update throughput of our GRPO against bare ``generate`` and TRL's ``GRPOTrainer``.

Same tiny model (``load_causal_lm("tiny")``), same task (2-digit addition prompts),
``G`` responses to each of ``P`` prompts of up to ``max_new_tokens`` tokens, CPU, median
over interleaved rounds, responses/s:

* ``generate``: one batched ``model.generate`` of the ``P*G`` responses (KV cache, sampling),
  nothing else: the floor any online trainer pays for its samples;
* ``sample``: the collector's generation stage, the same ``generate`` through
  :func:`~offline_plugins.data.rollouts.generate_left_padded` with its clean sampling config and
  the log-prob recorder (the sampling log-probs come out of this call);
* ``collect``: our :class:`~offline_plugins.data.rollouts.RolloutCollector` round: ``sample``,
  decoding, the verifier, the reference's log-probs (one forward) and the GRPO advantages,
  written as TED rows;
* ``round``: ``collect`` plus the round's updates (``GRPOLoss``, backward, Adam) for
  ``ppo_epochs`` passes in minibatches of ``batch_size`` (default: the whole round, one step,
  as TRL's default of one optimizer step per generation batch): one GRPO step;
* ``trl``: TRL's ``GRPOTrainer`` with the same model (saved and loaded from a folder, as its
  reference model is), prompts, G, budget, beta and reward, one optimizer step per batch of
  ``P*G`` completions, timed from its second to its last step (skipped when ``trl`` is not
  installed).

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
import time

import torch


def setup(prompts: int, group_size: int, max_new_tokens: int):
    from offline_plugins.data.rollouts import RolloutCollector, task_prompt_source
    from offline_plugins.envs.tasks import ArithmeticTask
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm("tiny", seed=0)
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


def time_generate(model, tok, source, collector, round_: int) -> tuple[float, float]:
    left, mask = _left_padded(tok, source, collector, round_)
    torch.manual_seed(round_)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=left, attention_mask=mask, do_sample=True, top_k=0,
                             max_new_tokens=collector.max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t0
    return len(left) / dt, _generated_tokens(out, left.shape[1], tok.eos_token_id) / dt


def time_sample(model, tok, source, collector, round_: int) -> tuple[float, float]:
    from offline_plugins.data.rollouts import _SampledLogProbs, generate_left_padded

    left, mask = _left_padded(tok, source, collector, round_)
    torch.manual_seed(round_)
    t0 = time.perf_counter()
    with torch.no_grad():
        recorder = _SampledLogProbs()
        out = generate_left_padded(model, left, mask, **collector._sampling_kwargs(recorder))
        recorder.finish(out[:, left.shape[1]:])
    dt = time.perf_counter() - t0
    return len(left) / dt, _generated_tokens(out, left.shape[1], tok.eos_token_id) / dt


def time_collect(model, collector, loss, round_: int) -> float:
    t0 = time.perf_counter()
    collector.collect(model, round=round_, process=loss.process_rollouts)
    return collector.rows / (time.perf_counter() - t0)


def time_round(model, collector, loss, opt, round_: int, batch_size: int, ppo_epochs: int) -> float:
    t0 = time.perf_counter()
    td, _ = collector.collect(model, round=round_, process=loss.process_rollouts)
    for _ in range(ppo_epochs):
        for idx in torch.randperm(collector.rows).split(batch_size):
            out = loss(td[idx])
            total = out["loss_objective"] + out.get("loss_kl", 0.0)
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
    return collector.rows / (time.perf_counter() - t0)


def bench_trl(model, tok, task, source, collector, steps: int, beta: float):
    try:
        import trl
        from datasets import Dataset
    except ImportError:
        return None
    import tempfile

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

    with tempfile.TemporaryDirectory() as folder:
        # TRL builds its reference model from the policy's path (beta > 0): give it one. TRL 1.16
        # reads ``config.auto_map``, which transformers 5 configs have only when set
        if not hasattr(model.config, "auto_map"):
            model.config.auto_map = {}
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        args = trl.GRPOConfig(output_dir=f"{folder}/out", per_device_train_batch_size=collector.rows,
                              num_generations=collector.group_size, max_completion_length=collector.max_new_tokens,
                              max_steps=steps + 1, logging_steps=1, report_to=[], save_strategy="no",
                              use_cpu=True, beta=beta, temperature=collector.temperature, top_p=collector.top_p,
                              top_k=0, learning_rate=1e-5, disable_tqdm=True, gradient_checkpointing=False,
                              bf16=False)
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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.objectives.llm.online import GRPOLoss

    model, tok, task, source, collector = setup(args.prompts, args.group_size, args.max_new_tokens)
    batch_size = args.batch_size or collector.rows
    trl_model = copy.deepcopy(model)
    loss = GRPOLoss(CausalLMLogProbs(model), beta=args.beta)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    results: dict[str, list] = {"generate": [], "sample": [], "collect": [], "round": []}
    time_generate(model, tok, source, collector, 999)  # warm-up
    time_sample(model, tok, source, collector, 998)
    for r in range(args.rounds):  # interleaved, so drift on a shared machine hits every column alike
        results["generate"].append(time_generate(model, tok, source, collector, r))
        results["sample"].append(time_sample(model, tok, source, collector, r))
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
    summary["trl"] = None if args.skip_trl else bench_trl(trl_model, tok, task, source, collector, args.trl_steps,
                                                           args.beta)
    gen = summary["generate"]["responses_per_s"]
    summary["sample_over_generate"] = round(summary["sample"]["responses_per_s"] / gen, 3)
    summary["collect_over_generate"] = round(summary["collect"]["responses_per_s"] / gen, 3)
    if summary["trl"]:
        summary["round_over_trl"] = round(summary["round"]["responses_per_s"] / summary["trl"]["responses_per_s"], 2)
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "json"} | {"batch_size": batch_size}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"responses/s ({args.prompts} prompts x G={args.group_size}, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)):")
    for key in ("generate", "sample", "collect", "round"):
        print(f"  {key:9s} {summary[key]}")
    print(f"  trl       {'not installed' if summary['trl'] is None else summary['trl']}")
    print(f"  sample / generate = {summary['sample_over_generate']}, collect / generate = "
          f"{summary['collect_over_generate']}, round / trl = {summary.get('round_over_trl')}")


if __name__ == "__main__":
    main()
