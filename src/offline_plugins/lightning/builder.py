"""The pieces of a run for a user's own ``lightning.Trainer``: :func:`build`.

``build("iql", "pendulum/medium-replay-v0")`` resolves, checks and loads as
:func:`~offline_plugins.lightning.run.train` does, and returns a :class:`LightningParts`:
the :class:`~offline_plugins.lightning.module.AlgorithmModule`, the
:class:`~offline_plugins.lightning.data.ReplayDataModule` and the callbacks the algorithm
needs. Everything else (loggers, further callbacks, precision, ``devices``, ``strategy``,
``max_steps``, ``ckpt_path``) is the user's, passed to their ``Trainer`` and ``fit``:

.. code-block:: python

    import lightning
    import offline_plugins.lightning as opl

    parts = opl.build("iql", "pendulum/medium-replay-v0", config={"batch_size": 64})
    trainer = lightning.Trainer(max_steps=1000, callbacks=parts.callbacks)
    trainer.fit(parts.module, datamodule=parts.datamodule)

``train`` builds its runs here too, so which callbacks an algorithm needs is decided in
one place. docs/lightning.md shows it run. (The module is ``builder``, not ``build``: a submodule
named ``build`` would replace the function ``offline_plugins.lightning.build`` once imported.)
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

from offline_plugins.config import config_to_dict
from offline_plugins.errors import UserError
from offline_plugins.lightning.callbacks import NonFiniteGuard, TargetNetworkUpdate
from offline_plugins.lightning.data import ReplayDataModule
from offline_plugins.lightning.module import AlgorithmModule
from offline_plugins.lightning.plan import build_parts, plan_run

__all__ = ["LightningParts", "build"]


@dataclasses.dataclass
class LightningParts:
    """What a ``lightning.Trainer`` fits: the module, the data module, the callbacks the algorithm needs.

    Attributes:
        module: the :class:`~offline_plugins.lightning.module.AlgorithmModule` (the algorithm's
            loss, optimiser groups, target updater; ``module.parts`` is its ``AlgorithmParts``).
        datamodule: the :class:`~offline_plugins.lightning.data.ReplayDataModule` streaming batches
            from the dataset's replay buffer, or the data kind's own (text rollouts:
            :class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`, which samples each round
            from the policy being trained); fit with ``datamodule=parts.datamodule``.
        callbacks: pass them all to the ``Trainer`` (with any of your own). In order: the
            :class:`~offline_plugins.lightning.callbacks.NonFiniteGuard`, the
            :class:`~offline_plugins.lightning.callbacks.TargetNetworkUpdate` (algorithms with
            target networks), the data kind's evaluation (``evaluation``) and the kind's further
            callbacks.
        evaluation: the evaluation callback (also in ``callbacks``); its ``history`` holds the scores.
        plan: the checked :class:`~offline_plugins.lightning.plan.RunPlan` (algorithm spec, config,
            loaded data, data kind).
        required: the callback classes the module refuses to train without (in ``callbacks``).
    """

    module: Any
    datamodule: Any
    callbacks: list
    evaluation: Any
    plan: Any
    required: tuple = ()

    def __iter__(self):
        # ``module, datamodule, callbacks = build(...)``
        return iter((self.module, self.datamodule, self.callbacks))


def build(
    algorithm,
    dataset,
    *,
    config: Union[None, str, os.PathLike, Mapping] = None,
    overrides: Union[None, Sequence[str], Mapping[str, Any]] = None,
    seed: int = 0,
    eval_every: int = 0,
    eval_episodes: int = 10,
    steps_per_call: int = 1,
    accumulate: int = 1,
    compile: bool = False,
    model: Optional[str] = None,
    drop_nonfinite: bool = False,
    drop_empty: bool = False,
    reward: Optional[str] = None,
    registry=None,
    progress: bool = False,
    plan=None,
    run: Optional[Mapping[str, Any]] = None,
    online_steps: int = 0,
    offline_steps: Optional[int] = None,
) -> LightningParts:
    """The module, data module and callbacks of ``algorithm`` on ``dataset``, for a user's ``Trainer``.

    Raises a ``UserError`` on a bad input (unknown algorithm or dataset, a config key the
    algorithm lacks, a dataset of another kind) before anything is built.

    Args:
        algorithm: an algorithm name (``offline-plugins list``) or an ``AlgorithmSpec``.
        dataset: a dataset id (a Minari id, ``arithmetic/preference-v0``, a ``.jsonl`` file...)
            or a loaded dataset object.

    Keyword Args:
        config: config overrides: a mapping, or a YAML/JSON file (``--config``).
        overrides: further overrides, ``["key=value", ...]`` (``--set``) or a mapping.
        seed: seeds the networks' initialisation, the batches (batch ``t`` on rank ``r`` is a
            function of ``(seed, r, t)``) and the evaluation.
        eval_every: evaluate every this many steps; 0 (default): only when training ends.
        eval_episodes: episodes per evaluation (environment data).
        steps_per_call: gradient steps per ``training_step``. 1 (default): one batch and one
            step per call, as every Lightning callback expects; more spreads Lightning's cost per
            call over several steps (``train``'s default is 8), with the same run.
        accumulate: micro-batches per step (gradient accumulation; ``batch_size`` stays per step).
        compile: run the loss through ``torch.compile``.
        model: preference and rollout algorithms: ``"tiny"`` (default), a ``save_pretrained``
            directory or a hub id.
        drop_nonfinite, drop_empty: Minari datasets: drop episodes with NaN/inf values, or empty ones.
        reward: rollout algorithms: a reward function ``"module:function"``.
        registry: the plugin registry (default: the installed plugins).
        progress: show a progress bar when a dataset is made.
        plan: an already checked :class:`~offline_plugins.lightning.plan.RunPlan` (skips the loading).
        run: further run settings to save in the checkpoint's ``run`` record (``train`` saves its own).
        online_steps: offline-to-online fine-tuning: after ``offline_steps`` steps on the dataset, this
            many more while acting in its environment
            (the kind's ``online_datamodule``: the environment kinds'
            :class:`~offline_plugins.kinds.environment.finetune.FineTuneDataModule`; fit with
            ``max_steps=offline_steps + online_steps``). 0 (default): offline only.
        offline_steps: the offline phase's steps (needed with ``online_steps``).

    Returns:
        A :class:`LightningParts`.
    """
    if eval_every is None or eval_every < 0:
        raise UserError(f"eval_every must be 0 (only at the end) or positive, got {eval_every!r}")
    if plan is None:
        plan = plan_run(algorithm, dataset, config=config, overrides=overrides, registry=registry,
                        progress=progress, model=model, drop_nonfinite=drop_nonfinite, drop_empty=drop_empty,
                        reward=reward)
    if online_steps:
        plan.kind.check_online(plan.spec, plan.config, plan.data, online_steps=online_steps)
        if offline_steps is None or int(offline_steps) < 0:
            raise UserError(f"online_steps={online_steps} needs offline_steps (the steps before the online phase, "
                            f"0 or more), got {offline_steps!r}")
    parts = build_parts(plan, seed)
    run_settings = {
        "batch_size": plan.batch_size,
        "sampler": plan.sampler,
        "slice_len": plan.slice_len,
        "data_kwargs": plan.data_kwargs,
        "eval_episodes": eval_episodes,
        "eval_every": eval_every,
        "steps_per_call": steps_per_call,
        "accumulate": accumulate,
        **plan.kind.run_settings(plan.data, plan.options),
        **dict(run or {}),
    }
    module = AlgorithmModule(
        parts,
        algorithm=plan.spec.name,
        dataset=plan.dataset_id,
        config=config_to_dict(plan.config),
        seed=seed,
        data_state=plan.data.state_dict() if hasattr(plan.data, "state_dict") else {},
        run=run_settings,
        compile_loss=compile,
        steps_per_call=steps_per_call,
        accumulate=accumulate,
    )
    # who provides the algorithm: saved in checkpoints, so they name what to install to evaluate them
    module.provenance = {"provider": plan.spec.provider, "provider_version": plan.spec.version,
                         "plugin": plan.spec.plugin}
    # a kind whose data is made while training streams it itself (text rollouts); the module refuses a fit
    # without it, as it refuses one without a required callback
    datamodule = plan.kind.datamodule(plan.data, parts, batch_size=plan.batch_size, seed=seed)
    if online_steps:  # the kind's offline-to-online stream (the environment kinds': its FineTuneDataModule)
        datamodule = plan.kind.online_datamodule(plan.data, parts, batch_size=plan.batch_size, seed=seed,
                                                 offline_steps=int(offline_steps), online_steps=int(online_steps),
                                                 config=plan.config)
        module.required_datamodule = type(datamodule)
    elif datamodule is None:
        datamodule = ReplayDataModule(plan.data, batch_size=plan.batch_size, seed=seed, sampler=plan.sampler,
                                      slice_len=plan.slice_len)
    else:
        module.required_datamodule = type(datamodule)
    evaluation = plan.kind.evaluation(plan.data, every=eval_every, episodes=eval_episodes, seed=seed)
    # the guard reads its ring buffer on every evaluation step, so a bad term stops the run before it is scored
    guard = NonFiniteGuard(check_every=math.gcd(eval_every, 100) if eval_every else 100)
    targets = [TargetNetworkUpdate()] if parts.target_updater is not None else []
    # the kind's own callbacks are what its data needs (DataKind.callbacks): the run cannot go without them
    kind_callbacks = list(plan.kind.callbacks(plan.data, parts, seed=seed))
    required = tuple(dict.fromkeys(type(cb) for cb in (*targets, *kind_callbacks)))
    module.required_callbacks = required
    return LightningParts(module=module, datamodule=datamodule,
                          callbacks=[guard, *targets, evaluation, *kind_callbacks],
                          evaluation=evaluation, plan=plan, required=required)
