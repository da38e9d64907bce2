"""Run by tests/test_fsdp.py: a 2-process CPU run of DPO or GRPO under ``--strategy fsdp`` or ``ddp``.

    python _llm_fsdp_run.py ALGORITHM DATA OUT STEPS STRATEGY [--resume] [--precision P] [--model NAME]

Lightning's launcher re-runs this script once per extra rank. When training ends, every rank
takes part in gathering the full parameters of the loss module and rank 0 writes them to
``OUT/final.pt`` (with the world size and whether the model was sharded).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.pytorch import Callback

from offline_plugins.lightning.run import train_algorithm


class SaveFull(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        sharded = any(isinstance(m, FSDPModule) for m in pl_module.modules())
        if sharded:
            state = get_model_state_dict(pl_module.loss_module,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.loss_module.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save({"state": state, "world_size": trainer.world_size, "sharded": sharded,
                        "step": trainer.global_step}, self.out / "final.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("algorithm")
    parser.add_argument("data")
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("strategy")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    overrides = ["batch_size=8"] if args.algorithm == "dpo" else ["group_size=4", "prompts_per_round=4",
                                                                   "batch_size=8"]
    reward = None if args.algorithm == "dpo" else "_text_rewards:length_reward"
    args.out.mkdir(parents=True, exist_ok=True)
    train_algorithm(args.algorithm, args.data, model=args.model, reward=reward, steps=args.steps, seed=0, eval_every=0,
                    devices=2, accelerator="cpu", strategy=args.strategy, out_dir=args.out, progress=False,
                    overrides=overrides, callbacks=[SaveFull(args.out)], resume=args.resume or None,
                    precision=args.precision, checkpoint_every=args.checkpoint_every)
