"""Rollouts sampled by an in-process vLLM engine colocated with training (``--generator vllm``).

:class:`VLLMGenerator` holds a vLLM ``LLM`` in the training process, started from the
policy's weights (written once to a temporary ``save_pretrained`` folder), and samples a
round's responses with the run's ``temperature``, ``top_p``, ``max_new_tokens`` and seed.
It returns the same :class:`~offline_plugins.text.backends.generation.Generation` as the
transformers path (:func:`~offline_plugins.text.backends.generation.generate`), so the collector,
the text environment and the losses read its rows unchanged:

* log-probs: vLLM's ``logprobs_mode="raw_logprobs"`` (its default) is the log-softmax of
  the model's own logits, before temperature and top-p, the distribution
  :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` scores for the losses; one
  per sampled token (``SamplingParams(logprobs=0)``: the sampled token alone);
* seeds: each row (prompt ``i``, sample ``j``) is its own request with its own
  ``SamplingParams(seed=...)``, drawn from the round's seed
  (``rollout_seed(seed, rank, round, attempt)``), so a round's samples depend on its seed
  and the engine's weights, not on the batch around them; a resumed run resamples them;
* a clean sampler: ``generation_config="vllm"``, so a model's ``generation_config.json``
  (a repetition penalty, a top-k) does not change the samples, as the transformers path
  builds its own ``GenerationConfig``;
* weights: :meth:`VLLMGenerator.before_round` loads the policy's weights into the engine
  (the worker's ``reload_weights``, through ``LLM.collective_rpc``, in process) when at least
  ``sync_every`` optimiser steps were taken since the last load; ``sync_every=1`` samples
  every round from the policy as it is. A LoRA policy is synced as merged weights
  (``W + scale * B A`` computed beside the adapters, which stay unmerged in training): one
  path for every policy, where vLLM's LoRA path would need ``enable_lora``, the adapter
  written to disk and a new ``LoRARequest`` per sync, and is not offered on every backend.

Why TorchRL's pieces are used where they are: the weights go through TorchRL's
``vLLMUpdaterV2`` (``torchrl.collectors.llm``), which pushes a weight iterator to any
``RLvLLMEngine``; :class:`LocalVLLMEngine` is that engine for an in-process ``LLM`` (no
process group: the weights are copied in place). TorchRL's ``vLLMUpdater`` (v1) is not used:
it broadcasts over an NCCL group to engines in other processes (Ray actors), which needs
CUDA and a second set of devices. TorchRL's ``vLLMWrapper`` is not used for sampling: it
builds one ``SamplingParams`` per call (one seed for the whole batch, ``n`` samples per
prompt), while a resumed run needs each row seeded on its own, and it writes TorchRL's
history/text layouts where the collector's environment hands over prompt token ids and
takes the sampled tokens back as they are (TorchRL's ``TransformersWrapper`` still scores
our rows: ``tests/test_online_losses.py``).

The engine runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set when unset (vLLM
would otherwise start its engine in a subprocess, which needs the calling script to have an
``if __name__ == "__main__":`` guard), and on CPU ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the
engine's threads are not pinned, so training keeps its own, and ``torch.set_num_threads``, which
vLLM's CPU worker replaces by a warning, is put back); ``VLLM_CPU_KVCACHE_SPACE``
(GiB) sizes its CPU KV cache, :data:`CPU_KV_CACHE_BYTES` (1 GiB) when unset (vLLM's own default
would reserve 92 % of the machine's memory and refuse to start while other processes hold more
than the rest). vLLM's own log shows warnings only, unless ``VLLM_LOGGING_LEVEL`` is
set (``INFO`` shows its lines for every weight load). Starting the engine seeds Python's, numpy's and torch's
global generators and may set torch's thread count: both are put back, so a run's other
randomness is the same with either generator.

Importing this module imports neither vLLM nor TorchRL's LLM stack: :func:`require_vllm`
does, when a run asks for ``--generator vllm``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from offline_plugins.errors import UserError
from offline_plugins.text.backends.generation import Generation, left_pad, model_context

__all__ = ["GENERATORS", "INSTALL_HINT", "GeneratorError", "VLLMGenerator", "LocalVLLMEngine", "require_vllm",
           "vllm_architecture", "policy_weights"]

#: the values of the online algorithms' ``generator`` field (``--generator``)
GENERATORS = ("hf", "vllm")

#: how to get vLLM, for every error that finds it missing
INSTALL_HINT = ("install it with pip install 'offline-plugins[vllm]' (a CUDA machine), or on a CPU-only machine "
                "make its separate environment with bash scripts/make_vllm_env.sh (docs/online.md, 'Sampling with "
                "vLLM'); or sample with --generator hf (the default)")


class GeneratorError(UserError, ValueError):
    """A ``--generator`` that cannot run here: vLLM missing, or a model it cannot load."""


def require_vllm(name: str = "--generator vllm") -> Any:
    """The ``vllm`` module, or a :class:`GeneratorError` that says how to install it."""
    # an engine inside a training run: its warnings, not two lines per weight load (vLLM reads this
    # when it configures its logging, as the engine starts)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as exc:  # absent, or a broken build (a CUDA torchvision beside a CPU torch)
        why = "is not installed" if getattr(exc, "name", None) == "vllm" else f"cannot be imported ({exc})"
        raise GeneratorError(f"{name}: vLLM {why} in this environment; {INSTALL_HINT}") from None
    return vllm


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and getattr(model, "peft_config", None) else model


def vllm_architecture(model: torch.nn.Module, name: str = "--generator vllm") -> str:
    """The vLLM architecture that loads ``model``: the first class of its MRO that vLLM's registry
    knows (the built-in tiny model, a ``GPT2LMHeadModel`` subclass, loads as ``GPT2LMHeadModel``).

    Raises:
        GeneratorError: vLLM is missing, or knows none of the model's classes.
    """
    vllm = require_vllm(name)
    base = _base_model(model)
    supported = set(vllm.ModelRegistry.get_supported_archs())
    for cls in type(base).__mro__:
        if cls.__name__ in supported:
            return cls.__name__
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    raise GeneratorError(
        f"{name}: vLLM {vllm.__version__} cannot load a {type(base).__name__} (model_type {model_type!r}): none of "
        f"its classes is among the {len(supported)} architectures vLLM supports (e.g. GPT2LMHeadModel, "
        "LlamaForCausalLM, Qwen2ForCausalLM); sample with --generator hf, or start from a model of a supported "
        "architecture (--model PATH)")


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under transformers' names, as vLLM's ``load_weights`` reads them.

    A peft LoRA model gives its merged weights, ``W + get_delta_weight()`` of each adapted
    layer, computed beside the adapters (training keeps them unmerged); the adapter and
    ``original_module`` tensors are left out. Tensors are the live ones where nothing is
    merged (``load_weights`` copies them).
    """
    base = _base_model(model)
    state = base.state_dict()
    if base is model:
        return state
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not getattr(module, "merged", False) \
                    and not getattr(module, "disable_adapters", False):
                delta = None
                for adapter in module.active_adapters:
                    if adapter in getattr(module, "lora_A", {}):
                        d = module.get_delta_weight(adapter)
                        delta = d if delta is None else delta + d
                if delta is not None:
                    deltas[module_name] = delta
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if "lora_" in key or ".original_module." in key:
            continue
        key = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight" and owner in deltas:
            value = value + deltas[owner].to(value.dtype)
        out[key] = value
    return out


@contextlib.contextmanager
def _keep_global_state():
    """Put back Python's, numpy's and torch's global generators and torch's thread count, which
    vLLM's in-process engine sets when it starts."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
        if torch.get_num_threads() != threads:
            with contextlib.suppress(RuntimeError):
                torch.set_num_threads(threads)


@contextlib.contextmanager
def _no_transformers_progress_bar():
    """No "Writing model shards" bar for the engine's temporary folder."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_chat_template_warmup():
    """Drop vLLM's "Chat template warmup failed" warning and its traceback: with
    ``skip_tokenizer_init`` (token ids in, token ids out: the run's tokenizer stays ours) there is no
    chat template to warm up, and vLLM 0.32 logs that as a failure."""
    logger = logging.getLogger("vllm.renderers.base")
    drop = lambda record: "Chat template warmup" not in str(record.msg)  # noqa: E731
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: the engine's KV cache on the CPU when ``VLLM_CPU_KVCACHE_SPACE`` is unset: room for 256 sequences of
#: ``small``'s 512 positions (0.8 GB) and for one 32k-token sequence of a 1.5B Qwen2 (0.9 GB)
CPU_KV_CACHE_BYTES = 1 << 30


class LocalVLLMEngine:
    """An in-process vLLM ``LLM`` as TorchRL's ``RLvLLMEngine`` (the interface ``vLLMUpdaterV2``
    pushes weights to): one worker, no process group, the weights copied in place.

    Built by :meth:`VLLMGenerator.start`; ``llm`` is the vLLM ``LLM``.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def get_tp_size(self) -> int:
        return 1

    def get_model_metadata(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        shapes = self.llm.apply_model(lambda m: {k: (v.dtype, v.shape) for k, v in m.state_dict().items()})
        return shapes[0]

    def get_master_address(self) -> str:
        return "localhost"  # no process group: the engine shares this process

    def get_master_port(self) -> int:
        return 0

    def init_weight_update_group(self) -> None:
        return None  # nothing to join: update_weights copies in place

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        # the worker's reload_weights, not model.load_weights: after loading, a backend repacks
        # layers into its kernels' format (vLLM's CPU linears lose their weight_loader), and
        # reload_weights restores the checkpoint layout, loads and repacks again
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        # cached prompt KV from the old weights must not serve the new ones
        with contextlib.suppress(Exception):
            self.llm.reset_prefix_cache()


def _engine_class():
    """:class:`LocalVLLMEngine` registered as TorchRL's ``RLvLLMEngine`` (imported on first use: it
    imports vLLM)."""
    from torchrl.modules.llm.backends.vllm import RLvLLMEngine

    RLvLLMEngine.register(LocalVLLMEngine)
    return LocalVLLMEngine


class VLLMGenerator:
    """Samples rounds of rollouts with an in-process vLLM engine that follows the policy's weights.

    Keyword Args:
        sync_every (int): load the policy's weights into the engine before a round when at
            least this many optimiser steps were taken since the last load (1: every round
            samples from the current policy; more: the engine may sample from a policy up to
            ``sync_every - 1`` steps old, which the rollout correction accounts for).
        gpu_memory_utilization (float): on a GPU, the share of its memory the engine may take
            (weights and KV cache), beside training's.
        max_num_seqs (int): sequences the engine schedules at once.
        enforce_eager (bool): no CUDA graphs / compilation (faster to start; a small model is
            not worth compiling).
        name (str): what errors call it.

    Attributes:
        syncs: weight loads so far; ``sync_seconds``, ``start_seconds``: the time they took.
    """

    def __init__(self, *, sync_every: int = 1, gpu_memory_utilization: float = 0.3, max_num_seqs: int = 256,
                 enforce_eager: bool = True, name: str = "--generator vllm") -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise GeneratorError(f"{name}: sync_every must be a whole number >= 1 (optimiser steps between weight "
                                 f"loads), got {sync_every!r}; fix it with --set sync_every=1")
        self.sync_every = int(sync_every)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.max_num_seqs = int(max_num_seqs)
        self.enforce_eager = bool(enforce_eager)
        self.name = name
        self.engine: Optional[LocalVLLMEngine] = None
        self.updater: Any = None
        self.synced_step: Optional[int] = None
        self.syncs = 0
        self.sync_seconds = 0.0
        self.start_seconds = 0.0

    @property
    def llm(self) -> Any:
        return None if self.engine is None else self.engine.llm

    # -- the engine's life -----------------------------------------------------------------------
    def start(self, model: torch.nn.Module) -> None:
        """Start the engine from ``model``'s current weights (merged, for LoRA)."""
        require_vllm(self.name)
        arch = vllm_architecture(model, self.name)
        base = _base_model(model)
        device = next(base.parameters()).device
        dtype = next(base.parameters()).dtype
        if dtype not in _DTYPES:
            raise GeneratorError(f"{self.name}: the policy's weights are {dtype}; vLLM samples float32, bfloat16 or "
                                 "float16 models: pass --precision 32-true or bf16-true, or use --generator hf")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="offline-plugins-vllm-") as folder:
            with _no_transformers_progress_bar():
                base.save_pretrained(folder, state_dict=policy_weights(model), safe_serialization=True)
            config_path = Path(folder) / "config.json"
            config = json.loads(config_path.read_text())
            config["architectures"] = [arch]  # a subclass saves its own name, which vLLM does not know
            config_path.write_text(json.dumps(config))
            from vllm import LLM

            kwargs = dict(model=folder, skip_tokenizer_init=True, dtype=_DTYPES[dtype],
                          max_model_len=model_context(base), enforce_eager=self.enforce_eager,
                          enable_prefix_caching=False, generation_config="vllm", max_num_seqs=self.max_num_seqs,
                          seed=0, use_tqdm_on_load=False)
            if device.type == "cuda":
                kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # unsized, vLLM's CPU worker asks for gpu_memory_utilization (0.92) of the machine's memory
                # and refuses to start when other processes hold more than the rest
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            set_num_threads = torch.set_num_threads
            with _keep_global_state(), _quiet_chat_template_warmup():
                try:
                    llm = LLM(**kwargs)
                except Exception as exc:  # vLLM's own refusal (a config it cannot read, no memory): one line
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise GeneratorError(f"{self.name}: vLLM could not start an engine for this {arch} model: "
                                         f"{first[:400]}; sample with --generator hf") from exc
                finally:
                    # vLLM's CPU worker replaces torch.set_num_threads by a warning, for the sake of the
                    # OpenMP threads it pins; with nobind it pins none, and the run keeps its own setting
                    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
                        torch.set_num_threads = set_num_threads
        from torchrl.collectors.llm.weight_update.vllm_v2 import vLLMUpdaterV2

        self.engine = _engine_class()(llm)
        self.updater = vLLMUpdaterV2(self.engine)
        self.updater.init()
        self.start_seconds = time.perf_counter() - t0

    def sync(self, model: torch.nn.Module) -> None:
        """Load ``model``'s weights (merged, for LoRA) into the running engine."""
        t0 = time.perf_counter()
        with _keep_global_state():
            self.updater.push_weights(iter(policy_weights(model).items()))
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - t0

    def before_round(self, model: torch.nn.Module, step: int) -> None:
        """Before a round sampled at optimiser step ``step``: start the engine, or load the
        policy's weights when ``sync_every`` steps passed since the last load."""
        if self.engine is None:
            self.start(model)
            self.synced_step = int(step)
        elif int(step) - int(self.synced_step) >= self.sync_every:
            self.sync(model)
            self.synced_step = int(step)

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm, self.engine, self.updater = self.llm, None, None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm

        gc.collect()

    # -- sampling ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, pad_id: int, eos_id: Optional[int],
                 max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, device: Any = "cpu") -> Any:
        """``num_samples`` responses to each prompt, with the log-prob of each sampled token.

        As :func:`~offline_plugins.text.backends.generation.generate` with ``log_probs=True``: row
        ``i * num_samples + j`` is sample ``j`` of prompt ``i``; a response runs to its first
        eos (included) or to ``max_new_tokens``; the log-probs are the model's raw
        distribution's. Each row's request is seeded from ``seed`` and its row index.
        """
        if self.engine is None:
            raise RuntimeError("VLLMGenerator.generate before start(): call before_round(model, step) first")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = len(prompt_ids) * num_samples
        seeds = torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(int(seed))).tolist()
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_ids for _ in range(num_samples)]
        stop = [int(eos_id)] if eos_id is not None else None
        params = [SamplingParams(n=1, temperature=float(temperature), top_p=float(top_p), top_k=0,
                                 max_tokens=int(max_new_tokens), seed=int(s), logprobs=0, stop_token_ids=stop,
                                 detokenize=False, skip_special_tokens=False) for s in seeds]
        with _keep_global_state():
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        width = max((len(o.outputs[0].token_ids) for o in outs), default=0) or 1
        tokens = torch.full((n, width), int(pad_id), dtype=torch.long)
        log_probs = torch.zeros(n, width, dtype=torch.float32)
        lengths = torch.zeros(n, dtype=torch.long)
        for i, o in enumerate(outs):
            sample = o.outputs[0]
            ids = list(sample.token_ids)
            if stop is not None and sample.stop_reason == stop[0] and (not ids or ids[-1] != stop[0]):
                # the collector keeps the eos a response stopped on (the policy chose to stop)
                raise RuntimeError("vLLM left the eos token out of a response it stopped on")
            k = len(ids)
            tokens[i, :k] = torch.tensor(ids, dtype=torch.long)
            log_probs[i, :k] = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)])
            lengths[i] = k
        ids, attn = left_pad(prompt_ids, pad_id, repeat=num_samples)
        dev = torch.device(device)
        return Generation(ids.to(dev), attn.to(dev), tokens.to(dev), lengths.to(dev), log_probs.to(dev))
