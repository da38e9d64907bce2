"""Online RL on text as plugins: GRPO, DAPO, Dr. GRPO, RLOO, CISPO, GSPO, expert iteration (family ``online-llm``).

Each ``build(config, data)`` takes a :class:`~offline_plugins.text.data.rollouts.RolloutData`
(prompts, reward, the frozen reference, the sampling settings) and returns the loss of
:mod:`offline_plugins.objectives.llm.online` around a trainable copy of the reference (the
policy starts at the reference), with the round's
:class:`~offline_plugins.algorithms.base.RolloutPlan` (``AlgorithmParts.rollout``). The
rollouts are sampled while training, by the ``text-rollouts`` kind's data module
(:class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`).

The config fields the kind reads (``group_size``, ``prompts_per_round``, ``ppo_epochs``,
``max_new_tokens``, ``temperature``, ``top_p``, ``batch_size``, ``reference_sft_steps``,
``eval_prompts``) are declared here (:class:`SamplingFields` and each config), their
defaults read from :data:`~offline_plugins.config.ROLLOUT_DEFAULTS`.

``generator`` (:class:`GeneratorFields`, ``--generator``) says what samples the rounds: the
policy's transformers ``generate`` (``hf``) or an in-process vLLM engine (``vllm``,
:func:`rollout_generator`, which also turns the rollout correction on at
:data:`VLLM_ROLLOUT_CORRECTION` where the config leaves it unset).

``lr`` defaults to ``None``: the algorithm's rate for a pretrained or SFT reference, and
:data:`~offline_plugins.algorithms.preference.FROM_SCRATCH_LR` for the tiny model at its
random initialisation (a JSONL task with a built-in ``--model``: tiny, small).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from offline_plugins.algorithms.llm import LoRAFields, lr_help, policy_and_reference, policy_log_probs, resolve_lr
from offline_plugins.config import ROLLOUT_DEFAULTS as _D
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.registry import builtin_hook, builtin_text_algorithm

__all__ = ["GeneratorFields", "rollout_generator", "sync_check", "VLLM_ROLLOUT_CORRECTION", "SFTConfig", "GRPOConfig", "DAPOConfig", "DrGRPOConfig", "RLOOConfig", "CISPOConfig", "GSPOConfig",
           "ExpertIterationConfig"]


def _lr_help(pretrained: float) -> str:
    return lr_help(pretrained, source="a .jsonl task")


@dataclass
class SamplingFields(LoRAFields):
    """The sampling and reference fields every online algorithm's config shares (defaults:
    :data:`~offline_plugins.config.ROLLOUT_DEFAULTS`)."""

    max_grad_norm: float = config_field(1.0, "clip the policy's gradient norm to this")
    max_new_tokens: Optional[int] = config_field(
        _D["max_new_tokens"], "response budget in tokens; unset: the task's own (arithmetic 6, arithmetic-length 12, "
        "steps-arithmetic 32, tool-arithmetic 40, tool-python 56; a prompt file 6)")
    temperature: float = config_field(_D["temperature"], "sampling temperature", bounds=">0")
    top_p: float = config_field(_D["top_p"], "nucleus sampling threshold (1.0: off)")
    reference_sft_steps: Optional[int] = config_field(
        _D["reference_sft_steps"], "built-in task with a built-in --model (tiny, small): SFT steps of the cached "
        "reference; unset: the task's own (arithmetic 2000, tool-arithmetic and tool-python 130, steps-arithmetic 800)")
    eval_prompts: int = config_field(_D["eval_prompts"], "held-out prompts scored by greedy exact match")
    reward_timeout: float = config_field(_D["reward_timeout"], "seconds one call of the reward function may take; a "
                                         "response whose call raises, exits or runs past it is counted and gets "
                                         "reward_on_failure (0: no limit)")
    reward_on_failure: float = config_field(_D["reward_on_failure"], "reward of a response its reward call failed on")
    reward_workers: str = config_field(_D["reward_workers"], "where the reward function's calls run: thread, or "
                                       "process (a call past reward_timeout is killed with its process; the function "
                                       "must be importable as module:function)")
    max_turns: Optional[int] = config_field(_D["max_turns"], "multi-turn tasks: turns per episode (unset: the "
                                            "task's, 3 for tool-arithmetic)", bounds=">=1")
    tools: Optional[str] = config_field(_D["tools"], "multi-turn tasks: the tools the policy may call, comma-"
                                        "separated, of calculator and python (unset: the task's)")
    tool_timeout: float = config_field(_D["tool_timeout"], "multi-turn tasks: seconds one Python tool call may take",
                                       bounds=">0")
    tool_sandbox: Optional[str] = config_field(_D["tool_sandbox"], "multi-turn tasks with the python tool: the "
                                               "sandbox its code runs in (unset: bwrap, which must be installed; "
                                               "unsafe-subprocess: no isolation, warned; a plugin's: 'offline-plugins "
                                               "list')")
    reward_weights: Optional[str] = config_field(
        _D["reward_weights"], "several rewards (--reward NAME=SPEC twice or more): the weight of each in the order "
        "of the --reward flags, comma-separated (e.g. 1,0.5); the rollouts' reward is their weighted sum (gdpo "
        "weighs each one's group-standardised advantage instead); unset: all 1")
    tool_reward: float = config_field(_D["tool_reward"], "multi-turn tasks: the reward of a turn whose tool call "
                                      "answered the problem, on that turn's last token (0: the verifier's reward at "
                                      "the end only)")


@dataclass
class GeneratorFields:
    """What samples the rounds (``--generator``): the policy's own transformers ``generate``, or an
    in-process vLLM engine that follows the policy's weights
    (:class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`)."""

    generator: str = config_field("hf", "what samples the rollouts: hf (the policy's transformers generate) or "
                                        "vllm (an in-process vLLM engine, the weights loaded every sync_every "
                                        "steps; pip install 'offline-plugins[vllm]')")
    sync_every: int = config_field(1, "generator=vllm: optimiser steps between loads of the policy's weights into "
                                      "the engine (1: every round samples from the current policy)", bounds=">=1")
    sync_check_every: Optional[int] = config_field(
        None, "rounds between live checks that the sampler holds the trainer's weights (its log-probs of its own "
              "tokens against the trainer's, on a round sampled right after a weight load); unset: 10 with "
              "generator=vllm, off with hf; 0: off", bounds=">=0")
    sync_check_warn: float = config_field(0.05, "sync check: warn above this mean absolute log-prob gap per token "
                                                "(nats)", bounds=">0")
    sync_check_stop: float = config_field(0.5, "sync check: stop the run above this mean absolute log-prob gap per "
                                               "token (nats)", bounds=">0")


#: the rollout correction's cap when the generator is vLLM and the config leaves it unset (TRL's and
#: verl's truncated importance sampling: the engine's kernels need not give the trainer's log-probs)
VLLM_ROLLOUT_CORRECTION = 2.0


def sync_check(config: Any, generator: Optional[Any], name: str) -> Optional[Any]:
    """The run's :class:`~offline_plugins.text.collectors.sync_check.SyncCheck` (``sync_check_every`` and its
    thresholds; unset: every :data:`~offline_plugins.text.collectors.sync_check.SYNC_CHECK_EVERY_VLLM` rounds with a
    generator, off without one), or None when off."""
    from offline_plugins.text.collectors.sync_check import SYNC_CHECK_EVERY_VLLM, SyncCheck

    every = getattr(config, "sync_check_every", None)
    if every is None:
        overlapped = bool(getattr(config, "async_rollouts", False))
        every = SYNC_CHECK_EVERY_VLLM if generator is not None or overlapped else 0
    if not every:
        return None
    try:
        return SyncCheck(every=every, warn=float(getattr(config, "sync_check_warn", 0.05)),
                         stop=float(getattr(config, "sync_check_stop", 0.5)),
                         sampler="--generator vllm" if generator is not None else (
                             "the async sampler" if getattr(config, "async_rollouts", False) else "the policy's generate"))
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def rollout_generator(config: Any, data: Any, name: str) -> Optional[Any]:
    """The generator ``config.generator`` names: None for ``hf`` (the collector's transformers
    ``generate``), a :class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator` for ``vllm``,
    checked here (vLLM importable, the reference's architecture one it loads) so that a bad
    ``--generator`` is refused before training; its engine starts with the first round. With
    ``vllm`` an unset ``rollout_correction`` becomes :data:`VLLM_ROLLOUT_CORRECTION`."""
    from offline_plugins.text.backends.vllm_engine import GENERATORS

    value = str(getattr(config, "generator", "hf")).strip().lower()
    if value not in GENERATORS:
        raise UserError(f"{name}: generator must be one of {', '.join(GENERATORS)}, got {config.generator!r}; "
                        "fix it with --generator hf (the default) or --generator vllm")
    config.generator = value
    if value == "hf":
        return None
    from offline_plugins.text.backends.vllm_engine import VLLMGenerator, vllm_architecture

    vllm_architecture(data.reference, f"{name}: --generator vllm")
    if hasattr(config, "rollout_correction") and config.rollout_correction is None:
        config.rollout_correction = VLLM_ROLLOUT_CORRECTION
    return VLLMGenerator(sync_every=config.sync_every, name=f"{name}: --generator vllm")


@dataclass
class _RolloutFields(SamplingFields):
    pretrained_lr: ClassVar[float] = 1e-4
    lr: Optional[float] = config_field(None, _lr_help(1e-4))
    batch_size: int = config_field(_D["batch_size"], "rollouts per gradient step (must divide prompts_per_round * "
                                                     "group_size)")
    group_size: int = config_field(_D["group_size"], "responses sampled per prompt (G >= 2)")
    prompts_per_round: int = config_field(_D["prompts_per_round"], "prompts per round of rollouts")
    ppo_epochs: int = config_field(_D["ppo_epochs"], "passes over each round's rollouts (PPO-style reuse)")


@dataclass
class _PolicyGradientFields(GeneratorFields, _RolloutFields):
    rollout_correction: Optional[float] = config_field(
        None, "cap of the truncated importance weight pi_trainer / pi_sampler per token when the sampler's "
              "log-probs differ from the trainer's (e.g. 2.0, as TRL and verl); unset: off, or 2.0 with "
              "generator=vllm")
    token_baseline: str = config_field(
        "group", "the advantage's baseline: group (the algorithm's own, per response) or optimal (the optimal "
                 "token baseline, arXiv:2602.07078: per position of each group, weighted by each response's "
                 "score norm; one more policy forward a round)")
    unbiased_kl: bool = config_field(
        False, "the KL term as DeepSeek-V3.2's estimate (k3 times pi / pi_sample, arXiv:2512.02556): its "
               "gradient stays the KL's when the policy has moved from the sampler")
    off_policy_mask: Optional[float] = config_field(
        None, "DeepSeek-V3.2's off-policy sequence masking: leave out responses with a negative advantage whose "
              "mean log(pi_sample / pi) exceeds this (arXiv:2512.02556; unset: off)", bounds=">=0")
    async_rollouts: bool = config_field(
        False, "sample the next round of rollouts in a worker process while the current one trains (one CPU "
               "device; with generator=vllm the worker runs the engine); turns the rollout correction on (2.0) "
               "unless set")
    max_staleness: Optional[int] = config_field(
        None, "async_rollouts: the most optimiser steps the sampling weights may lag the policy that trains on "
              "the round (0: no overlap); unset: one round's updates (the whole round overlapped)", bounds=">=0")


@dataclass
class _ClippedRatioFields(_PolicyGradientFields):
    clip_epsilon: float = config_field(0.2, "PPO ratio clipping")


@dataclass
class _NoKLFields(_PolicyGradientFields):
    beta: float = config_field(0.0, "weight of the k3 KL to the reference")


@dataclass
class _ClippedNoKLFields(_NoKLFields, _ClippedRatioFields):
    pass


@dataclass
class GRPOConfig(_ClippedRatioFields):
    beta: float = config_field(0.04, "weight of the k3 KL to the reference (0: no KL term)")


@dataclass
class DAPOConfig(_PolicyGradientFields):
    clip_low: float = config_field(0.2, "ratio clipping below (1 - clip_low)")
    clip_high: float = config_field(0.28, "ratio clipping above (1 + clip_high): clip-higher")
    beta: float = config_field(0.0, "weight of the k3 KL to the reference (DAPO drops it)")
    overlong_cache: int = config_field(2, "soft overlong penalty over the last this many tokens of max_new_tokens "
                                          "(0: off)")
    max_attempts: int = config_field(4, "dynamic sampling: batches of prompts sampled to fill a round with groups "
                                        "whose rewards differ")


@dataclass
class DrGRPOConfig(_ClippedNoKLFields):
    pass


@dataclass
class RLOOConfig(_ClippedRatioFields):
    beta: float = config_field(0.05, "weight of the sequence-level KL subtracted from the reward")


@dataclass
class CISPOConfig(_PolicyGradientFields):
    clip_low: float = config_field(0.2, "importance weight clipped below at 1 - clip_low (TorchRL CISPOLoss's 0.2; "
                                        "the paper sets no lower bound: 0.99)")
    clip_high: float = config_field(0.2, "importance weight clipped above at 1 + clip_high (TorchRL CISPOLoss's 0.2)")
    beta: float = config_field(0.0, "weight of the k3 KL to the reference (0: MiniMax-M1's objective has none)")


@dataclass
class GSPOConfig(_PolicyGradientFields):
    clip_low: float = config_field(3e-4, "sequence ratio clipped below at 1 - clip_low (GSPO paper v2, sec. 5.1)")
    clip_high: float = config_field(4e-4, "sequence ratio clipped above at 1 + clip_high (GSPO paper v2, sec. 5.1)")
    beta: float = config_field(0.0, "weight of the k3 KL to the reference (0, as the GSPO paper's setting in "
                                    "TRL's paper index)")


@dataclass
class SAPOConfig(_NoKLFields):
    tau_pos: float = config_field(1.0, "gate temperature where the advantage is positive (verl's and ms-swift's "
                                       "SAPO default)", bounds=">0")
    tau_neg: float = config_field(1.05, "gate temperature where the advantage is not positive (verl's and "
                                        "ms-swift's SAPO default)", bounds=">0")


@dataclass
class GMPOConfig(_NoKLFields):
    clip_low: float = config_field(0.4, "log-ratio clipped below at -clip_low where the advantage is negative "
                                        "(log space: ratios down to e^-0.4, the paper's sec. 4)")
    clip_high: float = config_field(0.4, "log-ratio clipped above at clip_high where the advantage is positive "
                                         "(log space: ratios up to e^0.4)")


@dataclass
class DPPOConfig(_NoKLFields):
    tv_low: float = config_field(0.15, "a token counts where its probability fell by at most this (advantage "
                                       "< 0); verl's DPPO-TV recipe", bounds="(0,1)")
    tv_high: float = config_field(0.15, "a token counts where its probability rose by at most this (advantage "
                                        "> 0); verl's DPPO-TV recipe", bounds=">0")
    cap: float = config_field(20.0, "the detached importance weight is truncated at this", bounds=">=1")


@dataclass
class GDPOConfig(_ClippedNoKLFields):
    pass


@dataclass
class MaxRLConfig(_ClippedNoKLFields):
    pass


@dataclass
class LUSPOConfig(GSPOConfig):
    pass


@dataclass
class VESPOConfig(_NoKLFields):
    k_pos: float = config_field(2.0, "shape k of the weight phi(w) = w^k exp(lambda (1 - w)) where the advantage "
                                     "is not negative (the VESPO paper's training scripts)", bounds=">=0")
    lam_pos: float = config_field(3.0, "rate lambda of phi where the advantage is not negative", bounds=">0")
    k_neg: float = config_field(3.0, "shape k of phi where the advantage is negative", bounds=">=0")
    lam_neg: float = config_field(2.0, "rate lambda of phi where the advantage is negative", bounds=">0")


@dataclass
class REINFORCEPPConfig(_ClippedRatioFields):
    beta: float = config_field(0.01, "weight of the k1 KL to the reference in the reward (token by token for "
                                     "reinforce-pp, per response for reinforce-pp-baseline)")


@dataclass
class ExpertIterationConfig(GeneratorFields, _RolloutFields):
    # 1e-4, as the GRPO family: at 3e-4 (the earlier default, chosen on tiny's arithmetic reference) the word
    # problems' small reference lost its reward within a few rounds (0.20 -> 0.05 in 24 steps, 0 % held out after
    # 200); at 1e-4 it rose (0.20 -> 0.38 in 24 steps), at 3e-5 too (-> 0.32), seed 0
    pretrained_lr: ClassVar[float] = 1e-4
    lr: Optional[float] = config_field(None, _lr_help(1e-4))
    threshold: float = config_field(1.0, "reward a sampled response must reach to be kept for fine-tuning")


@dataclass
class SFTConfig(LoRAFields):
    pretrained_lr: ClassVar[float] = 1e-4
    #: the SFT reference recipe of the preference results (text/data/task_data.py)
    from_scratch_lr: ClassVar[float] = 3e-3
    lr: Optional[float] = config_field(None, "Adam learning rate; unset: 1e-4 for a pretrained model, 3e-3 for "
                                             "--model tiny and 1e-3 for small from their random init")
    batch_size: int = config_field(64, "prompt/completion rows per gradient step")
    max_grad_norm: float = config_field(1.0, "clip the gradient norm to this")
    max_length: int = config_field(32, "token budget of prompt + completion")
    eval_prompts: int = config_field(200, "held-out rows scored by greedy exact match")


def build_sft(config: SFTConfig, data: Any):
    """Supervised fine-tuning of a trainable copy of ``data.reference`` (or LoRA adapters on it) on the
    completions."""
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
    from offline_plugins.objectives.llm.online import TextSFTLoss

    if not hasattr(data, "held_out_rows"):
        raise UserError(f"sft trains on prompt/completion rows: give it a CompletionData "
                        f"(offline_plugins.text.data.rollouts.load_completion_data), not a {type(data).__name__}")
    if config.lr is None:
        from offline_plugins.modules.tiny_lm import from_scratch_lr

        config.lr = (from_scratch_lr(SFTConfig.from_scratch_lr, getattr(data, "model", "tiny")) if data.from_scratch
                     else SFTConfig.pretrained_lr)
    elif isinstance(config.lr, bool) or not isinstance(config.lr, (int, float)) or not config.lr > 0:
        raise UserError(f"sft: lr must be a positive number, got {config.lr!r}; fix it with --set lr=1e-4")
    policy, _ = policy_and_reference(config, data, "sft")
    actor = policy_log_probs(config, policy, "sft")
    group = OptimizerGroup("policy", list(policy.parameters()), float(config.lr), ("loss_nll",),
                           max_grad_norm=config.max_grad_norm)
    return AlgorithmParts(loss=TextSFTLoss(actor), policy=actor, optimizers=[group], model=policy,
                          tokenizer=data.tokenizer)


def _parts(config: Any, data: Any, name: str, loss_cls: str, kwargs: dict):
    import offline_plugins.objectives.llm.online as online
    import offline_plugins.objectives.llm.online_variants as online_variants
    from offline_plugins.algorithms._glue import require_rollouts
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, RolloutPlan

    require_rollouts(data, name)
    generator = rollout_generator(config, data, name)
    policy, reference = policy_and_reference(config, data, name)
    actor = policy_log_probs(config, policy, name)
    staleness = async_staleness(config, generator, name)
    if isinstance(config, _PolicyGradientFields):
        kwargs.update(rollout_correction=config.rollout_correction, token_baseline=str(config.token_baseline),
                      unbiased_kl=bool(config.unbiased_kl), off_policy_mask=config.off_policy_mask)
    try:
        module = online_variants if loss_cls in online_variants.__all__ else online
        loss = (loss_cls if isinstance(loss_cls, type) else getattr(module, loss_cls))(actor, **kwargs)
    except ValueError as exc:
        raise UserError(f"{name}: {exc}; set it with --set KEY=VALUE ('offline-plugins info {name}' lists the "
                        "fields and their defaults)") from None
    group = OptimizerGroup("policy", list(policy.parameters()), resolve_lr(config, data, name), loss.optimised_terms,
                           max_grad_norm=config.max_grad_norm)
    return AlgorithmParts(loss=loss, policy=actor, optimizers=[group], model=policy, tokenizer=data.tokenizer,
                          rollout=RolloutPlan.of(loss, epochs=config.ppo_epochs, reference=reference,
                                                 generator=generator, sync_check=sync_check(config, generator, name),
                                                 max_staleness=staleness))


def async_staleness(config: Any, generator: Optional[Any], name: str) -> Optional[int]:
    """``max_staleness`` when ``config.async_rollouts`` (-1: unset, one round's updates), else None; with
    async rollouts an unset ``rollout_correction`` becomes :data:`VLLM_ROLLOUT_CORRECTION` (the sampler's
    weights lag the trainer's). Bad settings: a ``UserError`` naming them."""
    on = getattr(config, "async_rollouts", False)
    if not isinstance(on, bool):
        raise UserError(f"{name}: async_rollouts must be true or false, got {on!r}")
    k = getattr(config, "max_staleness", None)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise UserError(f"{name}: max_staleness is the most optimiser steps the sampling weights may lag the "
                        f"policy, a whole number >= 0, got {k!r}; e.g. --set max_staleness=4")
    if not on:
        if k is not None:
            raise UserError(f"{name}: max_staleness bounds the overlapped rollouts of --set async_rollouts=true, "
                            "which this run does not use; add it or drop max_staleness")
        return None
    if getattr(config, "rollout_correction", None) is None:
        config.rollout_correction = VLLM_ROLLOUT_CORRECTION
    return -1 if k is None else int(k)


def _builder(name: str, loss: str, kwargs: Callable[[Any], dict]) -> Callable[[Any, Any], Any]:
    """``build(config, data)`` of an online algorithm whose loss takes ``kwargs(config)`` (and the shared
    fields :func:`_parts` adds)."""
    def build(config: Any, data: Any):
        return _parts(config, data, name, loss, kwargs(config))

    build.__name__ = build.__qualname__ = f"build_{name.replace('-', '_')}"
    build.__doc__ = f"The parts of ``{name}``: :class:`{loss}` on a trainable copy of the reference."
    return build


def _one_clip(c: Any) -> dict:
    return {"clip_epsilon": c.clip_epsilon, "beta": c.beta}


def _two_clips(c: Any) -> dict:
    return {"clip_epsilon": (c.clip_low, c.clip_high), "beta": c.beta}


build_grpo = _builder("grpo", "TextGRPOLoss", _one_clip)
build_dapo = _builder("dapo", "DAPOLoss", lambda c: {**_two_clips(c), "max_new_tokens": c.max_new_tokens,
                                                     "overlong_cache": c.overlong_cache})
build_dr_grpo = _builder("dr-grpo", "DrGRPOLoss", lambda c: {**_one_clip(c), "length_normalizer": c.max_new_tokens})
build_rloo = _builder("rloo", "RLOOLoss", _one_clip)
build_cispo = _builder("cispo", "TextCISPOLoss", _two_clips)
build_gspo = _builder("gspo", "TextGSPOLoss", _two_clips)
build_sapo = _builder("sapo", "TextSAPOLoss", lambda c: {"tau_pos": c.tau_pos, "tau_neg": c.tau_neg, "beta": c.beta})
build_gmpo = _builder("gmpo", "TextGMPOLoss", _two_clips)
build_dppo = _builder("dppo", "TextDPPOLoss", lambda c: {"clip_epsilon": (c.tv_low, c.tv_high), "cap": c.cap,
                                                         "beta": c.beta})
build_reinforce_pp = _builder("reinforce-pp", "REINFORCEPPLoss", _one_clip)
build_reinforce_pp_baseline = _builder("reinforce-pp-baseline", "REINFORCEPPBaselineLoss", _one_clip)
build_maxrl = _builder("maxrl", "TextMaxRLLoss", _one_clip)
build_luspo = _builder("luspo", "TextLUSPOLoss", _two_clips)
build_vespo = _builder("vespo", "TextVESPOLoss", lambda c: {"k_pos": c.k_pos, "lam_pos": c.lam_pos, "k_neg": c.k_neg,
                                                            "lam_neg": c.lam_neg, "beta": c.beta})
build_expert_iteration = _builder("expert-iteration", "ExpertIterationLoss", lambda c: {"threshold": c.threshold})


def build_gdpo(config: GDPOConfig, data: Any):
    """The parts of ``gdpo``: :class:`TextGDPOLoss` over the run's several rewards, with their weights."""
    source = getattr(data, "source", None)
    names = list(getattr(source, "reward_names", None) or [])
    if len(names) < 2:
        raise UserError("gdpo combines several rewards, each standardised on its own, and this run has one: give "
                        "two or more as --reward NAME=SPEC, e.g. --reward correct=task "
                        "--reward format=offline_plugins.text.tasks.word_problems:answer_format")
    return _parts(config, data, "gdpo", "TextGDPOLoss", {**_one_clip(config),
                                                          "reward_weights": list(source.reward_weights)})


_SPECS = (
    ("sft", "Supervised fine-tuning on prompt/completion rows: the LLM's behaviour cloning, makes a reference",
     "TextSFTLoss", "build_sft", SFTConfig, "Ouyang et al. 2022, Training language models to follow instructions "
     "with human feedback, arXiv:2203.02155"),
    ("grpo", "Group Relative Policy Optimization: group-normalised advantages, clipped ratio, k3 KL",
     "TextGRPOLoss", "build_grpo", GRPOConfig,
     "Shao et al. 2024, DeepSeekMath: Pushing the Limits of Mathematical Reasoning, arXiv:2402.03300"),
    ("dapo", "DAPO: clip-higher, token-level loss, dynamic sampling, overlong penalty", "DAPOLoss", "build_dapo",
     DAPOConfig, "Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale, arXiv:2503.14476"),
    ("dr-grpo", "Dr. GRPO: GRPO without std scaling, constant length normaliser", "DrGRPOLoss", "build_dr_grpo",
     DrGRPOConfig, "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective, arXiv:2503.20783"),
    ("rloo", "REINFORCE leave-one-out: baseline from the group's other responses, KL in the reward", "RLOOLoss",
     "build_rloo", RLOOConfig, "Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization "
     "for Learning from Human Feedback in LLMs, arXiv:2402.14740"),
    ("cispo", "CISPO: clipped, detached importance weight times the log-prob, every token kept", "TextCISPOLoss",
     "build_cispo", CISPOConfig, "MiniMax 2025, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning "
     "Attention, arXiv:2506.13585"),
    ("gspo", "GSPO: one clipped importance ratio per response (geometric mean of its tokens')", "TextGSPOLoss",
     "build_gspo", GSPOConfig, "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071"),
    ("sapo", "SAPO: a soft, temperature-controlled gate of the ratio in place of the hard clip", "TextSAPOLoss",
     "build_sapo", SAPOConfig, "Soft Adaptive Policy Optimization (Qwen team), 2025, arXiv:2511.20347"),
    ("gmpo", "GMPO: the geometric mean of the tokens' ratios, clipped token by token in log space",
     "TextGMPOLoss", "build_gmpo", GMPOConfig,
     "Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673"),
    ("dppo", "DPPO (Binary-TV): the trust region on each token's probability change, not its ratio",
     "TextDPPOLoss", "build_dppo", DPPOConfig,
     "Rethinking the Trust Region in LLM Reinforcement Learning, 2026, arXiv:2602.04879"),
    ("gdpo", "GDPO: several rewards, each standardised within its group, then summed and standardised",
     "online_variants:TextGDPOLoss", "build_gdpo", GDPOConfig, "Liu et al. 2026, GDPO: Group reward-Decoupled Normalization Policy "
     "Optimization for Multi-reward RL Optimization, arXiv:2601.05242"),
    ("maxrl", "MaxRL: the advantage (r - mean) / mean, the gradient of the log success probability",
     "online_variants:TextMaxRLLoss", "build_maxrl", MaxRLConfig,
     "Maximum Likelihood Reinforcement Learning, arXiv:2602.02710"),
    ("luspo", "LUSPO: GSPO with each response's sequence term weighted by its length", "online_variants:TextLUSPOLoss",
     "build_luspo", LUSPOConfig, "Liu et al. 2026, Length-Unbiased Sequence Policy Optimization, arXiv:2602.05261"),
    ("vespo", "VESPO: REINFORCE weighted by a smooth reshaping of each response's whole importance ratio",
     "online_variants:TextVESPOLoss", "build_vespo", VESPOConfig, "Shen et al. 2026, VESPO: Variational Sequence-Level Soft Policy "
     "Optimization for Stable Off-Policy LLM Training, arXiv:2602.10693"),
    ("reinforce-pp", "REINFORCE++: token-level KL in the reward, advantages normalised over the round, no critic",
     "REINFORCEPPLoss", "build_reinforce_pp", REINFORCEPPConfig,
     "Hu et al. 2025, REINFORCE++, arXiv:2501.03262"),
    ("reinforce-pp-baseline", "REINFORCE++-baseline: the group's mean reward as baseline, the round's std as scale",
     "REINFORCEPPBaselineLoss", "build_reinforce_pp_baseline", REINFORCEPPConfig,
     "Hu et al. 2025, REINFORCE++, arXiv:2501.03262 (the baseline variant)"),
    ("expert-iteration", "Expert iteration / STaR: fine-tune on sampled responses that pass, repeat",
     "ExpertIterationLoss", "build_expert_iteration", ExpertIterationConfig,
     "Zelikman et al. 2022, STaR: Bootstrapping Reasoning With Reasoning, arXiv:2203.14465"),
)


offline_plugins_register_algorithms = builtin_hook(*(
    builtin_text_algorithm(name, summary, config, paper, loss=loss if ":" in loss else f"online:{loss}",
                           build=f"online:{build}",
                           data="text-completions" if name == "sft" else "text-rollouts")
    for name, summary, loss, build, config, paper in _SPECS))
