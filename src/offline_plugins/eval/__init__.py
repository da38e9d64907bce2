"""Evaluation: policy rollouts in the dataset's environment and normalised scores."""

from offline_plugins.eval.rollout import EvalResult, actions_for_env, evaluate_policy

__all__ = ["EvalResult", "evaluate_policy", "actions_for_env"]
