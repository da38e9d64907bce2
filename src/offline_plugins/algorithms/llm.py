"""What the language-model families' glue shares (preference, online, PPO-RLHF, distillation,
text-DT, PRMs): the LoRA config fields, the policy and its frozen reference, the log-prob actor and
the learning rate, which depends on where the reference starts.

Learning rates depend on where the reference starts, so a config's ``lr`` defaults to ``None``: the
algorithm's pretrained rate for a pretrained or SFT reference (a hub model, a ``save_pretrained``
directory, a built-in task's SFT reference), and :data:`FROM_SCRATCH_LR` when the reference is a
built-in model at its random initialisation; both are tiny's, and ``small`` (from its random init or
from its SFT reference) takes a third of them (:func:`resolve_lr`).

>>> [f.name for f in dataclasses.fields(LoRAFields)][:3]
['lora_r', 'lora_alpha', 'lora_dropout']
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from offline_plugins.config import config_field
from offline_plugins.errors import UserError

__all__ = ["FROM_SCRATCH_LR", "LoRAFields", "lr_help", "with_lora", "trainable_copy", "policy_and_reference",
           "policy_log_probs", "scratch_lr", "resolve_lr"]

#: Adam learning rate when the reference is a randomly initialised model (a built-in ``--model``, tiny or small, on a file)
FROM_SCRATCH_LR = 1e-3


def lr_help(pretrained: float, source: str = "a .jsonl or hf: dataset") -> str:
    """The help of a config's ``lr`` field, naming both defaults (``offline-plugins info``)."""
    return (f"Adam learning rate of the policy; unset: {pretrained:g} for a pretrained or SFT reference, "
            f"{FROM_SCRATCH_LR:g} for a built-in --model (tiny, small) from its random init ({source}); "
            f"a third of either with --model small")


REFERENCE_STEPS_HELP = ("built-in preference set with a built-in --model (tiny, small): SFT steps of the cached "
                         "reference its pairs are sampled from (default: the task's own, the reference its online "
                         "runs start from)")


@dataclass
class LoRAFields:
    """Config fields of every policy-training preference algorithm: LoRA adapters instead of full
    weights, activation checkpointing, the long-sequence options, and the built-in sets' reference."""

    lora_r: int = config_field(0, "LoRA rank: train low-rank adapters only, the reference being the base model "
                                  "with adapters off (no second copy; needs pip install 'offline-plugins[peft]'); "
                                  "0: train every weight")
    lora_alpha: float = config_field(16.0, "LoRA scale: the weight update is lora_alpha / lora_r * B A")
    lora_dropout: float = config_field(0.0, "dropout on the LoRA adapters' input")
    lora_target: str = config_field("", "comma-separated names of the modules to adapt (empty: peft's default "
                                        "for the architecture, e.g. c_attn for GPT-2, q_proj,v_proj for Llama)")
    gradient_checkpointing: bool = config_field(False, "recompute the policy's activations in the backward "
                                                       "(transformers' gradient checkpointing): less memory, "
                                                       "about a third more compute")
    logprob_chunk: int = config_field(0, "compute the policy's token log-probs this many positions at a time, "
                                         "never holding the [N, T, vocabulary] logits (large vocabularies); 0: "
                                         "one forward")
    shared_prefix: bool = config_field(False, "rows of a batch that share a prompt (a DPO pair, a GRPO group) "
                                              "forward it once and continue from its key/value cache: the same "
                                              "log-probs, fewer prompt tokens computed (long prompts)")
    reference_sft_steps: Optional[int] = config_field(None, REFERENCE_STEPS_HELP)
    eval_prompts: int = config_field(500, "built-in preference set: held-out task prompts its evaluation answers "
                                          "greedily and scores (exact match, or the verifier); 0: none")


def with_lora(cls: type) -> type:
    """``cls`` with the :class:`LoRAFields` after its own fields (``info`` lists them last)."""
    extra = [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
             for f in dataclasses.fields(LoRAFields)]
    return dataclasses.make_dataclass(cls.__name__, extra, bases=(cls,),
                                      namespace={"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                 "__qualname__": cls.__qualname__})


def trainable_copy(model: Any) -> Any:
    """A deep copy of ``model`` (the reference) with every parameter trainable."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _lora_policy(config: Any, base: Any, name: str) -> Any:
    """``base`` with LoRA adapters (peft) as the policy. peft puts the adapters into ``base``'s
    modules, so the weights are held once; the reference is then the policy with its adapters
    off (:class:`~offline_plugins.modules.causal_lm.AdaptersOff`)."""
    if isinstance(config.lora_r, bool) or int(config.lora_r) < 0:
        raise UserError(f"{name}: lora_r must be a whole number >= 0, got {config.lora_r!r}; fix it with --set lora_r=16")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError(f"{name}: lora_r={config.lora_r} trains LoRA adapters, which needs peft: "
                        "pip install 'offline-plugins[peft]' (or drop --set lora_r)") from None
    from offline_plugins.modules.causal_lm import AdaptersOff

    if isinstance(base, AdaptersOff) or any(type(m).__module__.startswith("peft") for m in base.modules()):
        raise UserError(f"{name}: this dataset's reference already carries LoRA adapters from an earlier run in "
                        "this process; load the dataset again for a new LoRA run")
    targets = [t.strip() for t in str(config.lora_target or "").split(",") if t.strip()] or None

    try:
        with warnings.catch_warnings():
            # peft notes that GPT-2's Conv1D stores its weight transposed, and handles it
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
            return get_peft_model(base, LoraConfig(r=int(config.lora_r), lora_alpha=config.lora_alpha,
                                                   lora_dropout=config.lora_dropout, target_modules=targets,
                                                   task_type="CAUSAL_LM"))
    except ValueError as exc:
        first = str(exc).splitlines()[0][:200]
        raise UserError(f"{name}: LoRA could not adapt the model with lora_target={config.lora_target!r} ({first}); "
                        "name modules the model has (e.g. --set lora_target=c_attn for GPT-2)") from None


def policy_and_reference(config: Any, data: Any, name: str, *, reference: Any = None) -> tuple[Any, Any]:
    """``(policy, reference)``: the model a language-model algorithm trains, in train mode, and the
    frozen model it is measured against. ``data`` is left as it was.

    The policy is a trainable copy of ``reference`` (default ``data.reference``), or LoRA adapters
    on it (``config.lora_r > 0``; the reference is then the policy with its adapters off), with
    transformers' activation checkpointing when ``config.gradient_checkpointing``."""
    base = data.reference if reference is None else reference
    if int(config.lora_r) > 0:
        from offline_plugins.modules.causal_lm import AdaptersOff

        policy_model = _lora_policy(config, base, name)
        base = AdaptersOff(policy_model)
    else:
        policy_model = trainable_copy(base)
    if config.gradient_checkpointing:
        # non-reentrant: works with inputs that need no grad (token ids) and with LoRA's frozen base;
        # transformers >= 5.2x calls it activation checkpointing (the old name warns)
        if hasattr(policy_model, "activation_checkpointing_enable"):
            policy_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(policy_model, "gradient_checkpointing_enable"):
            policy_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise UserError(f"{name}: gradient_checkpointing=true needs a transformers model, got "
                            f"{type(policy_model).__name__}")
    policy_model.train()
    return policy_model, base


def policy_log_probs(config: Any, policy: Any, name: str) -> Any:
    """The :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` of ``policy``, in chunks of
    ``config.logprob_chunk`` positions when it is set."""
    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    chunk = getattr(config, "logprob_chunk", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise UserError(f"{name}: logprob_chunk must be a whole number >= 0, got {chunk!r}; fix it with "
                        "--set logprob_chunk=0 (one forward) or e.g. 64")
    shared = bool(getattr(config, "shared_prefix", False))
    if shared and chunk:
        raise UserError(f"{name}: shared_prefix and logprob_chunk do not combine (the chunks need the continuation's "
                        "hidden states, the shared prompt forward gives a cache); set one: --set shared_prefix=false "
                        "or --set logprob_chunk=0")
    try:
        return CausalLMLogProbs(policy, chunk_size=chunk or None, shared_prefix=shared)
    except ValueError as exc:
        raise UserError(f"{name}: {exc}; fix it with --set logprob_chunk=0 and --set shared_prefix=false") from None


def scratch_lr(lr: float, data: Any) -> float:
    """A default ``lr`` (tiny's) scaled for the built-in model ``data`` was made from, whether the
    reference is that model at its random initialisation or its SFT reference on a built-in task
    (``tiny_lm.from_scratch_lr``: ``small`` takes a third); any other model keeps ``lr``."""
    from offline_plugins.modules.tiny_lm import from_scratch_lr

    return from_scratch_lr(lr, getattr(data, "model", "tiny"))


def resolve_lr(config: Any, data: Any, name: str, pretrained_lr: Optional[float] = None) -> float:
    """The policy's learning rate: ``config.lr``, or the default for where the reference starts.

    A reference at its random initialisation (``data.from_scratch``) gets
    :data:`FROM_SCRATCH_LR`, any other ``pretrained_lr`` (by default the config's); both are tiny's and
    are scaled for the built-in model the data was made from (a third for ``small``, its SFT reference
    included: :func:`scratch_lr`). The rate used is written back into ``config`` so the run's summary
    and checkpoint record it.
    """
    lr = config.lr
    pretrained_lr = type(config).pretrained_lr if pretrained_lr is None else pretrained_lr
    if lr is None:
        lr = scratch_lr(FROM_SCRATCH_LR if getattr(data, "from_scratch", False) else pretrained_lr, data)
    elif isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < float(lr) < float("inf"):
        raise UserError(f"{name}: lr must be a positive number (or unset for the model's default), got {lr!r}; "
                        f"fix it with --set lr={pretrained_lr:g}")
    config.lr = float(lr)
    return config.lr
