"""Text rollouts: online RL on text (GRPO, DAPO, Dr. GRPO, RLOO, PPO-RLHF, online DPO, ...).

The data of a ``text-rollouts`` run is made while it trains. ``load`` gives a
:class:`~offline_plugins.text.data.rollouts.RolloutData`: the training and held-out prompts, the
reward (the task's verifier, exact match against a JSONL file's ``answer``, or ``--reward
module:function``), the frozen reference and the sampling settings. The algorithm's ``build``
says how a round is made (``AlgorithmParts.rollout``, a
:class:`~offline_plugins.algorithms.base.RolloutPlan`), and the kind's own data module,
:class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`, runs the rounds: it samples
from the policy being trained, writes the round's training rows into a TorchRL replay buffer,
hands out its minibatches and keeps the round in checkpoints. The evaluation,
:class:`~offline_plugins.kinds.rollouts.evaluation.RolloutEvaluation`, scores greedy responses to
the held-out prompts and watches for reward hacking.

Importing this module imports no torch or Lightning (``offline-plugins list`` reads the
kinds): the hooks import them when a run needs them.
"""

from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Any, Optional

from offline_plugins.config import ROLLOUT_DEFAULTS
from offline_plugins.errors import UserError
from offline_plugins.kinds.preference import PreferenceText
from offline_plugins.plugins.datakind import (
    LOSS_PANEL,
    BatchLayout,
    CurvePanel,
    DataKind,
    DataOptions,
    LoadedData,
    check_memory,
    config_value,
    figures,
    result_line,
)
from offline_plugins.text.tasks.ids import resolve_rollout_id, text_task_names, text_tasks

__all__ = ["TextRollouts", "TextCompletions"]

#: the settings the kind reads at load: the prompts, the reference and how responses are sampled
#: (how a round is trained on is the algorithm's: its RolloutPlan)
_LOAD_SETTINGS = ("group_size", "prompts_per_round", "max_new_tokens", "temperature", "top_p", "reference_sft_steps",
                  "eval_prompts", "max_attempts", "reward_timeout", "reward_on_failure", "reward_workers", "max_turns", "tools",
                  "tool_timeout", "tool_reward", "tool_sandbox", "reward_weights")


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
        "max_new_tokens": "response budget in tokens (default: the task's own, 6 for a prompt file)",
        "temperature": "sampling temperature (default 1.0)",
        "top_p": "nucleus sampling (default 1.0: off)",
        "reference_sft_steps": "built-in task with a built-in --model (tiny, small): SFT steps of the cached reference (default: the task's own)",
        "eval_prompts": "held-out prompts scored by greedy exact match (default 200)",
        "reward_timeout": "seconds one call of the reward function may take (default 60; 0: no limit)",
        "reward_on_failure": "reward of a response its reward call raised, exited or hung on (default 0)",
        "reward_workers": "where reward calls run: thread (default) or process (a call past its limit is killed)",
        "max_turns": "multi-turn tasks: turns per episode (default: the task's, 3 for tool-arithmetic)",
        "tools": "multi-turn tasks: the tools, comma-separated, of calculator and python (default: the task's)",
        "tool_timeout": "multi-turn tasks: seconds one Python tool call may take (default 5)",
        "tool_reward": "multi-turn tasks: reward of a turn whose tool call answered the problem (default 0)",
        "tool_sandbox": "multi-turn tasks with the python tool: where its code runs (default bwrap; "
                        "'offline-plugins list' shows the sandboxes)",
    }

    def claims(self, dataset: str) -> bool:
        return resolve_rollout_id(dataset) is not None

    def resolve(self, dataset: str, *, spec, registry) -> tuple[str, Optional[str]]:
        from offline_plugins.text.data.rollouts import RolloutError

        resolved = resolve_rollout_id(dataset, registry)
        if resolved is None:
            names = [a for t in text_tasks(registry).values() for a in (t.id, *t.aliases)]
            close = difflib.get_close_matches(dataset.strip(), names, n=2, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise RolloutError(f"{spec.name} trains on its own rollouts of a text task, but {dataset!r} is not one; "
                               f"{hint}use a registered task ({text_task_names(registry)}; 'offline-plugins data "
                               "list') or a .jsonl file of prompt/answer rows (prompt rows with --reward "
                               "module:function)")
        return resolved, "tokens"

    def check_options(self, spec, options: DataOptions) -> None:
        for flag, on in (("--drop-nonfinite", options.drop_nonfinite), ("--drop-empty", options.drop_empty)):
            if on:
                raise UserError(f"{flag} applies to Minari datasets of environment steps; {spec.name!r} samples its "
                                f"own text rollouts: drop {flag}")

    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        from offline_plugins.kinds.sft import supervised_finetune
        from offline_plugins.text.data.rollouts import load_rollout_data

        kwargs = {k: config_value(config, k, ROLLOUT_DEFAULTS[k]) for k in _LOAD_SETTINGS}
        data = load_rollout_data(dataset_id, model=options.model or "tiny", reward=options.reward,
                                 progress=progress, finetune=supervised_finetune, **kwargs)
        if getattr(config, "max_new_tokens", 0) is None:  # unset: the task's own, recorded with the run
            config.max_new_tokens = data.settings.max_new_tokens
        return LoadedData(data, {})

    def batch_layout(self, config):
        return BatchLayout(int(config_value(config, "batch_size", ROLLOUT_DEFAULTS["batch_size"])))

    def check_scale(self, config, data, layout, *, accumulate: int = 1, device: Any = None) -> None:
        """A round (``prompts_per_round * group_size`` responses generated and scored by the
        reference at once) and a micro-batch of rollouts whose forward and backward fit in memory."""
        from offline_plugins.kinds._scale import check_lm_batch
        from offline_plugins.modules.causal_lm import forward_memory_bytes

        c = data.settings
        rows = c.rows
        check_memory(forward_memory_bytes(data.reference, rows, data.width, backward=False, optimizer=False),
                     device=device, what=f"a round of {rows} responses (prompts_per_round {c.prompts_per_round} x "
                     f"group_size {c.group_size}, {data.width} tokens each)",
                     fix="lower --set prompts_per_round or --set group_size")
        # (that a batch divides the round is the data module's check, with the algorithm's rows per round)
        check_lm_batch(config, data.reference, batch_size=layout.batch_size, rows=None, what="rollouts",
                       per_row=1, length=data.width, accumulate=accumulate, device=device)

    def run_settings(self, data, options: DataOptions) -> dict[str, Any]:
        return {"model": getattr(data, "model", None) or options.model or "tiny", "reward": options.reward}

    def reload_options(self, run: dict) -> DataOptions:
        return DataOptions(model=run.get("model", "tiny"), reward=run.get("reward"))

    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        from offline_plugins.kinds.rollouts.evaluation import RolloutEvaluation

        # the reward optimised (the rollouts' mean reward) against the held-out gold score the data
        # names: the task's own verifier where --reward replaced it, exact match where the reward is
        # exact match against answers, else the reward on the held-out prompts
        if not every and data.gold_key is not None:
            from offline_plugins.kinds.rollouts.monitor import RewardHackingWarning

            warnings.warn(RewardHackingWarning(
                "with --eval-every 0 the held-out prompts are scored only at the end, so the reward-hacking monitor "
                "sees one point and cannot warn; give --eval-every N (the default is a fifth of --steps)"), stacklevel=2)
        return RolloutEvaluation(data, every=every, gold=data.gold_key)

    def datamodule(self, data, parts, *, batch_size: int, seed: int):
        from offline_plugins.kinds.rollouts.rounds import RolloutDataModule

        return RolloutDataModule(data, parts, batch_size=batch_size, seed=seed)

    def curve_panels(self) -> list:
        # held-out exact match beside the sampled responses' reward; the KL to the reference
        # beside the losses
        return [CurvePanel("held-out accuracy / reward", ("eval/exact_match", "eval/heldout_gold",
                                                          "eval/heldout_reward", "rollout/reward_mean")),
                CurvePanel("loss / KL", (*LOSS_PANEL.columns, "rollout/kl_to_reference"),
                           prefixes=LOSS_PANEL.prefixes, log=True)]

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        before = evaluation.before or {}
        rounds = evaluation.rounds.history if evaluation.rounds is not None else []
        mean = lambda key: (sum(r[key] for r in rounds) / len(rounds)) if rounds else None  # noqa: E731
        final = rounds[-1] if rounds else {}
        return {
            "exact_match_before": before.get("exact_match"),
            "exact_match_after": last.get("exact_match"),
            "heldout_reward_before": before.get("heldout_reward"),
            "heldout_reward_after": last.get("heldout_reward"),
            # the task's verifier where --reward replaced it (the gold the proxy is judged against)
            "heldout_gold_before": before.get("heldout_gold"),
            "heldout_gold_after": last.get("heldout_gold"),
            "response_chars_before": before.get("response_chars"),
            "response_chars_after": last.get("response_chars"),
            "reward_mean": final.get("reward_mean"),
            "reward_mean_first_round": rounds[0]["reward_mean"] if rounds else None,
            "kl_to_reference": final.get("kl_to_reference"),
            "response_length": final.get("response_length"),
            "groups_without_signal": mean("groups_without_signal"),
            "rounds": len(rounds),
            "heldout_prompts": len(data.source.held_out),
            "reward_hacking": evaluation.monitor.report() if evaluation.monitor is not None else None,
            "gold_key": evaluation.monitor.gold if evaluation.monitor is not None else None,
            "model_dir": None,
        }

    def export(self, parts, out: Path) -> dict[str, Any]:
        """The trained policy and its tokenizer as a ``save_pretrained`` folder ``out/model``."""
        return PreferenceText.export(self, parts, out)

    def evaluate(self, module, data, *, episodes: int, seed: int, device: str) -> dict[str, Any]:
        return data.held_out_scores(module.parts.model, plan=module.parts.rollout)

    def describe(self, result: dict) -> str:
        three = "{:.3f}".format
        parts = (figures(result, "held-out exact match", "exact_match")
                 or figures(result, "held-out reward", "heldout_reward", fmt=three) or ["held-out reward n/a"])
        gold = figures(result, "held-out gold", "heldout_gold", fmt=three)
        if gold:  # --reward replaced the task's verifier: its score beside the proxy's
            parts = [*gold, *figures(result, "held-out proxy", "heldout_reward", fmt=three), *parts[:1]]
        elif result.get("gold_key") == "heldout_reward" and figures(result, "", "exact_match"):
            # a graded verifier beside answers (LengthTask): the verifier's score first
            parts = [*figures(result, "held-out reward", "heldout_reward", fmt=three), *parts[:1]]
        parts += [*figures(result, "rollout reward", "reward_mean", fmt=three),
                  *figures(result, "KL to reference", "kl_to_reference", fmt=three),
                  *figures(result, "groups without signal", "groups_without_signal")]
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
        from offline_plugins.text.data.rollouts import load_completion_data

        data = load_completion_data(dataset_id, model=options.model or "tiny",
                                    eval_prompts=int(config_value(config, "eval_prompts", 200)),
                                    max_length=int(config_value(config, "max_length", 32)))
        return LoadedData(data, {})

    def batch_layout(self, config):
        return BatchLayout(int(config_value(config, "batch_size", 64)))

    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        from offline_plugins.kinds.rollouts.evaluation import RolloutEvaluation

        return RolloutEvaluation(data, every=every, gold=None)

    def datamodule(self, data, parts, *, batch_size: int, seed: int):
        return None  # the shell's ReplayDataModule over the rows

    def check_scale(self, config, data, layout, *, accumulate: int = 1, device: Any = None) -> None:
        from offline_plugins.kinds._scale import check_lm_batch

        check_lm_batch(config, data.reference, batch_size=layout.batch_size, rows=int(data.train.batch_size[0]),
                       what="training rows", per_row=1, length=int(data.train.get(("tokens", "full")).shape[-1]),
                       accumulate=accumulate, device=device)

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        before = evaluation.before or {}
        verified = getattr(data, "verifier", None) is not None  # a worked solution's final answer, checked
        return {"exact_match_before": before.get("exact_match"), "exact_match_after": last.get("exact_match"),
                **({"heldout_reward_before": before.get("heldout_reward"),
                    "heldout_reward_after": last.get("heldout_reward"), "gold_key": "heldout_reward"}
                   if verified else {}),
                "train_rows": int(data.train.batch_size[0]), "heldout_prompts": len(data.held_out_rows),
                "model_dir": None}
