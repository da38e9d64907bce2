"""Preference data: (prompt, chosen, rejected) pairs and unpaired (prompt, completion, label) feedback.

Both kinds read a built-in task dataset, a ``.jsonl`` file or ``hf:NAME[:SPLIT]``
(:mod:`offline_plugins.text.data.preference_sources`), tokenised for the language model
given with ``--model`` (``tiny`` by default), with the reference model's log-probs cached
once. A run is scored on held-out pairs and prompts
(:class:`~offline_plugins.kinds.preference.evaluation.PreferenceEvaluation`), and the trained
policy is exported as a ``save_pretrained`` folder (``OUT/model``) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Unpaired feedback is what
KTO reads; pairs serve it too (each pair becomes a desirable and an undesirable row).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

from offline_plugins.data.files import atomic_folder
from offline_plugins.errors import UserError
from offline_plugins.plugins.datakind import (
    LOSS_PANEL,
    CurvePanel,
    DataKind,
    DataOptions,
    LoadedData,
    config_value,
    figures,
    pct,
    result_line,
)
from offline_plugins.text.data.preference_sources import (
    load_preference_source,
    resolve_preference_id,
    unknown_preference_dataset,
)

__all__ = ["PreferenceText", "PreferencePairs", "UnpairedFeedback"]


class PreferenceText(DataKind):
    """Prompts and responses with preference labels, for a language model (``--model``)."""

    description = "a preference dataset (prompts and responses)"
    train_hint = "train a preference algorithm on it (dpo, ipo, kto, orpo, simpo, reward-model)"

    def claims(self, dataset: str) -> bool:
        return resolve_preference_id(dataset) is not None

    def resolve(self, dataset: str, *, spec, registry) -> tuple[str, Optional[str]]:
        resolved = resolve_preference_id(dataset)
        if resolved is None:
            raise unknown_preference_dataset(dataset, spec.name)
        return resolved, "tokens"

    def check_options(self, spec, options: DataOptions) -> None:
        if options.reward is not None:
            raise UserError(f"--reward applies to algorithms trained on their own rollouts (grpo...); {spec.name!r} "
                            "learns from the labels of its preference data: drop --reward")
        for flag, on in (("--drop-nonfinite", options.drop_nonfinite), ("--drop-empty", options.drop_empty)):
            if on:
                raise UserError(
                    f"{flag} applies to Minari datasets of environment steps; {spec.name!r} reads preference data, "
                    f"whose loader refuses bad rows by name instead: drop {flag}"
                )

    def load(self, dataset_id: str, *, spec, config, registry, device: str, progress: bool,
             options: DataOptions) -> LoadedData:
        from offline_plugins.kinds.sft import supervised_finetune

        data = load_preference_source(dataset_id, kind=self.name, algorithm=spec.name, model=options.model or "tiny",
                                      progress=progress, finetune=supervised_finetune,
                                      reference_sft_steps=config_value(config, "reference_sft_steps", None))
        data.eval_prompts = int(config_value(config, "eval_prompts", 500))  # PreferenceEvaluation's exact-match prompts
        return LoadedData(data, {})

    def run_settings(self, data, options: DataOptions) -> dict[str, Any]:
        return {"model": getattr(data, "model", None) or options.model or "tiny"}

    def reload_options(self, run: dict) -> DataOptions:
        return DataOptions(model=run.get("model", "tiny"))

    def check_scale(self, config, data, layout, *, accumulate: int = 1, device: Any = None) -> None:
        """No batch larger than the training rows, and a micro-batch of pairs (two sequences each;
        unpaired feedback: one) whose forward and backward fit in memory."""
        from offline_plugins.kinds._scale import check_lm_batch

        train = data.train
        paired = train.batch_dims == 2
        check_lm_batch(config, data.reference, batch_size=layout.batch_size, rows=int(train.batch_size[0]),
                       what="training pairs" if paired else "training rows", per_row=2 if paired else 1,
                       length=int(train.get(("tokens", "full")).shape[-1]), accumulate=accumulate, device=device)

    def evaluation(self, data, *, every: int, episodes: int, seed: int):
        from offline_plugins.kinds.preference.evaluation import PreferenceEvaluation

        return PreferenceEvaluation(data, every=every, exact_match_n=getattr(data, "eval_prompts", 500))

    def curve_panels(self) -> list:
        return [CurvePanel("held-out accuracy", ("eval/preference_accuracy", "eval/likelihood_accuracy",
                                                 "eval/exact_match")), LOSS_PANEL]

    def summary_fields(self, evaluation, data, *, eval_episodes: int) -> dict[str, Any]:
        last = evaluation.history[-1] if evaluation.history else {}
        before = evaluation.before or {}
        return {
            "preference_accuracy": last.get("preference_accuracy"),
            "likelihood_accuracy": last.get("likelihood_accuracy"),
            "likelihood_accuracy_before": before.get("likelihood_accuracy"),
            "kl_to_reference": last.get("kl_to_reference"),
            "exact_match_before": before.get("exact_match"),
            "exact_match_after": last.get("exact_match"),
            # split sizes, and the training-split accuracy beside the held-out one
            **evaluation.summary_extra(),
            "model_dir": None,
        }

    def export(self, parts, out: Path) -> dict[str, Any]:
        """The trained policy's language model and tokenizer as a ``save_pretrained`` folder ``out/model``;
        a LoRA run also writes its adapters to ``out/adapter`` (``peft.PeftModel.from_pretrained``)
        and ``out/model`` holds the merged weights. Each folder is written beside its place and swapped
        in whole (:func:`~offline_plugins.data.files.atomic_folder`): a full disk leaves the previous one."""
        from offline_plugins.lightning.files import RESUME_FIX

        model = parts.model
        if model is None or not hasattr(model, "save_pretrained"):
            from offline_plugins.modules.causal_lm import CausalLMReward

            if isinstance(parts.policy, CausalLMReward):  # a reward model: backbone, tokenizer, head, json
                from offline_plugins.text.sources.reward_source import save_reward_model

                with atomic_folder(out / "reward_model", fix=RESUME_FIX) as folder:
                    save_reward_model(parts.policy, parts.tokenizer, folder)
                return {"reward_model_dir": str(out / "reward_model")}
            return {}
        # transformers shows a progress bar per shard; a run's one small file needs none
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        written = {}
        tokenizer = parts.tokenizer if hasattr(parts.tokenizer, "save_pretrained") else None
        try:
            if hasattr(model, "merge_and_unload"):  # LoRA (peft): the adapters, and the merged model

                with atomic_folder(out / "adapter", fix=RESUME_FIX) as folder:
                    model.save_pretrained(folder)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(folder)
                written["adapter_dir"] = str(out / "adapter")
                model = copy.deepcopy(model).merge_and_unload()
            with atomic_folder(out / "model", fix=RESUME_FIX) as folder:
                model.save_pretrained(folder)
                if tokenizer is not None:
                    tokenizer.save_pretrained(folder)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        return {"model_dir": str(out / "model"), **written}

    def evaluate(self, module, data, *, episodes: int, seed: int, device: str) -> dict[str, Any]:
        from offline_plugins.eval.preference import evaluate_preference_model

        return evaluate_preference_model(module.policy, data, model=module.parts.model,
                                         reference=module.parts.reference)

    def describe(self, result: dict) -> str:
        parts = [f"held-out preference accuracy {pct(result.get('preference_accuracy'))}",
                 *figures(result, "exact match", "exact_match"),
                 *figures(result, "KL to reference", "kl_to_reference", fmt="{:.3f}".format)]
        return result_line(result, parts)


class PreferencePairs(PreferenceText):
    """(prompt, chosen, rejected) pairs: DPO, IPO, ORPO, SimPO, reward models."""

    name = "preference-pairs"
    summary = "(prompt, chosen, rejected) text pairs, scored by held-out pairwise accuracy and KL to the reference"


class UnpairedFeedback(PreferenceText):
    """(prompt, completion, desirable?) rows: KTO. Paired datasets are split into such rows."""

    name = "unpaired-feedback"
    summary = "(prompt, completion, desirable?) text rows, scored as pairs on held-out data"
