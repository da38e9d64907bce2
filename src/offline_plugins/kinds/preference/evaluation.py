"""The evaluation of a model trained on preference data: held-out pairwise accuracy, KL to the reference
and the task's exact match, every few steps and at the end (:class:`PreferenceEvaluation`)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from offline_plugins.errors import UserError
from offline_plugins.eval.preference import evaluate_preference_model, pairwise_scores
from offline_plugins.lightning.callbacks import ScheduledEvaluation
from offline_plugins.lightning.fsdp import is_sharded
from offline_plugins.modules.causal_lm import CausalLMLogProbs

__all__ = ["PreferenceEvaluation"]


class PreferenceEvaluation(ScheduledEvaluation):
    """Score a preference-trained model on the held-out data every ``every`` steps and at the end.

    Logs ``eval/preference_accuracy``, ``eval/likelihood_accuracy``,
    ``eval/kl_to_reference`` and ``eval/exact_match`` (those that apply; see
    :func:`offline_plugins.eval.preference.evaluate_preference_model`), and
    ``eval/train_preference_accuracy``: the same pairwise accuracy on a fixed sample of
    training pairs (as many as are held out, at least 100), so a model that memorises
    its training pairs without generalising shows as a gap between the two. ``before``
    holds the reference model's scores, measured once when training starts (the
    starting point every number is compared to); both are saved in checkpoints.

    Args:
        data: the run's :class:`~offline_plugins.text.data.preference.PreferenceData`.

    Keyword Args:
        every: evaluate every this many gradient steps (0: only at the end).
        exact_match_n: held-out task prompts scored by exact match.
        train_sample: training pairs scored for ``train_preference_accuracy`` (None: as
            many as are held out, at least 100); 0 disables it.
    """

    def __init__(self, data: Any, *, every: int = 0, exact_match_n: int = 500,
                 train_sample: Optional[int] = None) -> None:
        self.data = data
        self.every = int(every)
        self.exact_match_n = int(exact_match_n)
        self.history: list[dict] = []
        self.before: Optional[dict] = None
        if train_sample is not None and int(train_sample) < 0:
            raise UserError(f"train_sample must be 0 (off) or positive, got {train_sample}")
        self.train_sample = train_sample
        self._train_subset = None

    @property
    def state_key(self) -> str:
        return "PreferenceEvaluation"

    @staticmethod
    def _count(td) -> int:
        return int(td.batch_size[0]) if td is not None else 0

    def _training_pairs(self):
        """A fixed sample of the training pairs (the same rows at every evaluation)."""
        if self._train_subset is None:
            pairs = getattr(self.data, "train_pairs", None)
            n_train = self._count(pairs)
            want = self.train_sample
            if want is None:
                want = max(self._count(getattr(self.data, "test_pairs", None)), 100)
            want = min(int(want), n_train)
            if want == 0:
                return None
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(0))[:want]
            self._train_subset = pairs[order.to(pairs.device) if pairs.device is not None else order]
        return self._train_subset

    def _reference(self, pl_module):
        """The reference the policy is compared with: the run's (LoRA: the policy with its adapters off),
        else the data's."""
        reference = getattr(pl_module.parts, "reference", None)
        return reference if reference is not None else self.data.reference

    def _reference_scores(self, pl_module) -> dict:
        reference = self._reference(pl_module)
        scores = evaluate_preference_model(CausalLMLogProbs(reference), self.data, model=reference,
                                           exact_match_n=self.exact_match_n, kl=False)
        # the reference's implicit reward is 0 on every response, and its KL to itself 0
        return {"exact_match": scores["exact_match"], "likelihood_accuracy": scores["likelihood_accuracy"]}

    def on_train_start(self, trainer, pl_module) -> None:
        # a reward model (no language model to generate with) has no "before" to compare to
        if self.before is None and pl_module.parts.model is not None:
            # a LoRA reference is the policy with its adapters off: sharded, it scores on every rank
            if trainer.global_rank == 0 or is_sharded(self._reference(pl_module)):
                before = self._reference_scores(pl_module)
                self.before = before if trainer.global_rank == 0 else None

    def _score(self, trainer, pl_module) -> tuple[dict, dict]:
        scores = evaluate_preference_model(pl_module.policy, self.data, model=pl_module.parts.model,
                                           exact_match_n=self.exact_match_n, reference=self._reference(pl_module))
        train_pairs = self._training_pairs()
        scores["train_preference_accuracy"] = None
        if train_pairs is not None:
            policy = pl_module.policy
            was_training = policy.training
            policy.eval()
            try:
                scores["train_preference_accuracy"] = pairwise_scores(policy, train_pairs)["preference_accuracy"]
            finally:
                policy.train(was_training)
        return scores, {f"eval/{k}": v for k, v in scores.items() if v is not None}

    def summary_extra(self) -> dict[str, Any]:
        """What ``summary.json`` adds for a preference run: split sizes and the training-pair accuracy."""
        last = self.history[-1] if self.history else {}
        train_pairs = getattr(self.data, "train_pairs", None)
        return {
            "train_preference_accuracy": last.get("train_preference_accuracy"),
            "train_pairs": self._count(train_pairs) if train_pairs is not None else None,
            "train_rows": self._count(getattr(self.data, "train", None)),
            "heldout_pairs": self._count(getattr(self.data, "test_pairs", None)),
            "train_accuracy_pairs": self._count(self._train_subset),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "before": self.before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.before = state_dict.get("before")
