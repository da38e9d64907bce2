"""Online RL on text, one import path: the GRPO family (:mod:`offline_plugins.objectives.llm.grpo`: GRPO,
DAPO, Dr. GRPO, RLOO, CISPO, GSPO, SAPO, GMPO, DPPO), REINFORCE++
(:mod:`offline_plugins.objectives.llm.reinforce`), SFT and expert iteration
(:mod:`offline_plugins.objectives.llm.sft`) and the estimators they share
(:mod:`offline_plugins.objectives.llm.estimators`), re-exported here, where they lived before; the
2026 variants are in :mod:`offline_plugins.objectives.llm.online_variants`. The rows they read are
described in :mod:`offline_plugins.objectives.llm.grpo`.

>>> from offline_plugins.objectives.llm.online import TextGRPOLoss
>>> TextGRPOLoss.__module__
'offline_plugins.objectives.llm.grpo'
"""

from __future__ import annotations

from offline_plugins.objectives.llm.estimators import group_advantages, k3_kl, masked_whiten, overlong_penalty
from offline_plugins.objectives.llm.grpo import (
    TOKEN_BASELINES,
    DAPOLoss,
    DrGRPOLoss,
    RLOOLoss,
    TextCISPOLoss,
    TextDPPOLoss,
    TextGMPOLoss,
    TextGRPOLoss,
    TextGSPOLoss,
    TextSAPOLoss,
    _example_rollouts,
)
from offline_plugins.objectives.llm.reinforce import REINFORCEPPBaselineLoss, REINFORCEPPLoss
from offline_plugins.objectives.llm.sft import ExpertIterationLoss, TextSFTLoss

__all__ = [
    "TOKEN_BASELINES",
    "group_advantages",
    "overlong_penalty",
    "k3_kl",
    "masked_whiten",
    "TextGRPOLoss",
    "TextSAPOLoss",
    "TextGMPOLoss",
    "TextDPPOLoss",
    "REINFORCEPPLoss",
    "REINFORCEPPBaselineLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "RLOOLoss",
    "TextCISPOLoss",
    "TextGSPOLoss",
    "ExpertIterationLoss",
    "TextSFTLoss",
    "_example_rollouts",
]
