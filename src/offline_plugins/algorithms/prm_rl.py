"""``grpo-prm`` and ``ppo-prm``: GRPO and PPO-RLHF rewarded by a trained process reward model's step scores.

``build(config, data)`` loads the frozen PRM of ``config.prm`` (a ``train prm`` run's ``OUT`` or
``OUT/reward_model``) and returns GRPO's parts around a
:class:`~offline_plugins.objectives.llm.prm_rl.PRMRewardGRPOLoss`: each response is split at the
task's step separator, the PRM scores each step at its end, and the tokens' advantages are the
group-normalised step rewards summed over the steps ending at or after them (Shao et al. 2024,
arXiv:2402.03300, section 4.1.3). ``build_ppo_prm`` returns PPO-RLHF's parts around a
:class:`~offline_plugins.objectives.llm.prm_rl.PRMRewardPPOLoss`: the PRM's score of each step on the
step's last token of the per-token reward its GAE reads, beside the verifier's outcome reward on the last
token (``outcome_reward``), the KL penalty unchanged (Wang et al. 2024, Math-Shepherd, arXiv:2312.08935).
The task's verifier stays the logged reward and the held-out gold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from offline_plugins.algorithms.online import GRPOConfig, _parts
from offline_plugins.algorithms.ppo_rlhf import PPORLHFConfig, build
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.registry import builtin_hook, builtin_text_algorithm
from offline_plugins.text.tasks.steps import STEP_SEPARATOR

__all__ = ["GRPOPRMConfig", "build_grpo_prm", "PPOPRMConfig", "build_ppo_prm"]


def _check_prm(prm: Optional[str], name: str) -> None:
    from offline_plugins.text.sources.reward_source import is_reward_model_dir

    if prm is None or not is_reward_model_dir(prm):
        raise UserError(f"{name}: prm={prm!r} is not a trained PRM; pass --set prm=OUT, the folder a "
                        "'offline-plugins train prm' run wrote (OUT or OUT/reward_model)")


@dataclass
class _PRMField:
    prm: Optional[str] = config_field(None, "a 'train prm' run's OUT folder (or its OUT/reward_model): the frozen "
                                            "PRM scoring each step")
    #: the algorithm's name in errors
    _name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.prm is not None:  # a bad folder is refused with --set, before the data are made; unset, at build
            _check_prm(self.prm, self._name)


@dataclass
class GRPOPRMConfig(_PRMField, GRPOConfig):
    _name: ClassVar[str] = "grpo-prm"
    prm_aggregate: str = config_field("sum", "a token's advantage from the normalised rewards of the steps ending "
                                             "at or after it: sum (DeepSeekMath) or min")


def _prm_parts(config: Any, data: Any) -> dict:
    """The frozen PRM of ``config.prm`` and the keywords :class:`~offline_plugins.objectives.llm.prm_rl.PRMStepScorer`
    takes; a folder holding no PRM is refused."""
    _check_prm(config.prm, config._name)
    from offline_plugins.eval.search import load_prm
    from offline_plugins.text.data.steps import tokenize_steps

    prm, prm_tokenizer = load_prm(config.prm)
    return {"prm": prm, "prm_tokenizer": prm_tokenizer, "tokenizer": data.tokenizer, "tokenize_steps": tokenize_steps,
            "separator": STEP_SEPARATOR, "max_length": getattr(prm.model.config, "n_positions", 128)}


def build_grpo_prm(config: GRPOPRMConfig, data: Any):
    from offline_plugins.objectives.llm.prm_rl import PRMRewardGRPOLoss

    return _parts(config, data, "grpo-prm", PRMRewardGRPOLoss,
                  {"clip_epsilon": config.clip_epsilon, "beta": config.beta, "prm_aggregate": config.prm_aggregate,
                   **_prm_parts(config, data)})


@dataclass
class PPOPRMConfig(_PRMField, PPORLHFConfig):
    _name: ClassVar[str] = "ppo-prm"
    prm_coef: float = config_field(1.0, "weight of the PRM's step rewards (each step's probability of being right, "
                                        "on its last token)", bounds=">=0")
    outcome_reward: bool = config_field(True, "keep the outcome reward (the task's verifier) on the last token "
                                              "beside the step rewards; false: the step rewards alone")


def build_ppo_prm(config: PPOPRMConfig, data: Any):
    from offline_plugins.objectives.llm.prm_rl import PRMRewardPPOLoss

    return build(config, data, name="ppo-prm", loss_cls=PRMRewardPPOLoss, prm_coef=config.prm_coef,
                 outcome_reward=config.outcome_reward, **_prm_parts(config, data))


offline_plugins_register_algorithms = builtin_hook(builtin_text_algorithm(
    "grpo-prm", "GRPO with a trained PRM's per-step rewards: group-normalised, summed over the steps to come",
    GRPOPRMConfig, "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 (section 4.1.3, process supervision)",
    loss="prm_rl:PRMRewardGRPOLoss", build="prm_rl:build_grpo_prm"), builtin_text_algorithm(
    "ppo-prm", "PPO-RLHF with a trained PRM's per-step rewards on each step's last token, beside the verifier's",
    PPOPRMConfig, "Wang et al. 2024, Math-Shepherd, arXiv:2312.08935 (step-by-step PPO); Ouyang et al. 2022, "
    "arXiv:2203.02155", loss="prm_rl:PRMRewardPPOLoss", build="prm_rl:build_ppo_prm"))
