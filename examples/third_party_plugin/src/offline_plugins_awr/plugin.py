"""Registers ``awr``, the ``arith`` judge, the ``bwrap-logged`` tool sandbox, the ``reverse`` text task and
tool, the ``letter-overlap`` reward and the ``awr/pendulum-still-v0`` recipe with offline-plugins.

No torch import here: listing stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from offline_plugins.config import config_field
from offline_plugins.plugins import AlgorithmSpec, JudgeSpec, SandboxSpec, hookimpl


@dataclass
class AWRConfig:
    """Reference defaults of advantage-weighted regression (Peng et al. 2019)."""

    beta: float = config_field(1.0, "advantage temperature of exp(A / beta)")
    max_weight: float = config_field(20.0, "clip of the advantage weight")
    actor_lr: float = config_field(3e-4, "learning rate of the policy")
    value_lr: float = config_field(3e-4, "learning rate of the value network")
    hidden: tuple = config_field((256, 256), "hidden layer widths of both networks")
    batch_size: int = config_field(256, "transitions per gradient step")


def build(config: AWRConfig, data):
    """Networks, loss and optimisers for a dataset with continuous actions."""
    import torch
    from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
    from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor

    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
    from offline_plugins_awr.loss import AWRLoss

    obs_dim = data.observation_spec.shape[-1]
    act_dim = data.action_spec.shape[-1]
    low, high = data.action_spec.space.low, data.action_spec.space.high
    net = torch.nn.Sequential(
        MLP(in_features=obs_dim, out_features=2 * act_dim, num_cells=list(config.hidden)),
        NormalParamExtractor(),
    )
    body = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    actor = ProbabilisticActor(body, in_keys=["loc", "scale"], distribution_class=IndependentNormal)
    value = TensorDictModule(
        MLP(in_features=obs_dim, out_features=1, num_cells=list(config.hidden)),
        in_keys=["observation"],
        out_keys=["state_value"],
    )
    loss = AWRLoss(actor, value, beta=config.beta, max_weight=config.max_weight)

    class _Clamp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("low", low.clone())
            self.register_buffer("high", high.clone())

        def forward(self, loc):
            return torch.maximum(torch.minimum(loc, self.high), self.low)

    policy = TensorDictSequential(body, TensorDictModule(_Clamp(), in_keys=["loc"], out_keys=["action"]))
    return AlgorithmParts(
        loss=loss,
        policy=policy,
        optimizers=[
            OptimizerGroup("actor", list(actor.parameters()), config.actor_lr, ("loss_actor",)),
            OptimizerGroup("value", list(value.parameters()), config.value_lr, ("loss_value",)),
        ],
    )


@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(
        AlgorithmSpec(
            name="awr",
            summary="Advantage-weighted regression: behaviour cloning weighted by exp(A / beta)",
            family="offline-rl",
            data="transitions",
            loss="offline_plugins_awr.loss:AWRLoss",
            build="offline_plugins_awr.plugin:build",
            config=AWRConfig,
            paper="Peng, Kumar, Zhang, Levine 2019, arXiv:1910.00177",
            action_spaces=("continuous",),
        )
    )


@hookimpl
def offline_plugins_register_judges(registry):
    registry.add(
        JudgeSpec(
            name="arith",
            summary="prefers the response whose last number is the prompt's chain (a+b*c=, left to right) "
            "evaluated; no preference when both or neither are right",
            judge="offline_plugins_awr.judge:arithmetic_judge",
        )
    )


@hookimpl
def offline_plugins_register_sandboxes(registry):
    registry.add(
        SandboxSpec(
            name="bwrap-logged",
            summary="the bwrap sandbox, logging every program the policy ran (OFFLINE_PLUGINS_AWR_TOOL_LOG)",
            sandbox="offline_plugins_awr.sandbox:LoggedBwrapSandbox",
        )
    )


@hookimpl
def offline_plugins_register_text_tasks(registry):
    from offline_plugins.plugins import TextTaskSpec

    registry.add(TextTaskSpec("awr/reverse/v0", "write a word of 3-5 letters backwards, exact match",
                              "offline_plugins_awr.tasks:ReverseTask", aliases=("reverse",)))
    # the built-in multi-turn task with this plugin's tool beside the calculator
    registry.add(TextTaskSpec("awr/tool-arithmetic-reverse/v0", "tool-arithmetic with the reverse tool as well",
                              "offline_plugins.text.tasks.tools:ToolArithmeticTask",
                              (("tools", ("calculator", "reverse")), ("digits", 2), ("max_turns", 2))))


@hookimpl
def offline_plugins_register_tools(registry):
    from offline_plugins.plugins import ToolSpec

    registry.add(ToolSpec("reverse", "writes its argument backwards", "offline_plugins_awr.tasks:ReverseTool"))


@hookimpl
def offline_plugins_register_rewards(registry):
    from offline_plugins.plugins import RewardSpec

    registry.add(RewardSpec("letter-overlap", "the share of the reversed word's letters the response uses (the "
                            "reverse task's dense reward)", "offline_plugins_awr.tasks:letter_overlap"))


@hookimpl
def offline_plugins_register_datasets(registry):
    from offline_plugins.plugins import DatasetSpec

    registry.add(DatasetSpec(id="awr/pendulum-still-v0", summary="Pendulum-v1 under zero torque (4 episodes)",
                             env_id="Pendulum-v1", make="offline_plugins_awr.tasks:make_still_pendulum",
                             tier="still", action_space="continuous"))
