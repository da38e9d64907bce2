"""Text rollouts: online RL on a text task (GRPO, DAPO, Dr. GRPO, RLOO, expert iteration).

The data of a ``text-rollouts`` run is made while it trains. ``load`` gives a
:class:`~offline_plugins.data.rollouts.RolloutData`: the training and held-out prompts, the
reward (the task's verifier, exact match against a JSONL file's ``answer``, or ``--reward
module:function``), the frozen reference and a TorchRL replay buffer. :class:`RolloutRefill`
(the kind's callback) binds the policy being trained: at the first step of every round it
samples ``group_size`` responses to each of ``prompts_per_round`` prompts from the policy
as it is then, writes them into the buffer with the sampling and reference log-probs and
the loss's advantages, and hands out the round's minibatches for ``ppo_epochs`` passes.

A round trains on its rollout rows, or on rows made from them: an algorithm that declares
other training rows (:meth:`~offline_plugins.data.rollouts.RolloutData.train_on`, e.g. one
preference pair per prompt) gets them from ``data.training_rows(rollouts)`` once per round;
minibatches and ``updates_per_round`` count those rows (``data.rows_per_round``). The
checkpoint keeps the rollouts themselves, and the training rows are made from them again
on resume (a deterministic function of the rollouts).

Why the callback hands out the minibatches: the shell's batch stream draws a step's batch
before the previous step has trained (Lightning fetches one batch ahead, and with several
steps per call a whole call's batches at once), so a batch drawn there would come from a
policy a step or a call old. The callback runs right before the step, so a round is sampled
by the policy that has taken every update before it. A round ends a call (its length is one
of the callback's ``step_periods``). Minibatch ``m`` of epoch ``e`` of round ``r`` is a
slice of a permutation seeded by ``(seed, rank, r, e)``; prompts and sampling are seeded by
``(seed, rank, r)``, and the round being trained on is saved in checkpoints, so a resumed run
trains on exactly the rollouts of the uninterrupted one. Under DDP each rank samples its own
prompts; a resume there re-samples the current round on ranks other than 0 (Lightning keeps
rank 0's callback state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from offline_plugins.config import ROLLOUT_DEFAULTS
from offline_plugins.errors import UserError
from offline_plugins.plugins.datakind import (
    LOSS_PANEL,
    CurvePanel,
    DataKind,
    DataOptions,
    LoadedData,
    config_value,
    result_line,
)

__all__ = ["TextRollouts", "TextCompletions", "RolloutRefill", "RolloutEvaluation"]


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _make_classes():
    import torch
    from lightning.pytorch.callbacks import Callback

    from offline_plugins.data.rollouts import rollout_seed
    from offline_plugins.lightning.callbacks import ScheduledEvaluation
    from offline_plugins.lightning.data import StepBatches

    class RolloutRefill(Callback):
        """Samples a round of rollouts from the policy being trained and feeds its minibatches.

        Args:
            data: the run's :class:`~offline_plugins.data.rollouts.RolloutData`.
            parts: the algorithm's parts: ``parts.model`` samples, ``parts.loss.process_rollouts``
                writes the advantages (``parts.loss.dynamic_sampling``: drop groups without signal).

        Keyword Args:
            seed: the run's seed.
        """

        def __init__(self, data, parts, *, seed: int) -> None:
            self.data = data
            self.loss = parts.loss
            self.model = parts.model
            self.seed = int(seed)
            data.collector.seed = int(seed)
            self.round = -1
            self.rank = 0
            self.rollouts = None
            self.history: list[dict] = []
            self._pending = None
            data.refill = self

        @property
        def state_key(self) -> str:
            return "RolloutRefill"

        @property
        def step_periods(self) -> tuple[int, ...]:
            return (int(self.data.updates_per_round),)

        def _write(self, td) -> None:
            buffer = self.data.buffer
            device = buffer.storage.device if hasattr(buffer.storage, "device") else None
            make_rows = getattr(self.data, "training_rows", None)
            rows = td if make_rows is None else make_rows(td)
            buffer.empty()
            buffer.extend(rows.to(device) if device is not None and str(device) != "auto" else rows)
            self.rollouts = td

        def _ensure_round(self, trainer, r: int) -> None:
            if self._pending is not None:
                state, self._pending = self._pending, None
                if state["rank"] == trainer.global_rank and state["round"] == r:
                    self._write(state["td"])
                    self.round = r
            if r == self.round:
                return
            step = int(trainer.global_step)
            td, stats = self.data.collector.collect(
                self.model, round=r, rank=trainer.global_rank, process=self.loss.process_rollouts,
                dynamic_sampling=bool(getattr(self.loss, "dynamic_sampling", False)))
            self._write(td)
            self.round, self.rank = r, int(trainer.global_rank)
            self.history.append({"step": step, "round": r, **stats})
            metrics = {f"rollout/{k}": v for k, v in stats.items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            # the step bar counts updates; its title counts the rounds of rollouts and their reward
            bar = getattr(getattr(trainer, "progress_bar_callback", None), "train_progress_bar", None)
            if bar is not None and hasattr(bar, "set_description") and not getattr(bar, "disable", True):
                bar.set_description(f"train (rollouts {len(self.history)}, reward {stats['reward_mean']:.2f})",
                                    refresh=False)

        def _minibatch(self, step: int, rank: int):
            data = self.data
            r, j = divmod(step, data.updates_per_round)
            epoch, m = divmod(j, data.minibatches)
            g = torch.Generator().manual_seed(rollout_seed(self.seed, rank, r, epoch, 7))
            order = torch.randperm(getattr(data, "rows_per_round", data.collector.rows), generator=g)
            return data.buffer[order[m * data.batch_size:(m + 1) * data.batch_size]]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = int(trainer.global_step)
            u = self.data.updates_per_round
            rank = int(trainer.global_rank)
            if isinstance(batch, StepBatches):
                for i in range(len(batch.batches)):
                    self._ensure_round(trainer, (step + i) // u)
                    batch.batches[i] = self._minibatch(step + i, rank).to(batch.batches[i].device)
            else:
                self._ensure_round(trainer, step // u)
                batch.update(self._minibatch(step, rank).to(batch.device))

        def state_dict(self) -> dict[str, Any]:
            state: dict[str, Any] = {"round": self.round, "rank": self.rank, "history": list(self.history)}
            if self.rollouts is not None:
                td = self.rollouts
                state["tensors"] = td.exclude("text").cpu().to_dict()
                state["text"] = {k: [str(x) for x in td.get(("text", k)).tolist()] for k in ("prompt", "response")}
            return state

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            from tensordict import NonTensorStack, TensorDict

            self.history = list(state_dict.get("history", []))
            if "tensors" not in state_dict:
                return
            n = self.data.collector.rows
            td = TensorDict(state_dict["tensors"], batch_size=[n])
            for k, values in state_dict.get("text", {}).items():
                td.set(("text", k), NonTensorStack(*values, batch_size=[n]))
            self._pending = {"round": int(state_dict["round"]), "rank": int(state_dict.get("rank", 0)), "td": td}

    class RolloutEvaluation(ScheduledEvaluation):
        """Greedy responses to the held-out prompts every ``every`` steps and at the end.

        Logs ``eval/exact_match`` (against the rows' answers) and ``eval/heldout_reward``; the
        record also carries the last round's rollout figures (``reward_mean``,
        ``kl_to_reference``, ``response_length``, ``groups_without_signal``). ``before`` holds
        the reference's scores, measured when training starts.
        """

        def __init__(self, data, *, every: int = 0) -> None:
            self.data = data
            self.every = int(every)
            self.history: list[dict] = []
            self.before: Optional[dict] = None

        @property
        def state_key(self) -> str:
            return "RolloutEvaluation"

        def on_train_start(self, trainer, pl_module) -> None:
            if self.before is None and trainer.global_rank == 0:
                self.before = self.data.held_out_scores(self.data.reference)

        def _score(self, trainer, pl_module):
            scores = self.data.held_out_scores(pl_module.parts.model)
            refill = getattr(self.data, "refill", None)
            last = refill.history[-1] if refill is not None and refill.history else {}
            fields = {**scores, **{k: last.get(k) for k in ("reward_mean", "kl_to_reference", "response_length",
                                                            "groups_without_signal")}}
            metrics = {f"eval/{k}": v for k, v in scores.items() if v is not None}
            return fields, metrics

        def state_dict(self) -> dict[str, Any]:
            return {"history": list(self.history), "before": self.before}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.history = list(state_dict.get("history", []))
            self.before = state_dict.get("before")

    return RolloutRefill, RolloutEvaluation


_CLASSES = None


def __getattr__(name: str):
    # the callbacks subclass Lightning's: built on first use, so importing the kinds imports no torch
    global _CLASSES
    if name in ("RolloutRefill", "RolloutEvaluation"):
        if _CLASSES is None:
            _CLASSES = _make_classes()
        return _CLASSES[0] if name == "RolloutRefill" else _CLASSES[1]
    raise AttributeError(name)


class TextRollouts(DataKind):
    """Prompts with a reward, answered by the policy while it trains (online RL on text)."""

    name = "text-rollouts"
    summary = "prompts answered by the policy while it trains, scored by a verifier or a reward function"
    description = "a text task (prompts with a verifier or a reward)"
    # examples, not the list: 'list --kinds' names every algorithm of this kind, so a new online
    # method needs no edit here
    train_hint = ("train an online algorithm on it (grpo, ppo-rlhf, online-dpo, ...: 'offline-plugins list --kinds' "
                  "names them all)")
    config_fields = {
        "batch_size": "rollouts per gradient step (default 32; must divide prompts_per_round * group_size)",
        "group_size": "responses sampled per prompt, G >= 2 for the group methods (default 8; ppo-rlhf: 1)",
        "prompts_per_round": "prompts per round of rollouts (default 16)",
        "ppo_epochs": "passes over each round's rollouts (default 1)",
        "max_new_tokens": "response budget in tokens (default 6)",
        "temperature": "sampling temperature (default 1.0)",
        "top_p": "nucleus sampling (default 1.0: off)",
        "reference_sft_steps": "built-in task with --model tiny: SFT steps of the cached reference (default 2000)",
        "eval_prompts": "held-out prompts scored by greedy exact match (default 200)",
    }

    def claims(self, dataset: str) -> bool:
        from offline_plugins.data.rollouts import resolve_rollout_id

        return resolve_rollout_id(dataset) is not None

    def resolve(self, dataset: str, *, spec, registry) -> tuple[str, Optional[str]]:
        from offline_plugins.data.rollouts import RolloutError, resolve_rollout_id

        resolved = resolve_rollout_id(dataset)
        if resolved is None:
            raise RolloutError(f"{spec.name} trains on its own rollouts of a text task, but {dataset!r} is not one; "
                               "use arithmetic or a .jsonl file of prompt/answer rows (prompt rows with --reward "
                               "module:function)")
        return resolved, "tokens"

    def check_options(self, spec, options: DataOptions) -> None:
        for flag, on in (("--drop-nonfinite", options.drop_nonfinite), ("--drop-empty", options.drop_empty)):
            if on:
                raise UserError(f"{flag} applies to Minari datasets of environment steps; {spec.name!r} samples its "
                                f"own text rollouts: drop {flag}")

    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        from offline_plugins.data.rollouts import load_rollout_data

        kwargs = {k: config_value(config, k, default) for k, default in ROLLOUT_DEFAULTS.items()}
        # an algorithm that needs no groups (PPO) declares a smaller minimum than GRPO's G >= 2 (a
        # ClassVar of its config, not a field a user sets)
        data = load_rollout_data(dataset_id, model=options.model or "tiny", reward=options.reward,
                                 progress=progress, min_group_size=int(getattr(config, "min_group_size", 2)),
                                 **kwargs)
        return LoadedData(data, {})

    def batch_layout(self, config):
        from offline_plugins.plugins.datakind import BatchLayout

        return BatchLayout(int(config_value(config, "batch_size", ROLLOUT_DEFAULTS["batch_size"])))

    def run_settings(self, data, options: DataOptions) -> dict[str, Any]:
        return {"model": getattr(data, "model", None) or options.model or "tiny", "reward": options.reward}

    def reload_options(self, run: dict) -> DataOptions:
        return DataOptions(model=run.get("model", "tiny"), reward=run.get("reward"))

    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        from offline_plugins.kinds.rollouts import RolloutEvaluation

        evaluation = RolloutEvaluation(data, every=every)
        data.evaluation = evaluation  # the reward-hacking monitor reads its records
        return evaluation

    def callbacks(self, data, parts, *, seed: int) -> list:
        from offline_plugins.kinds.rollouts import RolloutRefill
        from offline_plugins.lightning.monitor import RewardHackingMonitor

        callbacks = [RolloutRefill(data, parts, seed=seed)]
        evaluation = getattr(data, "evaluation", None)
        if evaluation is not None:
            # the reward optimised (the rollouts' mean reward) against the held-out gold score: exact
            # match where the rows carry answers, else the reward on the held-out prompts
            gold = "exact_match" if data.source.has_answers else "heldout_reward"
            data.monitor = RewardHackingMonitor(evaluation, gold=gold, proxy="reward_mean", checkpoint="auto")
            callbacks.append(data.monitor)
        return callbacks

    def curve_panels(self) -> list:
        # held-out exact match beside the sampled responses' reward; the KL to the reference
        # beside the losses
        return [CurvePanel("held-out accuracy / reward", ("eval/exact_match", "eval/heldout_reward",
                                                          "rollout/reward_mean")),
                CurvePanel("loss / KL", (*LOSS_PANEL.columns, "rollout/kl_to_reference"),
                           prefixes=LOSS_PANEL.prefixes, log=True)]

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        before = evaluation.before or {}
        refill = getattr(data, "refill", None)
        rounds = refill.history if refill is not None else []
        mean = lambda key: (sum(r[key] for r in rounds) / len(rounds)) if rounds else None  # noqa: E731
        final = rounds[-1] if rounds else {}
        return {
            "exact_match_before": before.get("exact_match"),
            "exact_match_after": last.get("exact_match"),
            "heldout_reward_before": before.get("heldout_reward"),
            "heldout_reward_after": last.get("heldout_reward"),
            "reward_mean": final.get("reward_mean"),
            "reward_mean_first_round": rounds[0]["reward_mean"] if rounds else None,
            "kl_to_reference": final.get("kl_to_reference"),
            "response_length": final.get("response_length"),
            "groups_without_signal": mean("groups_without_signal"),
            "rounds": len(rounds),
            "heldout_prompts": len(data.source.held_out),
            "reward_hacking": data.monitor.report() if getattr(data, "monitor", None) is not None else None,
            "model_dir": None,
        }

    def export(self, parts, out: Path) -> dict[str, Any]:
        """The trained policy and its tokenizer as a ``save_pretrained`` folder ``out/model``."""
        from offline_plugins.kinds.preference import PreferenceText

        return PreferenceText.export(self, parts, out)

    def evaluate(self, module, data, *, episodes: int, seed: int, device: str) -> dict[str, Any]:
        return data.held_out_scores(module.parts.model)

    def describe(self, result: dict) -> str:
        after = result.get("exact_match_after", result.get("exact_match"))
        parts = []
        if after is not None:
            before = result.get("exact_match_before")
            parts.append(f"held-out exact match {_pct(before)} -> {_pct(after)}" if before is not None
                         else f"held-out exact match {_pct(after)}")
        else:
            reward = result.get("heldout_reward_after", result.get("heldout_reward"))
            before = result.get("heldout_reward_before")
            parts.append("held-out reward " + (f"{before:.3f} -> " if before is not None else "")
                         + ("n/a" if reward is None else f"{reward:.3f}"))
        if result.get("reward_mean") is not None:
            parts.append(f"rollout reward {result['reward_mean']:.3f}")
        if result.get("kl_to_reference") is not None:
            parts.append(f"KL to reference {result['kl_to_reference']:.3f}")
        if result.get("groups_without_signal") is not None:
            parts.append(f"groups without signal {_pct(result['groups_without_signal'])}")
        return result_line(result, parts)


class TextCompletions(TextRollouts):
    """Prompt/completion rows for supervised fine-tuning (``sft``): the way to make a reference."""

    name = "text-completions"
    summary = "(prompt, completion) text rows for supervised fine-tuning, scored by held-out exact match"
    description = "prompt/completion rows for supervised fine-tuning"
    train_hint = "train sft on it"
    config_fields = {
        "batch_size": "rows per gradient step (default 64)",
        "max_length": "token budget of prompt + completion (default 32)",
        "eval_prompts": "held-out rows scored by greedy exact match (default 200)",
    }

    def check_options(self, spec, options: DataOptions) -> None:
        if options.reward is not None:
            raise UserError(f"--reward applies to algorithms trained on their own rollouts (grpo...); {spec.name!r} "
                            "learns the completions of its rows: drop --reward")
        super().check_options(spec, options)

    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        from offline_plugins.data.rollouts import load_completion_data

        data = load_completion_data(dataset_id, model=options.model or "tiny",
                                    eval_prompts=int(config_value(config, "eval_prompts", 200)),
                                    max_length=int(config_value(config, "max_length", 32)))
        return LoadedData(data, {})

    def batch_layout(self, config):
        from offline_plugins.plugins.datakind import BatchLayout

        return BatchLayout(int(config_value(config, "batch_size", 64)))

    def callbacks(self, data, parts, *, seed: int) -> list:
        return []

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        before = evaluation.before or {}
        return {"exact_match_before": before.get("exact_match"), "exact_match_after": last.get("exact_match"),
                "train_rows": int(data.train.batch_size[0]), "heldout_prompts": len(data.held_out_rows),
                "model_dir": None}
