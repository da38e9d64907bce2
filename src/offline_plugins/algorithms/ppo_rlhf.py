"""PPO-RLHF as a plugin (family ``online-llm``, data kind ``text-rollouts``).

``build(config, data)`` takes a :class:`~offline_plugins.text.data.rollouts.RolloutData` and returns
:class:`~offline_plugins.objectives.llm.ppo_rlhf.PPORLHFLoss` around a trainable copy of the
reference (the policy) and a separate critic (:class:`~offline_plugins.objectives.llm.ppo_rlhf.TokenValueHead`
on another copy of the reference), each with its own Adam group. The reward is the rollout
source's (the task's verifier or ``--reward``).

Defaults follow TRL's ``PPOConfig`` (``trl/trainer/ppo_config.py``: ``kl_coef=0.05``,
``cliprange=0.2``, ``cliprange_value=0.2``, ``vf_coef=0.1``, ``gamma=1``, ``lam=0.95``,
``num_ppo_epochs=4``, ``whiten_rewards=False``, advantages whitened) and OpenAI's
lm-human-preferences (adaptive KL: target 6 nats, horizon 10000). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from offline_plugins.algorithms.llm import policy_and_reference, policy_log_probs, resolve_lr, trainable_copy
from offline_plugins.algorithms.online import GeneratorFields, _RolloutFields, rollout_generator, sync_check
from offline_plugins.config import config_field
from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import AlgorithmSpec

__all__ = ["PPORLHFConfig", "build"]


@dataclass
class PPORLHFConfig(GeneratorFields, _RolloutFields):
    group_size: int = config_field(1, "responses sampled per prompt (PPO needs no groups)")
    batch_size: int = config_field(8, "rollouts per gradient step (must divide prompts_per_round * group_size)")
    ppo_epochs: int = config_field(4, "passes over each round's rollouts (TRL num_ppo_epochs=4)")
    kl_coef: float = config_field(0.05, "initial coefficient of the per-token KL in the reward (TRL kl_coef=0.05)")
    kl_target: Optional[float] = config_field(None, "adaptive KL target in nats (lm-human-preferences: 6.0); "
                                                    "unset: fixed kl_coef")
    kl_horizon: int = config_field(10000, "adaptive controller horizon (lm-human-preferences: 10000)")
    kl_estimator: str = config_field("k1", "per-token KL estimator in the reward: k1 (TRL) or k3")
    clip_epsilon: float = config_field(0.2, "PPO ratio clip (TRL cliprange=0.2)")
    clip_value: float = config_field(0.2, "value clip (TRL cliprange_value=0.2)")
    vf_coef: float = config_field(0.1, "value-loss weight (TRL vf_coef=0.1)")
    gamma: float = config_field(1.0, "discount over response tokens (TRL gamma=1)")
    lmbda: float = config_field(0.95, "GAE lambda (TRL lam=0.95)")
    whiten_advantages: bool = config_field(True, "whiten advantages over each round's response tokens (TRL)")
    value_lr: Optional[float] = config_field(None, "critic learning rate; unset: the policy's")


def build(config: PPORLHFConfig, data: Any, *, name: str = "ppo-rlhf", loss_cls: Any = None, **loss_kwargs):
    """The parts of ``ppo-rlhf``; a variant passes its ``name`` (in errors), its ``loss_cls`` (a
    :class:`~offline_plugins.objectives.llm.ppo_rlhf.PPORLHFLoss` subclass) and that class's extra keywords."""
    from offline_plugins.algorithms._glue import require_rollouts
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, RolloutPlan
    from offline_plugins.objectives.llm.ppo_rlhf import PPORLHFLoss, TokenValueHead

    require_rollouts(data, name)
    generator = rollout_generator(config, data, name)
    # the critic is copied before LoRA (if asked) wraps the reference in place: a full trainable copy
    critic = TokenValueHead(trainable_copy(data.reference))
    critic.train()
    policy, reference = policy_and_reference(config, data, name)
    actor = policy_log_probs(config, policy, name)
    loss = (loss_cls or PPORLHFLoss)(
        actor, critic, kl_coef=config.kl_coef, kl_target=config.kl_target, kl_horizon=config.kl_horizon,
        kl_estimator=config.kl_estimator, clip_epsilon=config.clip_epsilon, clip_value=config.clip_value,
        vf_coef=config.vf_coef, gamma=config.gamma, lmbda=config.lmbda, whiten_advantages=config.whiten_advantages,
        **loss_kwargs)
    lr = resolve_lr(config, data, name)
    groups = [OptimizerGroup("policy", list(policy.parameters()), lr, ("loss_objective",),
                             max_grad_norm=config.max_grad_norm),
              OptimizerGroup("value", list(critic.parameters()), float(config.value_lr or lr), ("loss_critic",),
                             max_grad_norm=config.max_grad_norm)]
    # the loss's min_group_size is 1: a value baseline needs no group
    return AlgorithmParts(loss=loss, policy=actor, optimizers=groups, model=policy, tokenizer=data.tokenizer,
                          rollout=RolloutPlan.of(loss, epochs=config.ppo_epochs, reference=reference,
                                                 generator=generator, sync_check=sync_check(config, generator, name)))


@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(AlgorithmSpec(
        name="ppo-rlhf",
        summary="PPO against a reward with the per-token KL to the reference in it: value head, GAE, clipping",
        family="online-llm",
        data="text-rollouts",
        loss="offline_plugins.objectives.llm.ppo_rlhf:PPORLHFLoss",
        build="offline_plugins.algorithms.ppo_rlhf:build",
        config=PPORLHFConfig,
        paper="Ouyang et al. 2022, Training language models to follow instructions with human feedback, "
              "arXiv:2203.02155; Ziegler et al. 2019, Fine-Tuning Language Models from Human Preferences, "
              "arXiv:1909.08593; Stiennon et al. 2020, Learning to summarize from human feedback, arXiv:2009.01325",
        action_spaces=("tokens",),
    ))
