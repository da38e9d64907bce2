"""The losses, as TorchRL ``LossModule``s: ``from offline_plugins.objectives import IQLLoss``.

Each name is imported from its module on first access, so importing this package imports
neither torch nor torchrl (``offline-plugins list`` and the plugin host rely on that).

>>> import offline_plugins.objectives as objectives
>>> objectives.IQLLoss.__module__
'offline_plugins.objectives.iql'
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

# name -> module under offline_plugins.objectives
_EXPORTS = {
    "AWACLoss": "awac",
    "BCLoss": "bc",
    "BCQLoss": "bcq",
    "BCQPolicy": "bcq",
    "DiscreteBCQLoss": "bcq",
    "DiscreteBCQPolicy": "bcq",
    "CQLLoss": "cql",
    "DiscreteCQLLoss": "cql",
    "IQLLoss": "iql",
    "DiscreteIQLLoss": "iql",
    "TD3BCLoss": "td3_bc",
    "ReBRACLoss": "rebrac",
    "SACNLoss": "edac",
    "EDACLoss": "edac",
    "CalQLLoss": "cal_ql",
    "FQLLoss": "fql",
    "DecisionTransformerLoss": "sequence.decision_transformer",
    "OnlineDecisionTransformerLoss": "sequence.decision_transformer",
    "TrajectoryTransformerLoss": "sequence.trajectory_transformer",
    "DiffuserLoss": "sequence.diffuser",
    "DiffuserValueLoss": "sequence.diffuser",
    "DiffuserWithValueLoss": "sequence.diffuser",
    "AlgorithmDistillationLoss": "sequence.algorithm_distillation",
    "BradleyTerryLoss": "llm.reward",
    "DPOLoss": "llm.preference",
    "IPOLoss": "llm.preference",
    "KTOLoss": "llm.preference",
    "ORPOLoss": "llm.preference",
    "RobustDPOLoss": "llm.preference",
    "RPOLoss": "llm.preference",
    "SimPOLoss": "llm.preference",
    "RolloutLoss": "llm.rollout",
    "GroupAdvantageLoss": "llm.rollout",
    "TextGRPOLoss": "llm.grpo",
    "DAPOLoss": "llm.grpo",
    "DrGRPOLoss": "llm.grpo",
    "RLOOLoss": "llm.grpo",
    "TextCISPOLoss": "llm.grpo",
    "TextGSPOLoss": "llm.grpo",
    "TextSAPOLoss": "llm.grpo",
    "TextGMPOLoss": "llm.grpo",
    "TextDPPOLoss": "llm.grpo",
    "REINFORCEPPLoss": "llm.reinforce",
    "REINFORCEPPBaselineLoss": "llm.reinforce",
    "TextGDPOLoss": "llm.online_variants",
    "TextMaxRLLoss": "llm.online_variants",
    "TextLUSPOLoss": "llm.online_variants",
    "TextVESPOLoss": "llm.online_variants",
    "ExpertIterationLoss": "llm.sft",
    "TextSFTLoss": "llm.sft",
    "OnlinePreferenceLoss": "llm.online_dpo",
    "TextDTLoss": "llm.text_dt",
    "PPORLHFLoss": "llm.ppo_rlhf",
    "TextDistillationLoss": "llm.distill",
    "OnPolicyDistillationLoss": "llm.distill",
    "GKDLoss": "llm.distill",
    "ProcessRewardLoss": "llm.prm",
    "PRMRewardGRPOLoss": "llm.prm_rl",
    "PRMRewardPPOLoss": "llm.prm_rl",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), {name: f".{module}" for name, module in _EXPORTS.items()})
