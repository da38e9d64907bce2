"""``--strategy fsdp``: FSDP2 through Lightning's ModelParallelStrategy, on two CPU ranks (gloo).

DPO and GRPO end with the parameters a DDP run ends with (within 1e-5: the sharded all-gather
and reduce-scatter sum in another order than DDP's all-reduce; measured 1.7e-6 and 2.4e-6 after
4 steps that move the weights by about 4e-3), a run resumed from a distributed checkpoint ends
where an uninterrupted one does (exactly), and the trained model leaves as a plain
``save_pretrained`` folder. The unit tests shard in one process (a world of one).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _ranks import launch

SCRIPT = Path(__file__).parent / "_llm_fsdp_run.py"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path: Path, algorithm: str, data: Path, out: Path, steps: int, strategy: str, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "OFFLINE_PLUGINS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parent)}
    proc = launch([sys.executable, str(SCRIPT), algorithm, str(data), str(out), str(steps), strategy, *extra], env, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=False)


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-data")
    pairs = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(200)]
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)] * 2
    return {"dpo": _write(root / "dpo.jsonl", pairs), "grpo": _write(root / "grpo.jsonl", prompts)}


@pytest.fixture(scope="module")
def fsdp_dpo(tmp_path_factory, data):
    """One FSDP DPO run of 4 steps, ``(final state, its folder)``: the run DDP's is compared with and the
    uninterrupted run a resumed one must end as (two launches of two ranks, made once)."""
    root = tmp_path_factory.mktemp("fsdp-dpo")
    return _run(root, "dpo", data["dpo"], root / "fsdp", 4, "fsdp"), root / "fsdp"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("fsdp-dpo")  # the tests reading fsdp_dpo on one worker, which makes it once
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_fsdp_ends_with_the_parameters_of_ddp(tmp_path, data, algorithm, request):
    ddp = _run(tmp_path, algorithm, data[algorithm], tmp_path / "ddp", 4, "ddp")
    if algorithm == "dpo":
        fsdp, out = request.getfixturevalue("fsdp_dpo")
    else:
        fsdp, out = _run(tmp_path, algorithm, data[algorithm], tmp_path / "fsdp", 4, "fsdp"), tmp_path / "fsdp"
    assert (ddp["sharded"], fsdp["sharded"]) == (False, True)
    assert ddp["world_size"] == fsdp["world_size"] == 2 and ddp["step"] == fsdp["step"] == 4
    assert _largest_difference(ddp["state"], fsdp["state"]) < 1e-5
    # the runs trained: the policy moved from the tiny model it started at
    from offline_plugins.modules.tiny_lm import load_causal_lm

    initial = load_causal_lm("tiny", seed=0)[0].state_dict()
    moved = max((fsdp["state"][f"actor_network.model.{k}"] - v).abs().max().item() for k, v in initial.items()
                if f"actor_network.model.{k}" in fsdp["state"])
    assert moved > 1e-3
    # the exported model is the trained one, as a plain save_pretrained folder
    exported = load_causal_lm(str(out / "model"), seed=0)[0].state_dict()
    assert max((exported[k] - fsdp["state"][f"actor_network.model.{k}"]).abs().max().item() for k in exported
               if f"actor_network.model.{k}" in fsdp["state"]) == 0.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("fsdp-dpo")
def test_a_resumed_fsdp_run_equals_an_uninterrupted_one(tmp_path, data, fsdp_dpo):
    whole = fsdp_dpo[0]
    _run(tmp_path, "dpo", data["dpo"], tmp_path / "parts", 2, "fsdp")
    last = tmp_path / "parts" / "checkpoints" / "last.ckpt"
    # a distributed checkpoint: one shard per rank, the rest in meta.pt; nothing half-written beside it
    assert last.is_dir() and sorted(p.name for p in last.iterdir() if p.suffix == ".distcp") == \
        ["__0_0.distcp", "__1_0.distcp"]
    assert (last / "meta.pt").is_file() and not (last.parent / "last.ckpt.partial").exists()
    resumed = _run(tmp_path, "dpo", data["dpo"], tmp_path / "parts", 4, "fsdp", "--resume")
    assert resumed["step"] == whole["step"] == 4
    assert _largest_difference(whole["state"], resumed["state"]) == 0.0
    # the sharded checkpoint reads as one (eval gathers its shards)
    from offline_plugins.lightning.checkpoints import evaluate_checkpoint

    result = evaluate_checkpoint(last)
    summary = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert result["preference_accuracy"] == pytest.approx(summary["preference_accuracy"])


# -- one process: the wrapping policy ---------------------------------------------------------
@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    # an in-memory store: no port, and no MASTER_* variables left for the runs the other tests launch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _dpo_module():
    from offline_plugins.lightning.module import AlgorithmModule
    from offline_plugins.lightning.plan import build_parts, plan_run

    rows = [{"prompt": f"q{i}=", "chosen": "good", "rejected": "bad"} for i in range(40)]
    path = Path(os.environ["OFFLINE_PLUGINS_CACHE"]) / "fsdp-unit.jsonl"
    _write(path, rows)
    plan = plan_run("dpo", str(path), model="tiny", overrides=["batch_size=8"])
    return AlgorithmModule(build_parts(plan, 0), algorithm="dpo", dataset=str(path))


def test_shard_module_wraps_each_decoder_layer_and_the_model_and_renames_the_optimiser_groups(world_of_one):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from offline_plugins.lightning.fsdp import full_copy, shard_module
    from offline_plugins.lightning.module import make_shell_optimizer

    module = _dpo_module()
    before = {n: p.detach().clone() for n, p in module.parts.model.named_parameters()}
    models = shard_module(module, world_of_one, precision="bf16-mixed")
    assert models == [module.parts.model] and isinstance(module.parts.model, FSDPModule)
    blocks = list(module.parts.model.transformer.h)
    assert len(blocks) == 2 and all(isinstance(b, FSDPModule) for b in blocks)
    # the optimiser steps the sharded parameters, the ones the model now holds
    held = {id(p) for p in module.loss_module.parameters()}
    params = [p for g in module.optimizer_groups for p in g.params]
    assert params and all(isinstance(p, DTensor) and id(p) in held for p in params)
    optimizer = make_shell_optimizer(module.optimizer_groups)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)
    # bf16-mixed: the forward computes in bfloat16, the parameters stay float32
    seen = []
    blocks[0].register_forward_hook(lambda m, args, out: seen.append(out[0].dtype if isinstance(out, tuple) else out.dtype))
    ids = torch.tensor([[1, 2, 3, 4]])
    module.parts.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert seen == [torch.bfloat16] and {p.dtype for p in params} == {torch.float32}
    # a second configure_model (Lightning calls it again for another stage) changes nothing
    assert shard_module(module, world_of_one) == models and module.optimizer_groups[0].params[0] is params[0]
    # the plain copy holds the full weights, not sharded
    plain = full_copy(module)
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    for name, p in plain.named_parameters():
        assert not isinstance(p, DTensor) and torch.equal(p, before[name]), name


def test_fsdp_refuses_networks_without_decoder_layers_and_chunked_log_probs(world_of_one):
    from offline_plugins.errors import UserError
    from offline_plugins.lightning.fsdp import shard_module
    from offline_plugins.lightning.module import AlgorithmModule
    from offline_plugins.lightning.plan import build_parts, plan_run

    module = AlgorithmModule(build_parts(plan_run("bc", "pendulum/medium-replay-v0"), 0), algorithm="bc")
    with pytest.raises(UserError, match="decoder layers of a transformers model.*use --strategy ddp"):
        shard_module(module, world_of_one)
    module = _dpo_module()
    module.loss_module.actor_network.chunk_size = 8
    with pytest.raises(UserError, match="cannot compute log-probs in chunks"):
        shard_module(module, world_of_one)


def test_the_cli_refuses_fsdp_for_an_mlp_algorithm_in_one_line(tmp_path, capsys):
    from offline_plugins.cli import main

    rc = main(["train", "bc", "--dataset", "pendulum/medium-replay-v0", "--steps", "2", "--strategy", "fsdp",
               "--devices", "2", "--accelerator", "cpu", "--out", str(tmp_path / "bc")])
    err = capsys.readouterr().err
    assert rc != 0 and "--strategy fsdp shards the decoder layers" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_under_fsdp_shards_the_base_and_exports_adapters_and_the_merged_model(tmp_path, data):
    """The reference of a LoRA run is the sharded policy with its adapters off: scoring it (the
    evaluation's starting point) and generating with it run on both ranks, or the run would hang."""
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "OFFLINE_PLUGINS_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", "dpo", "--dataset", str(data["dpo"]), "--model",
           "tiny", "--steps", "2", "--devices", "2", "--accelerator", "cpu", "--strategy", "fsdp", "--set",
           "batch_size=8", "--set", "lora_r=4", "--out", str(out), "--no-progress"]
    proc = launch(cmd, env, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "model" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["preference_accuracy"] is not None
