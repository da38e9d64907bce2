"""``grpo-prm``: GRPO whose advantages come from a trained process reward model's step rewards.

``build(config, data)`` loads the frozen PRM of ``config.prm`` (a ``train prm`` run's ``OUT`` or
``OUT/reward_model``) and returns GRPO's parts around a
:class:`~offline_plugins.objectives.llm.prm_rl.PRMRewardGRPOLoss`: each response is split at the
task's step separator, the PRM scores each step at its end, and the tokens' advantages are the
group-normalised step rewards summed over the steps ending at or after them (Shao et al. 2024,
arXiv:2402.03300, section 4.1.3). The task's verifier stays the logged reward and the held-out gold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from offline_plugins.algorithms.online import GRPOConfig
from offline_plugins.config import config_field
from offline_plugins.plugins.registry import builtin_hook, builtin_text_algorithm

__all__ = ["GRPOPRMConfig", "build_grpo_prm"]


@dataclass
class GRPOPRMConfig(GRPOConfig):
    prm: Optional[str] = config_field(None, "a 'train prm' run's OUT folder (or its OUT/reward_model): the frozen "
                                            "PRM scoring each step")
    prm_aggregate: str = config_field("sum", "a token's advantage from the normalised rewards of the steps ending "
                                             "at or after it: sum (DeepSeekMath) or min")


def build_grpo_prm(config: GRPOPRMConfig, data: Any):
    from offline_plugins.algorithms.online import _parts
    from offline_plugins.data.reward_source import is_reward_model_dir
    from offline_plugins.data.steps import tokenize_steps
    from offline_plugins.envs.steps import STEP_SEPARATOR
    from offline_plugins.errors import UserError
    from offline_plugins.objectives.llm.prm_rl import PRMRewardGRPOLoss

    if config.prm is None or not is_reward_model_dir(config.prm):
        raise UserError(f"grpo-prm: prm={config.prm!r} is not a trained PRM; pass --set prm=OUT, the folder a "
                        "'offline-plugins train prm' run wrote (OUT or OUT/reward_model)")
    from offline_plugins.eval.search import load_prm

    prm, prm_tokenizer = load_prm(config.prm)
    return _parts(config, data, "grpo-prm", PRMRewardGRPOLoss,
                  {"clip_epsilon": config.clip_epsilon, "beta": config.beta, "prm": prm,
                   "prm_tokenizer": prm_tokenizer, "tokenizer": data.tokenizer, "tokenize_steps": tokenize_steps,
                   "separator": STEP_SEPARATOR, "prm_aggregate": config.prm_aggregate,
                   "max_length": getattr(prm.model.config, "n_positions", 128)})


offline_plugins_register_algorithms = builtin_hook(builtin_text_algorithm(
    "grpo-prm", "GRPO with a trained PRM's per-step rewards: group-normalised, summed over the steps to come",
    GRPOPRMConfig, "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 (section 4.1.3, process supervision)",
    loss="prm_rl:PRMRewardGRPOLoss", build="prm_rl:build_grpo_prm"))
