"""On-policy distillation as plugins: ``opd`` (reverse KL) and ``gkd`` (generalised JSD), family ``online-llm``.

The student is the run's ``--model`` (a trainable copy of it, as every online algorithm's
policy); it samples its own responses in the ``text-rollouts`` round (the same round, resume,
checkpoints and loggers as GRPO) and descends a divergence from a frozen teacher's next-token
distributions on them (:mod:`offline_plugins.objectives.llm.distill`). The teacher is
``--set teacher=PATH``, any ``save_pretrained`` folder (model and tokenizer) whose tokenizer
is the student's: loaded once, frozen, in eval mode, on the student's device. A teacher with
another vocabulary is refused by name. The task's reward is still computed each round (the
``rollout/reward_mean`` of the student's samples) but trains nothing.

GKD's ``lambda`` (the share of batches of student samples against fixed data) is 1 here:
every batch is the student's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from offline_plugins.algorithms.llm import policy_and_reference, policy_log_probs, resolve_lr
from offline_plugins.algorithms.online import GeneratorFields, _RolloutFields, rollout_generator, sync_check
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.registry import builtin_hook, builtin_text_algorithm

__all__ = ["OPDConfig", "GKDConfig", "load_teacher", "build_opd", "build_gkd"]


@dataclass
class _DistillationFields(GeneratorFields, _RolloutFields):
    pretrained_lr: ClassVar[float] = 1e-4
    lr: Optional[float] = config_field(None, "Adam learning rate of the student; unset: 1e-4 (1e-3 for --model "
                                             "tiny from its random init, a .jsonl task)")
    teacher: str = config_field("", "the teacher: a save_pretrained folder (model and tokenizer) with the "
                                    "student's tokenizer, e.g. an sft run's OUT/model (required)")
    group_size: int = config_field(1, "responses sampled per prompt (distillation needs no groups)")
    prompts_per_round: int = config_field(32, "prompts per round of the student's samples")
    batch_size: int = config_field(32, "sampled responses per gradient step (must divide prompts_per_round * "
                                       "group_size; equal to it: every step on fresh samples)")


@dataclass
class OPDConfig(_DistillationFields):
    pass


@dataclass
class GKDConfig(_DistillationFields):
    beta: float = config_field(0.5, "generalised JSD interpolation: 0 the forward KL(teacher || student), 1 the "
                                    "reverse KL(student || teacher) (TRL GKDConfig's 0.5)", bounds="[0,1]")


def load_teacher(config: Any, data: Any, name: str) -> Any:
    """The teacher model of ``config.teacher``, frozen and in eval mode, or a ``UserError`` naming
    the folder: none given, one that does not load, or a tokenizer other than the student's."""
    from offline_plugins.modules.tiny_lm import load_causal_lm

    path = str(config.teacher or "").strip()
    if not path:
        raise UserError(f"{name} distils a teacher into the student: give one with --set teacher=PATH (a "
                        "save_pretrained folder with the student's tokenizer, e.g. an sft run's OUT/model)")
    model, tokenizer = load_causal_lm(path)
    if tokenizer.get_vocab() != data.tokenizer.get_vocab():
        raise UserError(f"{name}: the teacher {path!r} has another tokenizer than the student {data.model!r} "
                        f"({len(tokenizer)} tokens against {len(data.tokenizer)}, or the same tokens with other "
                        "ids); the teacher's next-token distributions must be over the student's vocabulary: "
                        "distil from a teacher trained with the student's tokenizer")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _build(config: Any, data: Any, name: str, loss_cls: str, kwargs: dict):
    import offline_plugins.objectives.llm.distill as distill
    from offline_plugins.algorithms._glue import require_rollouts
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, RolloutPlan

    require_rollouts(data, name)
    if config.logprob_chunk or config.shared_prefix:
        raise UserError(f"{name} compares the full next-token distributions of student and teacher, which "
                        "logprob_chunk and shared_prefix do not give; drop them (--set logprob_chunk=0 --set "
                        "shared_prefix=false)")
    teacher = load_teacher(config, data, name)
    generator = rollout_generator(config, data, name)
    policy, reference = policy_and_reference(config, data, name)
    teacher.to(next(policy.parameters()).device)
    actor = policy_log_probs(config, policy, name)
    loss = getattr(distill, loss_cls)(actor, teacher, **kwargs)
    group = OptimizerGroup("policy", list(policy.parameters()), resolve_lr(config, data, name), ("loss_distill",),
                           max_grad_norm=config.max_grad_norm)
    return AlgorithmParts(loss=loss, policy=actor, optimizers=[group], model=policy, tokenizer=data.tokenizer,
                          rollout=RolloutPlan.of(loss, epochs=config.ppo_epochs, reference=reference,
                                                 generator=generator, sync_check=sync_check(config, generator, name)))


def build_opd(config: OPDConfig, data: Any):
    """On-policy distillation: the per-token reverse KL to the teacher on the student's samples."""
    return _build(config, data, "opd", "OnPolicyDistillationLoss", {})


def build_gkd(config: GKDConfig, data: Any):
    """GKD: the generalised JSD(beta) to the teacher on the student's samples."""
    return _build(config, data, "gkd", "GKDLoss", {"beta": config.beta})


_SPECS = (
    ("opd", "On-policy distillation: per-token reverse KL to a frozen teacher on the student's own samples "
     "(--set teacher=PATH)", "OnPolicyDistillationLoss", "build_opd", OPDConfig,
     "Gu et al. 2024, MiniLLM: Knowledge Distillation of Large Language Models, arXiv:2306.08543; Agarwal et al. "
     "2024, arXiv:2306.13649 (beta = 1)"),
    ("gkd", "Generalised knowledge distillation: GKD's generalised JSD(beta) to a frozen teacher on the student's "
     "own samples (--set teacher=PATH)", "GKDLoss", "build_gkd", GKDConfig,
     "Agarwal et al. 2024, On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes, "
     "arXiv:2306.13649"),
)


offline_plugins_register_algorithms = builtin_hook(*(
    builtin_text_algorithm(name, summary, config, paper, loss=f"distill:{loss}", build=f"distill:{build}")
    for name, summary, loss, build, config, paper in _SPECS))
