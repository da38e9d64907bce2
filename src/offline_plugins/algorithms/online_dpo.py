"""Online and iterative DPO as plugins (family ``online-llm``, data kind ``text-rollouts``).

Both sample ``group_size`` responses per prompt from the policy being trained (the
``text-rollouts`` collector), label them with the run's reward (the built-in verifier,
exact match against a JSONL file's answers, ``--reward module:function``), and train a
preference loss on one pair per prompt: chosen the best response, rejected the worst, no
pair where all rewards are equal
(:class:`~offline_plugins.objectives.llm.online_dpo.OnlinePreferenceLoss`). With ``judge``
(``--judge``: a registered judge, a rubric judge's model folder or ``MODULE:FUNCTION``) an AI
judge picks the pair instead, each comparison asked in both display orders
(:mod:`offline_plugins.eval.judge`).

* ``online-dpo`` (Guo et al. 2024, arXiv:2402.04792): small rounds (16 prompts), one pass
  over each round's fresh pairs, then the next round is sampled from the updated policy;
  the reference stays the run's reference.
* ``iterative-dpo`` (Xiong et al. 2024, arXiv:2312.11456; Yuan et al. 2024,
  arXiv:2401.10020): a larger round (128 prompts), ``epochs_per_round`` passes over its
  pairs (training "to convergence" on the round), then the trained policy samples the next
  round; ``update_reference=true`` makes the policy at each round boundary the reference of
  the next round's pairs.

The inner loss is any paired loss of the preference family (``--set inner=ipo``), with its
own hyperparameters (``--set beta=0.1``, ``--set tau=0.05``...), each defaulting to the
registered value of that algorithm (``offline-plugins info dpo``). KTO is refused: it reads
unpaired rows with a mismatched-prompt KL estimate that rollout groups do not carry.

``lr`` unset: the inner algorithm's rate for a pretrained or SFT reference (DPO 1e-5, ORPO and
RPO 3e-5), :data:`~offline_plugins.algorithms.preference.FROM_SCRATCH_LR` from the tiny
model's random init, as the offline preference runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import offline_plugins.algorithms.preference as preference
from offline_plugins.algorithms.llm import policy_and_reference, policy_log_probs, resolve_lr
from offline_plugins.algorithms.online import GeneratorFields, SamplingFields, rollout_generator, sync_check
from offline_plugins.config import ROLLOUT_DEFAULTS, config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.registry import builtin_hook, builtin_text_algorithm

__all__ = ["OnlineDPOConfig", "IterativeDPOConfig", "INNER_LOSSES", "build_online_dpo", "build_iterative_dpo"]

#: inner loss name -> (its config class in algorithms.preference, loss class, hyperparameters, loss terms)
INNER_LOSSES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "dpo": ("DPOConfig", "DPOLoss", ("beta", "label_smoothing"), ("loss_dpo",)),
    "robust-dpo": ("RobustDPOConfig", "RobustDPOLoss", ("beta", "label_smoothing"), ("loss_dpo",)),
    "rpo": ("RPOConfig", "RPOLoss", ("beta", "alpha"), ("loss_dpo", "loss_nll")),
    "ipo": ("IPOConfig", "IPOLoss", ("tau", "length_normalize"), ("loss_ipo",)),
    "orpo": ("ORPOConfig", "ORPOLoss", ("lam",), ("loss_nll", "loss_odds_ratio")),
    "simpo": ("SimPOConfig", "SimPOLoss", ("beta", "gamma"), ("loss_simpo",)),
}
_HYPER = ("beta", "label_smoothing", "tau", "length_normalize", "alpha", "lam", "gamma")


@dataclass
class _PreferenceRolloutFields(GeneratorFields, SamplingFields):
    inner: str = config_field("dpo", "the preference loss trained on the pairs: dpo, ipo, robust-dpo, rpo, orpo, "
                                     "simpo (kto is refused: it needs unpaired rows)")
    lr: Optional[float] = config_field(None, "Adam learning rate; unset: the inner algorithm's rate (dpo, ipo, "
                                             "simpo 1e-5; rpo, orpo 3e-5), 1e-3 for a built-in --model (tiny, small) from its random init")
    group_size: int = config_field(ROLLOUT_DEFAULTS["group_size"],
                                   "responses sampled per prompt (G >= 2): chosen the best, rejected the worst")
    dynamic_sampling: bool = config_field(False, "replace prompts whose G rewards are all equal (no pair) by newly "
                                                 "sampled ones, up to max_attempts batches of prompts")
    max_attempts: int = config_field(ROLLOUT_DEFAULTS["max_attempts"],
                                     "dynamic_sampling: batches of prompts sampled to fill a round with pairs")
    beta: Optional[float] = config_field(None, "inner dpo, robust-dpo, rpo: inverse temperature (unset 0.1); "
                                               "simpo: reward scale (unset 2.0)", bounds=">0")
    label_smoothing: Optional[float] = config_field(None, "inner dpo (cDPO, unset 0.0), robust-dpo (unset 0.1): "
                                                          "assumed label-flip rate")
    tau: Optional[float] = config_field(None, "inner ipo: regularisation, target gap 1 / (2 tau) (unset 0.1)")
    length_normalize: Optional[bool] = config_field(None, "inner ipo: average log-probs over tokens (unset true)")
    alpha: Optional[float] = config_field(None, "inner rpo: weight of the NLL term on the chosen (unset 1.0)")
    lam: Optional[float] = config_field(None, "inner orpo: weight of the odds-ratio term (unset 0.1)")
    gamma: Optional[float] = config_field(None, "inner simpo: target reward margin (unset 1.0)", bounds=">=0")
    judge: Optional[str] = config_field(None, "AI feedback: the judge that picks each prompt's pair instead of the "
                                              "reward (both display orders; --judge): a registered judge name "
                                              "('offline-plugins list'), a save_pretrained folder (a rubric judge) or "
                                              "MODULE:FUNCTION; unset: the reward")
    judge_ties: str = config_field("drop", "with a judge: a tie (position-inconsistent or no winner) is dropped "
                                           "(weight 0) or 'weight': kept, weighted by the judge's order-averaged "
                                           "confidence")


@dataclass
class OnlineDPOConfig(_PreferenceRolloutFields):
    batch_size: int = config_field(8, "pair slots per gradient step (must divide prompts_per_round: one slot per "
                                      "prompt, weight 0 where the prompt has no pair)")
    prompts_per_round: int = config_field(16, "prompts per round of fresh pairs")
    epochs_per_round: int = config_field(1, "passes over each round's pairs (1: each pair used once)")


@dataclass
class IterativeDPOConfig(_PreferenceRolloutFields):
    batch_size: int = config_field(16, "pair slots per gradient step (must divide prompts_per_round: one slot per "
                                       "prompt, weight 0 where the prompt has no pair)")
    prompts_per_round: int = config_field(128, "prompts per round (iteration) of pairs")
    epochs_per_round: int = config_field(4, "passes over each round's pairs: training on the round 'to "
                                            "convergence', a fixed number of epochs")
    update_reference: bool = config_field(False, "the policy at each round boundary becomes the reference of that "
                                                 "round's pairs (false: the run's reference throughout)")


def _inner_kwargs(config: Any, name: str) -> tuple[str, dict, tuple[str, ...], Any]:
    """``(loss class name, kwargs, loss terms, inner config class)`` of ``config.inner``, or a ``UserError``."""
    inner = str(config.inner).strip().lower()
    choices = ", ".join(INNER_LOSSES)
    if inner == "kto":
        raise UserError(f"{name}: inner=kto is not supported: KTO reads unpaired rows with a mismatched-prompt KL "
                        f"estimate that rollout groups do not carry; use a paired loss ({choices}), e.g. --set "
                        "inner=dpo")
    if inner not in INNER_LOSSES:
        raise UserError(f"{name}: unknown inner loss {config.inner!r}; choose one of {choices} "
                        "(e.g. --set inner=ipo)")
    cfg_name, loss_cls, hyper, terms = INNER_LOSSES[inner]
    inner_cfg = getattr(preference, cfg_name)
    defaults = inner_cfg()
    stray = [h for h in _HYPER if getattr(config, h) is not None and h not in hyper]
    if stray:
        raise UserError(f"{name}: {', '.join(stray)} {'is' if len(stray) == 1 else 'are'} not "
                        f"{'a hyperparameter' if len(stray) == 1 else 'hyperparameters'} of inner={inner} (it reads "
                        f"{', '.join(hyper)}); drop --set {stray[0]}=... or choose another inner loss")
    kwargs = {}
    for h in hyper:
        value = getattr(config, h)
        if value is None:
            value = getattr(defaults, h)
        elif h == "length_normalize":
            if not isinstance(value, bool):
                raise UserError(f"{name}: length_normalize must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise UserError(f"{name}: {h} must be a number, got {value!r}; fix it with --set {h}="
                            f"{getattr(defaults, h)}")
        kwargs[h] = value
    config.inner = inner
    return loss_cls, kwargs, terms, inner_cfg


def _build(config: Any, data: Any, name: str, *, reference: str):
    import offline_plugins.objectives.llm as llm
    from offline_plugins.algorithms._glue import require_rollouts
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, RolloutPlan
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss

    require_rollouts(data, name)
    loss_cls, kwargs, terms, inner_cfg = _inner_kwargs(config, name)
    generator = rollout_generator(config, data, name)
    resolve_lr(config, data, name, inner_cfg.pretrained_lr)
    policy, ref_model = policy_and_reference(config, data, name)
    actor = policy_log_probs(config, policy, name)
    try:
        inner = getattr(llm, loss_cls)(actor, reduction="none", **kwargs)
    except ValueError as exc:
        raise UserError(f"{name}: inner={config.inner}: {exc}") from None
    judge = None
    if config.judge is not None:
        from offline_plugins.eval.judge import judge_from
        from offline_plugins.objectives.llm.online_dpo import JUDGE_TIES

        if config.judge_ties not in JUDGE_TIES:
            raise UserError(f"{name}: judge_ties must be one of {', '.join(JUDGE_TIES)}, got {config.judge_ties!r}; "
                            "fix it with --set judge_ties=drop")
        judge = judge_from(str(config.judge))
    loss = OnlinePreferenceLoss(inner, group_size=data.settings.group_size, reference=reference,
                                dynamic_sampling=bool(config.dynamic_sampling), judge=judge,
                                judge_ties=config.judge_ties)
    group = OptimizerGroup("policy", list(policy.parameters()), config.lr, terms, max_grad_norm=config.max_grad_norm)
    # one pair slot per prompt: the round's training rows are [prompts_per_round, 2]
    rollout = RolloutPlan.of(loss, epochs=config.epochs_per_round, epochs_field="epochs_per_round",
                             training_rows=loss.pair_rollouts, rows_per_round=data.settings.prompts_per_round,
                             rows_what="preference-pair slots (one per prompt of prompts_per_round)",
                             reference=ref_model, generator=generator, sync_check=sync_check(config, generator, name))
    return AlgorithmParts(loss=loss, policy=actor, optimizers=[group], model=policy, tokenizer=data.tokenizer,
                          rollout=rollout)


def build_online_dpo(config: OnlineDPOConfig, data: Any):
    """Online DPO: fresh best-vs-worst pairs each round, the run's reference throughout."""
    return _build(config, data, "online-dpo", reference="initial")


def build_iterative_dpo(config: IterativeDPOConfig, data: Any):
    """Iterative DPO: a round of pairs trained for ``epochs_per_round`` passes, optionally re-referenced."""
    return _build(config, data, "iterative-dpo", reference="sampler" if config.update_reference else "initial")


_SPECS = (
    ("online-dpo", "Online DPO: best-vs-worst pairs of the policy's own samples, labelled by the reward, one pass "
     "each (any paired preference loss inside)", "build_online_dpo", OnlineDPOConfig,
     "Guo et al. 2024, Direct Language Model Alignment from Online AI Feedback, arXiv:2402.04792"),
    ("iterative-dpo", "Iterative DPO: a round of self-sampled pairs trained for several epochs, the trained policy "
     "samples (and optionally references) the next round", "build_iterative_dpo", IterativeDPOConfig,
     "Xiong et al. 2024, Iterative Preference Learning from Human Feedback, arXiv:2312.11456; Yuan et al. 2024, "
     "Self-Rewarding Language Models, arXiv:2401.10020"),
)


offline_plugins_register_algorithms = builtin_hook(*(
    builtin_text_algorithm(name, summary, config, paper, loss="online_dpo:OnlinePreferenceLoss",
                           build=f"online_dpo:{build}")
    for name, summary, build, config, paper in _SPECS))
