"""Data of an environment: Minari datasets of steps, read as transitions or as trajectory windows.

Both kinds load an :class:`~offline_plugins.data.offline.OfflineData` (its TorchRL
replay buffer holds the dataset's steps), evaluate the deterministic policy by rolling
it out in the dataset's Gymnasium environment
(:class:`~offline_plugins.kinds.environment.evaluation.PolicyEvaluation`), report return and
normalised score, and keep the policy in the checkpoint (``offline-plugins eval``
rebuilds it). They differ in how a batch is drawn: independent transitions, or
contiguous windows of one episode (TorchRL's ``SliceSampler``).
"""

from __future__ import annotations

from typing import Any, Optional

from offline_plugins.data.store import resolve_dataset_id
from offline_plugins.errors import UserError
from offline_plugins.plugins.datakind import (
    LOSS_PANEL,
    BatchLayout,
    CurvePanel,
    DataKind,
    DataOptions,
    LoadedData,
    config_value,
)

__all__ = ["EnvironmentSteps", "Transitions", "Trajectories", "LOADER_CONFIG_FIELDS"]

#: config fields passed on to :func:`~offline_plugins.data.load_offline_data` when an algorithm declares them
LOADER_CONFIG_FIELDS: dict[str, str] = {
    "normalize_observations": "standardise observations with the dataset's mean and std",
    "reward_scale": "multiply rewards by this",
    "reward_shift": "add this to rewards (after the scale)",
    "discrete_actions": "how discrete actions are stored (load_offline_data's discrete_actions)",
    "drop_nonfinite": "drop episodes with NaN/inf values instead of refusing the dataset",
}


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _acting(result: dict) -> str:
    # the policy's time per action: a planner's (tt, diffuser) planning cost
    ms = result.get("ms_per_action")
    return "" if ms is None else f", {ms:.1f} ms per action"


def dropped_text(dropped: dict) -> str:
    """``3 episode(s) (412 non-finite step(s)) with NaN/inf values, 1 zero-length episode(s)``, or ``nothing``.

    >>> dropped_text({"empty_episodes": 1})
    '1 zero-length episode(s)'
    """
    parts = []
    if dropped.get("nonfinite_episodes"):
        parts.append(f"{dropped['nonfinite_episodes']} episode(s) ({dropped['nonfinite_steps']} non-finite step(s)) "
                     "with NaN/inf values")
    if dropped.get("empty_episodes"):
        parts.append(f"{dropped['empty_episodes']} zero-length episode(s)")
    return ", ".join(parts) or "nothing"



def _score_of(data):
    """The data's D4RL-style normalisation of returns, or None where it records no reference
    returns (a user's Minari dataset, OGBench's, whose score is the success rate)."""
    if getattr(data, "ref_min_score", None) is None or getattr(data, "ref_max_score", None) is None:
        return None
    return data.normalized_score

class EnvironmentSteps(DataKind):
    """Steps of a Gymnasium environment, from a Minari dataset (a built-in recipe is made on the fly).

    Reads the config fields in :data:`LOADER_CONFIG_FIELDS` (where the algorithm declares
    them) and ``batch_size``.
    """

    description = "a Minari dataset of environment steps"
    train_hint = "train an offline RL algorithm on it (bc, iql, cql, td3-bc, dt...)"
    config_fields = {"batch_size": "elements per gradient step (default 256)", **LOADER_CONFIG_FIELDS}

    def claims(self, dataset: str) -> bool:
        # a Minari id has no syntax of its own: an id no other kind claims is tried here,
        # and ``resolve`` refuses an unknown one with the store's and the recipes' ids
        return False

    def resolve(self, dataset: str, *, spec, registry) -> tuple[str, Optional[str]]:
        resolved, recipe = resolve_dataset_id(dataset, registry)
        return resolved, getattr(recipe, "action_space", None)

    def check_options(self, spec, options: DataOptions) -> None:
        if options.reward is not None:
            raise UserError(f"--reward applies to algorithms trained on their own rollouts (grpo...); {spec.name!r} "
                            "reads the rewards recorded in the dataset: drop --reward")
        if options.model is not None:
            raise UserError(
                f"--model applies to preference algorithms (dpo, kto, reward-model...); {spec.name!r} learns its "
                "networks from the dataset, drop --model"
            )

    def _loader_kwargs(self, config, options: DataOptions) -> dict[str, Any]:
        missing = object()
        kwargs = {k: config_value(config, k, missing) for k in LOADER_CONFIG_FIELDS}
        kwargs = {k: v for k, v in kwargs.items() if v is not missing}
        if options.drop_nonfinite:
            kwargs["drop_nonfinite"] = True
        if options.drop_empty:
            kwargs["drop_empty_episodes"] = True
        return kwargs

    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        from offline_plugins.data import load_offline_data

        kwargs = self._loader_kwargs(config, options)
        data = load_offline_data(dataset_id, device=device, progress=progress, registry=registry, **kwargs)
        return LoadedData(data, kwargs)

    def run_settings(self, data, options: DataOptions) -> dict[str, Any]:
        return {"env_id": getattr(data, "env_id", None)}

    def reload_options(self, run: dict) -> DataOptions:
        # a run that dropped bad episodes reloads its dataset the same way
        kwargs = run.get("data_kwargs") or {}
        return DataOptions(drop_nonfinite=bool(kwargs.get("drop_nonfinite")),
                           drop_empty=bool(kwargs.get("drop_empty_episodes")))

    def check_online(self, spec, config, data, *, online_steps: int) -> None:
        from offline_plugins.kinds.environment.finetune import check_online

        check_online(spec, config, data, online_steps=online_steps)

    def online_datamodule(self, data, parts, *, batch_size: int, seed: int, offline_steps: int, online_steps: int,
                          config: Any):
        from offline_plugins.kinds.environment.finetune import FineTuneDataModule

        return FineTuneDataModule(data, parts, batch_size=batch_size, seed=seed, offline_steps=offline_steps,
                                  online_steps=online_steps, config=config)

    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        from offline_plugins.kinds.environment.evaluation import PolicyEvaluation

        return PolicyEvaluation(data.make_env, every=every, episodes=episodes, seed=seed,
                                normalize=getattr(data, "normalize", None),
                                score=_score_of(data))

    def curve_panels(self) -> list:
        # the D4RL-style score where the dataset has reference returns, else the raw return
        return [CurvePanel("success rate (else normalised score, else return)",
                           ("eval/success_rate", "eval/normalized_score", "eval/return_mean"), first_only=True),
                LOSS_PANEL]

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        return {
            "env_id": getattr(data, "env_id", None),
            "return_mean": last.get("return_mean"),
            "return_std": last.get("return_std"),
            "normalized_score": last.get("normalized_score"),
            "normalized_score_std": last.get("normalized_score_std"),
            **({"success_rate": last["success_rate"]} if last.get("success_rate") is not None else {}),
            "eval_episodes": eval_episodes,
            "ms_per_action": last.get("ms_per_action"),
            "dropped": dict(getattr(data, "dropped", None) or {}),
            # the return per inner episode of a learning-history task (algorithm distillation)
            **({"in_context_return_mean": last["in_context_return_mean"]} if last.get("in_context_return_mean") else {}),
        }

    def evaluate(self, module, data, *, episodes: int, seed: int, device: str) -> dict[str, Any]:
        import torch

        from offline_plugins.eval.rollout import evaluate_policy

        result = evaluate_policy(
            module.policy,
            data.make_env,
            episodes=episodes,
            seed=seed,
            normalize=getattr(data, "normalize", None),  # identity when the run did not normalise
            device=torch.device(device),
            score=_score_of(data),
        )
        return result.to_dict()

    def describe(self, result: dict) -> str:
        lines = []
        dropped = result.get("dropped") or {}
        if any(dropped.values()):
            lines.append(f"dropped from {result['dataset']}: {dropped_text(dropped)}")
        score = (f"normalised score {_fmt(result.get('normalized_score'))} (return {_fmt(result.get('return_mean'))} "
                 f"+- {_fmt(result.get('return_std'))} over {result.get('eval_episodes', result.get('episodes'))} "
                 f"episodes{_acting(result)})")
        if result.get("success_rate") is not None:  # a benchmark scored by success (OGBench)
            score = f"success rate {100 * result['success_rate']:.1f}%, " + score
        if "wall_s" in result:  # a training summary
            lines.append(f"{result['algorithm']} on {result['dataset']}, {result['steps']} steps, seed "
                         f"{result['seed']}: {score} in {result['wall_s']:.0f} s; wrote {result['out_dir']}")
        else:  # an evaluation of a checkpoint
            lines.append(f"{result['algorithm']} on {result['dataset']} (step {result['step']}): {score}")
        curve = result.get("in_context_return_mean")
        if curve:  # a task family whose episode is a learning history (algorithm distillation)
            tenth = max(1, len(curve) // 10)
            first, last = sum(curve[:tenth]) / tenth, sum(curve[-tenth:]) / tenth
            lines.append(f"in context: mean return per inner episode {first:.3f} in the first tenth of the history, "
                         f"{last:.3f} in the last (of {len(curve)}; the whole curve with --json)")
        return "\n".join(lines)


class Transitions(EnvironmentSteps):
    """Independent ``(s, a, r, s', done)`` transitions, drawn uniformly (BC, IQL, CQL, TD3+BC...)."""

    name = "transitions"
    summary = "independent (s, a, r, s', done) steps of a Minari dataset, scored by rolling the policy out"


class Trajectories(EnvironmentSteps):
    """Contiguous windows of one episode (the Decision Transformer, Trajectory Transformer, Diffuser).

    Reads ``slice_len`` (else ``context_len``, else 20) for the window length.
    """

    name = "trajectories"
    summary = "windows of contiguous steps of one episode of a Minari dataset, scored by rolling the policy out"
    config_fields = {**EnvironmentSteps.config_fields,
                     "slice_len": "window length (default: context_len, else 20)",
                     "context_len": "window length when slice_len is not declared"}

    def batch_layout(self, config) -> BatchLayout:
        base = super().batch_layout(config)
        slice_len = int(config_value(config, "slice_len", config_value(config, "context_len", 20)))
        if slice_len < 1:
            raise UserError(f"slice_len must be at least 1, got {slice_len}; fix it with --set slice_len=20")
        return BatchLayout(base.batch_size, "slice", slice_len)
