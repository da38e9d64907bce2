"""Evaluation: policy rollouts in the dataset's environment and normalised scores (``rollout``), off-policy
evaluation of checkpoints (``fqe``), preference and over-optimisation measures (``preference``,
``overoptimization``), AI judges (``judge``), best-of-n search (``search``) and the reward and judge
server (``serve``)."""

from offline_plugins.eval.rollout import EvalResult, actions_for_env, evaluate_policy

__all__ = ["EvalResult", "evaluate_policy", "actions_for_env"]
