"""``devices=2`` on CPU trains the language-model families with DDP (gloo): DPO on pairs and
GRPO on its own rollouts end with identical parameters on both ranks. Two processes each."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _ranks import launch, ranks_in_sync

SCRIPT = Path(__file__).parent / "_llm_ddp_run.py"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "OFFLINE_PLUGINS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parent)}


def _launch(data: Path, out: Path, algorithm: str, steps: int, env: dict, timeout: float, *extra: str) -> None:
    proc = launch([sys.executable, str(SCRIPT), algorithm, str(data), str(out), str(steps), *extra], env, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


#: GRPO's prompt rows; the reward is _text_rewards.length_reward (a random init gets it, unlike exact match)
GRPO_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """One two-rank GRPO run of 6 steps (rounds of 4: step 2 is in the middle of round 0): the run whose
    ranks must end in sync, and the uninterrupted run a resumed one must end as. ``(data, folder)``."""
    root = tmp_path_factory.mktemp("llm-ddp-grpo")
    data = _write(root / "grpo.jsonl", GRPO_ROWS)
    _launch(data, root / "full", "grpo", 6, _env(root), 290)
    return data, root / "full"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("llm-ddp-grpo")  # the tests reading grpo_run on one worker, which makes it once
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_two_cpu_ranks_train_a_language_model_in_sync(tmp_path, algorithm, request):
    if algorithm == "dpo":
        rows = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(200)]
        out, steps = tmp_path / "ddp", 4
        _launch(_write(tmp_path / "dpo.jsonl", rows), out, "dpo", steps, _env(tmp_path), 290)
    else:
        out, steps = request.getfixturevalue("grpo_run")[1], 6
    ranks_in_sync(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == steps
    assert (out / "model" / "config.json").is_file()
    # the ranks trained: the exported policy is not the initial model
    from offline_plugins.modules.tiny_lm import load_causal_lm

    initial = load_causal_lm("tiny", seed=0)[0].state_dict()
    trained = load_causal_lm(str(out / "model"), seed=0)[0].state_dict()
    moved = any(not torch.equal(initial[k], trained[k]) for k in initial if k in trained)
    assert moved


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("llm-ddp-grpo")
def test_a_two_rank_grpo_run_resumed_mid_round_ends_as_the_uninterrupted_one(tmp_path, grpo_run):
    """Each rank samples its own prompts; the checkpoint keeps every rank's round, so a resume in
    the middle of a round trains each rank on the rollouts it had (rank 1's re-sampled by the
    moved policy would carry other log-probs and end elsewhere)."""
    data, whole = grpo_run
    full = torch.load(whole / "rank0.pt", weights_only=False)["state"]
    part = tmp_path / "part"
    _launch(data, part, "grpo", 2, _env(tmp_path), 190)
    ckpt = torch.load(part / "checkpoints" / "last.ckpt", weights_only=False)
    saved = next(v for k, v in ckpt.items() if isinstance(v, dict) and "ranks" in v)
    assert [r["rank"] for r in saved["ranks"]] == [0, 1]
    _launch(data, part, "grpo", 6, _env(tmp_path), 190, "resume")
    resumed = torch.load(part / "rank0.pt", weights_only=False)["state"]
    assert json.loads((part / "summary.json").read_text())["steps"] == 6
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_fsdp_on_two_gpus_shards_the_decoder_layers_and_saves_a_checkpoint(tmp_path):
    """Where two CUDA GPUs exist (skipped elsewhere): DPO under --strategy fsdp trains and its checkpoint evaluates."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from offline_plugins.cli import main

    rows = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(200)]
    data = _write(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "fsdp"
    env = {**os.environ, "OFFLINE_PLUGINS_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", "dpo", "--dataset", str(data), "--model", "tiny",
           "--steps", "4", "--devices", "2", "--accelerator", "gpu", "--strategy", "fsdp", "--set", "batch_size=8",
           "--out", str(out), "--no-progress"]
    proc = launch(cmd, env, 290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
