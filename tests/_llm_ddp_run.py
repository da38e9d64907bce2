"""Run by tests/test_llm_ddp.py: a 2-process CPU DDP run of DPO or GRPO on a small JSONL file.

``python _llm_ddp_run.py ALGORITHM DATA OUT STEPS [resume]``. Lightning's launcher re-runs
this script once per extra rank; every rank writes its final parameters to OUT/rank<r>.pt.
With ``resume`` the run continues OUT's ``last.ckpt`` up to STEPS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _ranks import SaveRankState

from offline_plugins.lightning.run import train_algorithm


if __name__ == "__main__":
    torch.set_num_threads(1)
    algorithm, data, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    resume = sys.argv[5:] == ["resume"]
    # GRPO: 4 prompts x 4 responses = 16 rollouts a rank, batch 8, 2 epochs: 4 steps a round
    overrides = (["batch_size=8"] if algorithm == "dpo" else
                 ["group_size=4", "prompts_per_round=4", "batch_size=8", "ppo_epochs=2", "lr=3e-3"])
    reward = None if algorithm == "dpo" else "_text_rewards:length_reward"
    train_algorithm(algorithm, data, model="tiny", reward=reward, steps=steps, seed=0, eval_every=0, devices=2,
          accelerator="cpu", out_dir=out, progress=False, overrides=overrides, callbacks=[SaveRankState(out)],
                    resume=resume or None)
