"""``--strategy fsdp``: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``.

Lightning is the engine: its ``ModelParallelStrategy`` starts the processes (gloo on CPUs,
NCCL on GPUs), builds the device mesh, calls the module's ``configure_model`` before the
optimiser is made, saves and loads distributed checkpoints (a folder: one shard file per
rank, and ``meta.pt`` with everything that is not a tensor of the model or the optimiser)
and resumes from them. What is ours is the wrapping policy (:func:`shard_module`): each
decoder layer of every transformers model the loss trains (its ``_no_split_modules``
classes), then the model itself, one ``fully_shard`` each, with FSDP2's
``MixedPrecisionPolicy`` for ``bf16-mixed``; and the bookkeeping sharding needs around
it: ``fully_shard`` replaces each parameter by a ``DTensor`` parameter, so the optimiser
groups are renamed to the new ones; a forward gathers parameters from every rank, so
whatever runs a model (the held-out evaluation, ``generate``) runs on every rank
(:func:`is_sharded`, ``synced_gpus``); and the trained model leaves as full weights
(:func:`full_copy`) for the ``save_pretrained`` export.

Why not Lightning's ``FSDPStrategy``: it is FSDP1 (``FullyShardedDataParallel``), refuses a
CPU accelerator, and flat-parameter wrapping is what PyTorch now recommends against; FSDP2
keeps per-parameter ``DTensor`` shards, so the optimiser and the checkpoints see the
parameters by their own names.

Frozen models that the loss module holds (a reference or a reward model inside it) are
sharded the same way; those outside it (the online collector's reference, a ``--reward``
model) are held once per rank, in evaluation mode, without gradients or optimiser state.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from offline_plugins.data.files import is_write_error, write_error
from offline_plugins.errors import UserError
from offline_plugins.lightning.files import RESUME_FIX

__all__ = ["ShardedCheckpoints", "fsdp_strategy", "shard_module", "is_sharded", "language_models", "decoder_layers",
           "mixed_precision_policy", "full_copy", "FSDP_PRECISIONS"]

#: ``--precision`` values ``--strategy fsdp`` takes: the parameters stay float32 and FSDP2 casts
#: them for the forward (``bf16-mixed``), or they are held in that dtype (``bf16-true``)
FSDP_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")


class ShardedCheckpoints(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose distributed checkpoints replace the previous one whole.

    Every rank writes its shard into ``PATH.partial``; once all have, rank 0 swaps it for ``PATH``
    (the old folder moved aside, then removed), so a save that fails part-way (a full disk, a
    killed rank) leaves the previous checkpoint readable, as
    :class:`~offline_plugins.lightning.files.RunCheckpointIO` does for single files.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        building = path.with_name(path.name + ".partial")
        if self.global_rank == 0 and building.exists():
            shutil.rmtree(building)
        self.barrier()
        try:
            super().save_checkpoint(checkpoint, building)
        except OSError as exc:
            if is_write_error(exc):
                raise write_error(path, exc, fix=RESUME_FIX, what=f"the previous {path.name} is intact") from None
            raise
        self.barrier()
        if self.global_rank == 0:
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                os.rename(path, old)
            os.rename(building, path)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            elif old.exists():
                old.unlink()
        self.barrier()


def fsdp_strategy(data_parallel_size: int) -> ShardedCheckpoints:
    """Lightning's ``ModelParallelStrategy`` sharding over ``data_parallel_size`` processes (no tensor
    parallelism), saving distributed checkpoints (:class:`ShardedCheckpoints`)."""
    return ShardedCheckpoints(data_parallel_size=int(data_parallel_size), tensor_parallel_size=1,
                              save_distributed_checkpoint=True)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model, outermost first: instances of the classes it names
    in ``_no_split_modules`` (not nested in another one).

    >>> from offline_plugins.modules.tiny_lm import load_causal_lm
    >>> [type(m).__name__ for m in decoder_layers(load_causal_lm("tiny", seed=0)[0])]
    ['GPT2Block', 'GPT2Block']
    """
    names = set(getattr(_transformers_model(model), "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        # fully_shard changes a module's class to a subclass (FSDPGPT2Block): its bases still name it
        if any(c.__name__ in names for c in type(m).__mro__):
            found.append(m)
            inside.update(id(c) for c in m.modules())
    return found


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside ``model`` (a peft wrapper's base), or ``model``."""
    if callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def language_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules inside ``module`` that hold decoder layers (a transformers model, or the
    peft model around one): what :func:`shard_module` wraps, the model last."""
    out: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside:
            continue
        base = _transformers_model(m)
        is_lm = getattr(base, "_no_split_modules", None) and hasattr(base, "config") and decoder_layers(m)
        if is_lm:
            out.append(m)
            inside.update(id(c) for c in m.modules())
    return out


def mixed_precision_policy(precision: Optional[str]) -> Optional[Any]:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning precision name: ``bf16-mixed`` computes in
    bfloat16 from float32 parameters and reduces gradients in float32; anything else: None.

    >>> mixed_precision_policy("bf16-mixed").param_dtype
    torch.bfloat16
    >>> mixed_precision_policy("32-true") is None
    True
    """
    if str(precision) != "bf16-mixed":
        return None

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds FSDP2-sharded parameters (its forward gathers them from every rank).

    Read from the parameters, not the submodules: a LoRA reference (the policy with its adapters
    off) holds the policy's parameters without registering the policy as a submodule."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def _meta_template(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory) and whose buffers are
    real: :func:`full_copy` fills it with the gathered weights after training."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def shard_module(pl_module: Any, mesh: Any, *, precision: Optional[str] = None,
                 reshard_after_forward: bool = True) -> list[torch.nn.Module]:
    """Wrap the language models of ``pl_module.loss_module`` with ``fully_shard`` on ``mesh``: each
    decoder layer, then the model. Renames ``pl_module.optimizer_groups`` to the sharded parameters
    and keeps a meta-device template of ``pl_module.parts.model`` for :func:`full_copy`. Returns the
    models wrapped; does nothing when they already are (``configure_model`` runs once per fit).

    Raises:
        UserError: the loss holds no transformers model with a decoder-layer list.
    """
    loss = pl_module.loss_module
    models = language_models(loss)
    if not models:
        name = getattr(pl_module, "hparams", {}).get("algorithm") or type(loss).__name__
        raise UserError(f"--strategy fsdp shards the decoder layers of a transformers model (the classes its "
                        f"_no_split_modules names); {name}'s networks have none: use --strategy ddp")
    if any(isinstance(m, FSDPModule) for m in loss.modules()):
        return models
    chunked = [m for m in loss.modules() if getattr(m, "chunk_size", None) is not None and hasattr(m, "log_probs")]
    if chunked:
        raise UserError("--strategy fsdp cannot compute log-probs in chunks (logprob_chunk): the chunks call the "
                        "model's body and head apart, outside the sharded model's forward; unset logprob_chunk "
                        "(--set logprob_chunk=0) or train with --strategy ddp")
    names = {id(p): n for n, p in loss.named_parameters()}
    parts_model = getattr(getattr(pl_module, "parts", None), "model", None)
    if parts_model is not None and any(parts_model is m for m in models):
        # a plain attribute, not a submodule: it is no part of the module's state or of the checkpoints
        pl_module.__dict__["_fsdp_template"] = _meta_template(parts_model)
    mp = mixed_precision_policy(precision)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for model in models:
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        # the transformers model, not a peft wrapper around it: peft's generate calls the inner
        # model's, so the root's parameters (embeddings, head) are gathered on both paths
        fully_shard(_transformers_model(model), **kwargs)
    now = dict(loss.named_parameters())
    groups = []
    for g in pl_module.optimizer_groups:
        renamed = []
        for p in g.params:
            name = names.get(id(p))
            renamed.append(now[name] if name is not None and name in now else p)
        groups.append(dataclasses.replace(g, params=renamed))
    pl_module.optimizer_groups = groups
    pl_module._active_cache = {}
    return models


def full_copy(pl_module: Any, model: Optional[torch.nn.Module] = None) -> Optional[torch.nn.Module]:
    """A plain (unsharded) copy of the sharded ``model`` (default ``pl_module.parts.model``) holding its
    full trained weights, on global rank 0; None on the other ranks.

    Every rank must call it: the weights are gathered with
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``
    (only rank 0 receives them, on the CPU) and loaded into the meta-device template
    :func:`shard_module` kept.
    """
    model = model if model is not None else pl_module.parts.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return None
    template = pl_module.__dict__.get("_fsdp_template")
    if template is None:
        raise RuntimeError("full_copy needs the template shard_module keeps of parts.model")
    plain = copy.deepcopy(template)
    plain.load_state_dict(full, strict=False, assign=True)
    if callable(getattr(plain, "tie_weights", None)):
        plain.tie_weights()  # assign=True gave a tied head its own tensor: share the embedding's again
    missing = [n for n, p in plain.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"the gathered weights lack {missing[:3]}")
    return plain
