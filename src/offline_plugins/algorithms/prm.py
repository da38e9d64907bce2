"""A process reward model (PRM) as a plugin: ``prm``, trained on step-labelled reasoning.

``build(config, data)`` takes a :class:`~offline_plugins.text.data.steps.StepData` and returns a
:class:`~offline_plugins.objectives.llm.prm.CausalLMStepReward` (a trainable copy of the
dataset's language model with a score head read at each step's end) inside a
:class:`~offline_plugins.objectives.llm.prm.ProcessRewardLoss`. The run is scored on held-out
rows by step accuracy and first-error accuracy, and the PRM is exported as the reward model is
(``OUT/reward_model``: backbone, tokenizer, head). Lightman et al. 2023, arXiv:2305.20050.
"""

from __future__ import annotations

from dataclasses import dataclass

from offline_plugins.algorithms.llm import trainable_copy
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import AlgorithmSpec

__all__ = ["PRMConfig", "build_prm"]


@dataclass
class PRMConfig:
    lr: float = config_field(1e-3, "Adam learning rate of the PRM (backbone and head)")
    batch_size: int = config_field(16, "step-labelled solutions per gradient step")
    max_grad_norm: float = config_field(1.0, "clip the PRM's gradient norm to this")
    reference_sft_steps: int = config_field(0, "built-in dataset with a built-in --model (tiny, small): start from the task's cached "
                                               "SFT reference of this many steps (steps-arithmetic's; 0: random init)")
    policy_rows: int = config_field(0, "built-in dataset: add this many of the starting model's own solutions, "
                                       "each step labelled by the task's checker (its errors, not planted ones)",
                                    bounds=">=0")
    lm_coef: float = config_field(0.0, "weight of the next-token loss on the correct steps' tokens (0: none; the "
                                       "verifier also learns to solve, Cobbe et al. 2021)", bounds=">=0")


def build_prm(config: PRMConfig, data):
    """The PRM: the dataset's language model (a trainable copy) plus a step score head."""
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
    from offline_plugins.objectives.llm.prm import CausalLMStepReward, ProcessRewardLoss
    from offline_plugins.text.data.steps import StepData

    if not isinstance(data, StepData):
        raise UserError(f"prm: build(config, data) expects an offline_plugins.text.data.steps.StepData (step-labelled "
                        f"rows: load_step_source), got {type(data).__name__}")
    lm = config.lm_coef > 0
    prm = CausalLMStepReward(trainable_copy(data.reference), logits_key=("steps", "lm_logits") if lm else None).train()
    group = OptimizerGroup("prm", list(prm.parameters()), config.lr, ("loss_prm",) + (("loss_lm",) if lm else ()),
                           max_grad_norm=config.max_grad_norm)
    return AlgorithmParts(loss=ProcessRewardLoss(prm, lm_coef=config.lm_coef), policy=prm, optimizers=[group],
                          tokenizer=data.tokenizer)


@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(AlgorithmSpec(
        name="prm",
        summary="process reward model: a score per reasoning step (binary cross-entropy per step label)",
        family="preference",
        data="step-labels",
        loss="offline_plugins.objectives.llm.prm:ProcessRewardLoss",
        build="offline_plugins.algorithms.prm:build_prm",
        config=PRMConfig,
        paper="Lightman et al. 2023, Let's Verify Step by Step, arXiv:2305.20050",
        action_spaces=("tokens",),
    ))
