"""A live check that the sampler holds the trainer's weights: :class:`SyncCheck`.

An online run whose rounds are sampled by another engine (``--generator vllm``) trusts that
the engine's weights are the policy's after each weight load. A load that did not happen
(a failed or skipped sync, an engine that kept serving older weights, e.g. out of a sleep mode)
makes every later round off-policy without any error. The check measures it where it shows:
the sampler's log-probs of its own sampled tokens against the trainer's forward of the same
tokens, on a round sampled right after a weight load (``sampler lag 0``), when the two should
agree up to the engines' numerics. It reports the mean absolute per-token gap (nats) and the
normalised effective sample size of the token weights ``pi_trainer / pi_sampler``
(``(sum w)^2 / (n sum w^2)``, 1 when they agree); above ``warn`` it warns, above ``stop`` the run
stops with one line naming the likely cause.

What the gap is when all is well: float32 on CPU, the trainer's forward and the engine differ by
about 5e-7 nats (docs/online.md, "Sampling with vLLM"); a bf16 engine against a trainer is
reported at about 0.015 and a stale engine at about 0.2 (the TRL issue the check answers). The
defaults warn at 0.05 and stop at 0.5.

>>> check = SyncCheck(every=2)
>>> [check.due(r, lag=0) for r in range(4)], check.due(5, lag=3)
([True, True, True, True], False)
>>> check.last = 1; check.due(2, lag=0), check.due(3, lag=0)
(False, True)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs

__all__ = ["SyncCheck", "SyncCheckError", "SyncCheckWarning", "SYNC_CHECK_EVERY_VLLM"]

#: rounds between checks when the run samples with ``--generator vllm`` and sets none
SYNC_CHECK_EVERY_VLLM = 10


class SyncCheckError(UserError, RuntimeError):
    """The sampler's log-probs are far from the trainer's on a round that should agree."""


class SyncCheckWarning(UserWarning):
    """The sampler's log-probs drift from the trainer's beyond the warning threshold."""


@dataclass
class SyncCheck:
    """Every ``every`` rounds (among those sampled right after a weight load), score ``rows`` of the
    round's responses with the trainer and compare with the sampler's log-probs.

    Attributes:
        every: rounds between checks (0: off).
        warn, stop: mean absolute per-token log-prob gaps (nats) above which the check warns, stops.
        rows: responses scored per check (the round's first ones).
        sampler: what samples, for the messages (``"--generator vllm"``).
        last: the round of the last check; ``history``: every check's figures.
    """

    every: int
    warn: float = 0.05
    stop: float = 0.5
    rows: int = 32
    sampler: str = "the sampler"
    last: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise UserError(f"sync_check_every must be a whole number of rounds >= 0 (0: off), got {self.every!r}")
        if not (0 < float(self.warn) < float(self.stop)):
            raise UserError(f"sync_check_warn ({self.warn!r}) must be > 0 and below sync_check_stop ({self.stop!r}); "
                            "e.g. --set sync_check_warn=0.05 --set sync_check_stop=0.5")
        self.history: list[dict] = []

    def due(self, round: int, *, lag: int) -> bool:
        """Whether round ``round``, sampled by weights ``lag`` optimiser steps older than the policy's,
        is checked: only right after a load (``lag == 0``), at least ``every`` rounds after the last."""
        return self.every > 0 and int(lag) == 0 and (self.last is None or int(round) - self.last >= self.every)

    @torch.no_grad()
    def measure(self, model: torch.nn.Module, rollouts: Any) -> dict[str, float]:
        """The gap between the sampler's log-probs (``("log_probs", "full")``) of ``rows`` of the
        round's responses and ``model``'s: ``sync_logprob_gap`` (mean absolute, per response token),
        ``sync_max_gap``, ``sync_ess`` and ``sync_tokens``."""
        td = rollouts[: min(int(self.rows), rollouts.batch_size[0])]
        tokens, attn = td.get(("tokens", "full")), td.get(("masks", "all_attention_mask"))
        mask = td.get(("masks", "all_assistant_mask")).bool()
        was_training = model.training
        model.eval()  # dropout off: the sampler samples without it
        try:
            trainer = CausalLMLogProbs(model).log_probs(tokens.to(_device(model)), attn.to(_device(model)))
        finally:
            model.train(was_training)
        diff = (trainer.float().cpu() - td.get(("log_probs", "full")).float().cpu())[mask.cpu()]
        if diff.numel() == 0:
            return {"sync_logprob_gap": 0.0, "sync_max_gap": 0.0, "sync_ess": 1.0, "sync_tokens": 0.0}
        w = diff.clamp(-30, 30).exp()
        ess = float(w.sum() ** 2 / (diff.numel() * (w * w).sum()))
        return {"sync_logprob_gap": float(diff.abs().mean()), "sync_max_gap": float(diff.abs().max()),
                "sync_ess": ess, "sync_tokens": float(diff.numel())}

    def after_round(self, model: torch.nn.Module, rollouts: Any, *, round: int, step: int,
                    lag: int) -> Optional[dict[str, float]]:
        """Check round ``round`` when it is due: its figures (None when not due); a
        :class:`SyncCheckWarning` above ``warn``, a :class:`SyncCheckError` above ``stop``."""
        if not self.due(round, lag=lag):
            return None
        stats = self.measure(model, rollouts)
        self.last = int(round)
        self.history.append({"round": int(round), "step": int(step), **stats})
        gap = stats["sync_logprob_gap"]
        said = (f"{self.sampler}'s log-probs of its own {int(stats['sync_tokens'])} sampled tokens differ from the "
                f"trainer's by {gap:.3g} nats a token on average (max {stats['sync_max_gap']:.3g}, effective sample "
                f"size {stats['sync_ess']:.3f}) at step {step}, round {round}, sampled right after a weight load")
        if gap > self.stop or not math.isfinite(gap):
            raise SyncCheckError(
                f"sync check: {said}, past the stop threshold {self.stop:g}: the sampler is not holding the "
                "trainer's weights (a weight load that failed or was skipped, an engine serving older weights, "
                "e.g. after a sleep; or another model or precision than the trainer's); the run stops, its last "
                "checkpoint kept. Check the generator's weight sync, or raise --set sync_check_stop=X if the "
                "engines' numerics differ that much")
        if gap > self.warn:
            warnings.warn(SyncCheckWarning(
                f"sync check: {said}, past the warning threshold {self.warn:g}: the sampler's weights or numerics "
                "differ from the trainer's (the rollout correction accounts for some of it)"), stacklevel=2)
        return stats

    def state_dict(self) -> dict:
        return {"last": self.last, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.last = state.get("last")
        self.history = list(state.get("history", []))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
