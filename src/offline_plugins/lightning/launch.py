"""How a run is launched on its devices: the Lightning strategy ``--devices``, ``--num-nodes`` and
``--strategy`` give (:func:`_strategy`: one process, DDP, or FSDP2), whether this process is a rank a
launcher started, and ending those ranks when rank 0 fails."""

from __future__ import annotations

import os
import signal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from offline_plugins.lightning.fsdp import fsdp_strategy, language_models
from offline_plugins.lightning.guards import RunError


def _is_launched_rank() -> bool:
    # Lightning's DDP launcher re-runs the command in child processes with LOCAL_RANK set
    return int(os.environ.get("LOCAL_RANK", "0") or 0) > 0 or int(os.environ.get("NODE_RANK", "0") or 0) > 0


def _stop_launched_ranks(trainer) -> None:
    """Rank 0 failed: end the ranks its launcher started. Lightning ends them after a Ctrl-C, and its
    observer ends every rank when a launched one fails, but after an error on rank 0 they would wait
    in their next collective for the process group's timeout (30 minutes)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if trainer.is_global_zero and isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
        launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # SIGTERM does not end a rank inside a collective


def _needs_unused_parameters(parts) -> bool:
    # groups that sit steps out still backpropagate (with weight 0) under DDP, see
    # AlgorithmModule.on_fit_start; parameters no group steps never get a gradient
    grouped = {id(p) for g in parts.optimizers for p in g.params}
    return any(id(p) not in grouped for p in parts.loss.parameters() if p.requires_grad)


def _strategy(devices, num_nodes: int, parts, strategy):
    if strategy == "fsdp":
        # FSDP2 through Lightning's ModelParallelStrategy: the module's configure_model wraps each
        # decoder layer, then the model (offline_plugins.lightning.fsdp)

        if not language_models(parts.loss):
            raise RunError("--strategy fsdp shards the decoder layers of a transformers model (the classes its "
                           "_no_split_modules names); this algorithm's networks have none: use --strategy ddp")
        return fsdp_strategy(_device_count(devices) * int(num_nodes))
    if strategy is not None and strategy != "auto":
        return strategy
    single = (isinstance(devices, int) and devices == 1) or devices in ("1", [0])
    if single and num_nodes == 1:
        return "auto"

    return DDPStrategy(find_unused_parameters=_needs_unused_parameters(parts))


def _device_count(devices) -> int:
    """How many devices a node runs ``devices`` (``--devices``) on: a count, a list of ids or ``"auto"``
    (the GPUs here, else 1)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if devices in ("auto", -1, "-1"):
        return max(1, torch.cuda.device_count())
    return int(devices)


def _scale_device(accelerator: str) -> str:
    """Where the run's batches will live, for the memory check: the GPU when it will use one."""
    return "cuda" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"
