"""The language-model losses as TorchRL loss modules: preference optimisation and reward modelling
(``preference``, ``reward``, ``functional``), online RL on text (``grpo``, ``reinforce``, ``sft``,
``online_variants``, ``online_dpo``, ``ppo_rlhf``, ``text_dt``, over the shared ``rollout`` base and the
``estimators``; ``online`` re-exports the first ones), distillation (``distill``) and process reward
models (``prm``, ``prm_rl``). This package imports the preference and reward losses; the others are
imported from their modules or from :mod:`offline_plugins.objectives`.

Paired losses read a ``[B, 2]`` batch (index 0 chosen, 1 rejected); :class:`KTOLoss`
reads ``[B]`` rows with a boolean ``label``. The formulas, as plain functions of
log-probabilities, are in :mod:`offline_plugins.objectives.llm.functional`.
"""

from offline_plugins.objectives.llm.common import PreferenceInputError, PreferenceLossBase
from offline_plugins.objectives.llm.preference import (
    DPOLoss,
    IPOLoss,
    KTOLoss,
    ORPOLoss,
    RobustDPOLoss,
    RPOLoss,
    SimPOLoss,
)
from offline_plugins.objectives.llm.reward import BradleyTerryLoss

__all__ = [
    "BradleyTerryLoss",
    "DPOLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "PreferenceInputError",
    "PreferenceLossBase",
    "RPOLoss",
    "RobustDPOLoss",
    "SimPOLoss",
]

# on-policy distillation (opd, gkd): appended, so the names above keep their order
from offline_plugins.objectives.llm.distill import GKDLoss, OnPolicyDistillationLoss, TextDistillationLoss  # noqa: E402

__all__ += ["GKDLoss", "OnPolicyDistillationLoss", "TextDistillationLoss"]

# process reward models (prm): appended
from offline_plugins.objectives.llm.prm import CausalLMStepReward, ProcessRewardLoss  # noqa: E402

__all__ += ["CausalLMStepReward", "ProcessRewardLoss"]

# the PRM as a dense reward for GRPO (grpo-prm): appended
from offline_plugins.objectives.llm.prm_rl import PRMRewardGRPOLoss, PRMRewardPPOLoss  # noqa: E402

__all__ += ["PRMRewardGRPOLoss", "PRMRewardPPOLoss"]
