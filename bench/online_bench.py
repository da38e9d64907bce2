"""Rollout and update throughput of our GRPO against bare ``generate`` and TRL's ``GRPOTrainer``.

Same tiny model (``load_causal_lm("tiny")``), same task (2-digit addition prompts),
``G`` responses to each of ``P`` prompts of up to ``max_new_tokens`` tokens, CPU, median
over interleaved rounds, responses/s:

* ``generate``: one batched ``model.generate`` of the ``P*G`` responses (KV cache, sampling),
  nothing else: the floor any online trainer pays for its samples;
* ``collect``: our :class:`~offline_plugins.data.rollouts.RolloutCollector` round: the same
  ``generate``, decoding, the verifier, the sampling and reference log-probs and the GRPO
  advantages, written as TED rows;
* ``round``: ``collect`` plus the round's updates (``GRPOLoss``, backward, Adam) for
  ``ppo_epochs`` passes in minibatches of ``batch_size``: what one round costs in training;
* ``trl``: TRL's ``GRPOTrainer`` with the same model, prompts, G, budget and reward, timed
  from its second to its last step (skipped when ``trl`` is not installed).

    python bench/online_bench.py [--threads 1] [--rounds 3] [--group-size 8] [--prompts 16] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
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


def time_generate(model, tok, source, collector, round_: int) -> float:
    from offline_plugins.tokens import prompt_token_ids

    rows = source.sample(collector.prompts_per_round, round_)
    ids = [prompt_token_ids(tok, r["prompt"]) for r in rows for _ in range(collector.group_size)]
    width = max(len(i) for i in ids)
    left = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for k, i in enumerate(ids):
        left[k, width - len(i):] = torch.tensor(i)
        mask[k, width - len(i):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=left, attention_mask=mask, do_sample=True, top_k=0,
                       max_new_tokens=collector.max_new_tokens, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id)
    return len(ids) / (time.perf_counter() - t0)


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


def bench_trl(model, tok, task, source, collector, steps: int):
    try:
        import trl
        from datasets import Dataset
    except ImportError:
        return None
    from transformers import TrainerCallback

    rows = source.sample(collector.prompts_per_round * (steps + 2), 0)
    data = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    def reward(prompts, completions, **kw):
        return task.rewards(prompts, completions)

    args = trl.GRPOConfig(output_dir="/tmp/online_bench_trl", per_device_train_batch_size=collector.rows,
                          num_generations=collector.group_size, max_completion_length=collector.max_new_tokens,
                          max_steps=steps + 1, logging_steps=1000, report_to=[], save_strategy="no",
                          use_cpu=True, beta=0.04)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                              processing_class=tok, callbacks=[Clock()])
    trainer.train()
    if len(times) < 2:
        return None
    return collector.rows * (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.objectives.llm.online import GRPOLoss

    model, tok, task, source, collector = setup(args.prompts, args.group_size, args.max_new_tokens)
    loss = GRPOLoss(CausalLMLogProbs(model))
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    results: dict[str, list[float]] = {"generate": [], "collect": [], "round": []}
    time_generate(model, tok, source, collector, 999)  # warm-up
    for r in range(args.rounds):
        results["generate"].append(time_generate(model, tok, source, collector, r))
        results["collect"].append(time_collect(model, collector, loss, r))
        results["round"].append(time_round(model, collector, loss, opt, r, args.batch_size, args.ppo_epochs))
    summary = {k: round(statistics.median(v), 1) for k, v in results.items()}
    summary["trl"] = None if args.skip_trl else bench_trl(copy.deepcopy(model), tok, task, source, collector, 3)
    summary["collect_over_generate"] = round(summary["collect"] / summary["generate"], 3)
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"responses/s ({args.prompts} prompts x G={args.group_size}, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)):")
    for key in ("generate", "collect", "round"):
        print(f"  {key:9s} {summary[key]:8.1f}")
    print(f"  trl       {'not installed' if summary['trl'] is None else round(summary['trl'], 1)}")
    print(f"  collect / generate = {summary['collect_over_generate']}")


if __name__ == "__main__":
    main()
