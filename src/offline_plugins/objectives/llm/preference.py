"""DPO and its family as TorchRL loss modules: DPO (cDPO), robust DPO, RPO, IPO, KTO, ORPO, SimPO.

All read TorchRL's LLM keys on the batch layout of DESIGN.md and run the policy once
over every row (``B*2`` for pairs). Each ``forward`` returns ``loss_*`` terms to sum
and detached diagnostics (``preference_accuracy``, ``reward_margin``,
``reward_chosen``, ``reward_rejected``, ``log_prob_chosen``, ``log_prob_rejected`` and,
with reference log-probs, ``likelihood_collapse``). The formulas live in
:mod:`offline_plugins.objectives.llm.functional`.

Variants are subclasses overriding one hook: :meth:`DPOLoss.pair_loss` (robust DPO,
IPO) or :meth:`DPOLoss.auxiliary_loss` (RPO's NLL term). Conservative DPO stays a
keyword (``label_smoothing``) of :class:`DPOLoss` because it is one hyperparameter of
the same formula (at 0 it is DPO), not a different objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from offline_plugins.objectives.llm import functional as F
from offline_plugins.objectives.llm.common import PreferenceInputError, PreferenceLossBase

__all__ = ["DPOLoss", "RobustDPOLoss", "RPOLoss", "IPOLoss", "KTOLoss", "ORPOLoss", "SimPOLoss"]


class DPOLoss(PreferenceLossBase):
    """Direct Preference Optimization: a logistic loss on implicit-reward differences.

    Rafailov et al. 2023, arXiv:2305.18290. ``loss = -log sigmoid(beta * (Delta_w - Delta_l))``
    with ``Delta = log pi(y|x) - log pi_ref(y|x)`` summed over response tokens; with
    ``label_smoothing = eps`` it is conservative DPO (cDPO).

    Args:
        actor_network: writes per-token log-probs at ``tensor_keys.log_probs`` from the
            tokens (e.g. :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`).
            ``None`` reads log-probs already in the batch.

    Keyword Args:
        beta (float): inverse temperature of the implicit reward. Defaults to ``0.1``.
        label_smoothing (float): assumed label-flip rate eps in ``[0, 0.5)``. Defaults to ``0.0``.
        reduction (str): ``"mean"``, ``"sum"`` or ``"none"``. Defaults to ``"mean"``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> _ = torch.manual_seed(0)
        >>> actor = CausalLMLogProbs(torch.nn.Embedding(8, 8))
        >>> tokens = torch.randint(0, 8, (4, 2, 6))
        >>> batch = TensorDict({
        ...     "tokens": {"full": tokens},
        ...     "masks": {"all_attention_mask": torch.ones(4, 2, 6, dtype=torch.bool),
        ...               "all_assistant_mask": torch.arange(6).expand(4, 2, 6) >= 3},
        ...     "ref_log_probs": {"response": torch.full((4, 2), -6.0)}}, [4, 2])
        >>> out = DPOLoss(actor, beta=0.1)(batch)
        >>> out["loss_dpo"].shape, sorted(k for k in out.keys() if "loss" in k)
        (torch.Size([]), ['loss_dpo'])
        >>> out["loss_dpo"].backward()
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_dpo",)

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename with ``set_keys``.

        Attributes:
            tokens: prompt + response token ids, right-padded, ``[B, 2, T]``.
                Defaults to ``("tokens", "full")``.
            attention_mask: real tokens, ``[B, 2, T]``. Defaults to ``("masks", "all_attention_mask")``.
            response_mask: response tokens (the ones scored), ``[B, 2, T]``.
                Defaults to ``("masks", "all_assistant_mask")``.
            log_probs: per-token policy log-probs the actor writes. Defaults to ``("log_probs", "full")``.
            ref_log_prob: reference log-prob of each response, summed over its tokens, fp32,
                ``[B, 2]``. Defaults to ``("ref_log_probs", "response")``.
        """

        tokens: NestedKey = ("tokens", "full")
        attention_mask: NestedKey = ("masks", "all_attention_mask")
        response_mask: NestedKey = ("masks", "all_assistant_mask")
        log_probs: NestedKey = ("log_probs", "full")
        ref_log_prob: NestedKey = ("ref_log_probs", "response")

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    loss_name = "loss_dpo"
    uses_reference = True
    length_normalize = False

    def __init__(
        self,
        actor_network: Optional[torch.nn.Module] = None,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
    ) -> None:
        super().__init__(actor_network, reduction=reduction)
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"{type(self).__name__}: label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.register_buffer("beta", torch.tensor(float(beta)))
        self.register_buffer("label_smoothing", torch.tensor(float(label_smoothing)))

    def pair_loss(
        self,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
    ) -> torch.Tensor:
        """Per-pair loss from (possibly length-averaged) log-probs; the hook variants override."""
        return F.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, label_smoothing=self.label_smoothing)

    def auxiliary_loss(self, td_out: TensorDict, logps: torch.Tensor, counts: torch.Tensor) -> None:
        """Extra ``loss_*`` terms written into ``td_out``; none for DPO."""

    def reward_scale(self) -> torch.Tensor:
        return self.beta

    def _reference(self, td: TensorDictBase, shape: torch.Size) -> torch.Tensor:
        ref = self._get(td, "ref_log_prob", "reference log-probs per response (summed, fp32)")
        if ref.shape == shape + (1,):
            ref = ref.squeeze(-1)
        self._check_shape(ref, "ref_log_prob", shape)
        return ref.to(torch.float32)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        self._check_pairs(tensordict)
        logps, counts = self.sequence_log_probs(tensordict)
        ref = self._reference(tensordict, logps.shape)
        if self.length_normalize:
            n = counts.clamp_min(1)
            pol, refn = logps / n, ref / n
        else:
            pol, refn = logps, ref
        per_pair = self.pair_loss(pol[..., 0], pol[..., 1], refn[..., 0], refn[..., 1])
        out = TensorDict({self.loss_name: self._reduce(per_pair)}, batch_size=[])
        self.auxiliary_loss(out, logps, counts)
        delta = pol - refn
        scale = self.reward_scale()
        self._pair_diagnostics(
            out, logps[..., 0], logps[..., 1], scale * delta[..., 0], scale * delta[..., 1],
            delta[..., 0], delta[..., 1],
        )
        return out


class RobustDPOLoss(DPOLoss):
    """Robust DPO: an unbiased DPO loss under label-flip noise of rate ``label_smoothing``.

    Chowdhury et al. 2024, arXiv:2403.00409. Same arguments as :class:`DPOLoss`, with
    ``label_smoothing`` defaulting to ``0.1``.

    Examples:
        >>> import torch
        >>> loss = RobustDPOLoss(beta=0.1, label_smoothing=0.0)
        >>> round(loss.pair_loss(torch.tensor(-1.), torch.tensor(-2.), torch.tensor(0.), torch.tensor(0.)).item(), 3)
        0.644
    """

    loss_name = "loss_dpo"

    def __init__(self, actor_network=None, *, beta: float = 0.1, label_smoothing: float = 0.1, reduction: str = "mean"):
        super().__init__(actor_network, beta=beta, label_smoothing=label_smoothing, reduction=reduction)

    def pair_loss(self, chosen, rejected, ref_chosen, ref_rejected):
        return F.robust_dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, label_smoothing=self.label_smoothing
        )


class RPOLoss(DPOLoss):
    """RPO: DPO plus a length-normalised NLL term on the chosen response.

    Pang et al. 2024, arXiv:2404.19733 (iterative reasoning preference optimisation);
    the NLL term counters the likelihood collapse of example 5.6.1. Adds
    ``loss_nll = alpha * mean(-log pi(y_w|x) / |y_w|)``.

    Keyword Args:
        alpha (float): weight of the NLL term. Defaults to ``1.0``.
        beta, label_smoothing, reduction: as :class:`DPOLoss`.
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_dpo", "loss_nll")

    def __init__(self, actor_network=None, *, alpha: float = 1.0, beta: float = 0.1, label_smoothing: float = 0.0,
                 reduction: str = "mean"):
        super().__init__(actor_network, beta=beta, label_smoothing=label_smoothing, reduction=reduction)
        self.register_buffer("alpha", torch.tensor(float(alpha)))

    def auxiliary_loss(self, td_out, logps, counts):
        nll = -logps[..., 0] / counts[..., 0].clamp_min(1)
        td_out.set("loss_nll", self.alpha * self._reduce(nll))


class IPOLoss(DPOLoss):
    """Identity Preference Optimisation: a squared loss with a bounded target margin.

    Azar et al. 2023, arXiv:2310.12036: ``(Delta_w - Delta_l - 1 / (2 tau))**2``. The
    log-probs are averaged over response tokens by default (as the IPO authors'
    follow-up and TRL do), so ``tau`` does not depend on response length;
    ``length_normalize=False`` uses sums.

    Keyword Args:
        tau (float): regularisation; the target log-ratio gap is ``1 / (2 tau)``. Defaults to ``0.1``.
        length_normalize (bool): average log-probs over response tokens. Defaults to ``True``.
        reduction (str): as :class:`DPOLoss`.

    Examples:
        >>> import torch
        >>> round(IPOLoss(tau=0.5).pair_loss(torch.tensor(2.), torch.tensor(0.), torch.tensor(0.), torch.tensor(0.)).item(), 3)
        1.0
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_ipo",)

    loss_name = "loss_ipo"

    def __init__(self, actor_network=None, *, tau: float = 0.1, length_normalize: bool = True, reduction: str = "mean"):
        super().__init__(actor_network, beta=tau, reduction=reduction)
        self.register_buffer("tau", torch.tensor(float(tau)))
        self.length_normalize = bool(length_normalize)

    def pair_loss(self, chosen, rejected, ref_chosen, ref_rejected):
        return F.ipo_loss(chosen, rejected, ref_chosen, ref_rejected, tau=self.tau)

    def reward_scale(self):
        return self.tau


class _ReferenceFreeLoss(DPOLoss):
    """Shared by ORPO and SimPO: length-averaged log-probs, no reference model.

    Reference log-probs are optional; when the batch carries them the
    ``likelihood_collapse`` diagnostic is reported too.
    """

    uses_reference = False

    def _optional_deltas(self, td: TensorDictBase, logps: torch.Tensor):
        ref = td.get(self.tensor_keys.ref_log_prob, None)
        if ref is None:
            return None, None
        ref = ref.squeeze(-1) if ref.shape == logps.shape + (1,) else ref
        self._check_shape(ref, "ref_log_prob", logps.shape)
        delta = logps.detach() - ref
        return delta[..., 0], delta[..., 1]


class ORPOLoss(_ReferenceFreeLoss):
    """Odds Ratio Preference Optimisation: SFT and preference in one loss, no reference model.

    Hong et al. 2024, arXiv:2403.07691: ``loss_nll = -mean log pi(y_w|x)`` (per token) and
    ``loss_odds_ratio = -lam * log sigmoid(log odds(y_w) - log odds(y_l))`` over
    length-averaged log-probs, with ``log odds = logp - log(1 - exp(logp))`` by a stable
    ``log1mexp``. Their sum is :func:`~offline_plugins.objectives.llm.functional.orpo_loss`.

    Keyword Args:
        lam (float): weight of the odds-ratio term. Defaults to ``0.1``.
        reduction (str): as :class:`DPOLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"log_probs": {"full": -torch.rand(2, 2, 4)},
        ...                     "masks": {"all_assistant_mask": torch.ones(2, 2, 4, dtype=torch.bool)}}, [2, 2])
        >>> sorted(k for k in ORPOLoss(lam=0.1)(batch).keys() if k.startswith("loss_"))
        ['loss_nll', 'loss_odds_ratio']
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_nll", "loss_odds_ratio")

    loss_name = "loss_odds_ratio"

    def __init__(self, actor_network=None, *, lam: float = 0.1, reduction: str = "mean"):
        super().__init__(actor_network, reduction=reduction)
        self.register_buffer("lam", torch.tensor(float(lam)))

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        self._check_pairs(tensordict)
        logps, counts = self.sequence_log_probs(tensordict)
        mean = logps / counts.clamp_min(1)
        chosen_nll = -mean[..., 0]
        odds = F.orpo_loss(mean[..., 0], mean[..., 1], torch.zeros_like(chosen_nll), lam=self.lam)
        out = TensorDict({"loss_nll": self._reduce(chosen_nll), "loss_odds_ratio": self._reduce(odds)}, batch_size=[])
        with torch.no_grad():
            out.set("log_odds_ratio", F.orpo_log_odds_ratio(mean[..., 0], mean[..., 1]).mean())
        dc, dr = self._optional_deltas(tensordict, logps)
        self._pair_diagnostics(out, logps[..., 0], logps[..., 1], self.lam * mean[..., 0], self.lam * mean[..., 1], dc, dr)
        return out


class SimPOLoss(_ReferenceFreeLoss):
    """Simple Preference Optimisation: length-averaged log-probs and a target margin, no reference.

    Meng et al. 2024, arXiv:2405.14734:
    ``-log sigmoid(beta * (mean logp_w - mean logp_l) - gamma)``.

    Keyword Args:
        beta (float): reward scale. Defaults to ``2.0``.
        gamma (float): absolute target reward margin. Defaults to ``1.0``.
        reduction (str): as :class:`DPOLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"log_probs": {"full": torch.tensor([[[-1., -1.], [-2., -2.]]])},
        ...                     "masks": {"all_assistant_mask": torch.ones(1, 2, 2, dtype=torch.bool)}}, [1, 2])
        >>> round(SimPOLoss(beta=2.0, gamma=1.0)(batch)["loss_simpo"].item(), 4)
        0.3133
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_simpo",)

    loss_name = "loss_simpo"

    def __init__(self, actor_network=None, *, beta: float = 2.0, gamma: float = 1.0, reduction: str = "mean"):
        super().__init__(actor_network, beta=beta, reduction=reduction)
        self.register_buffer("gamma", torch.tensor(float(gamma)))

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        self._check_pairs(tensordict)
        logps, counts = self.sequence_log_probs(tensordict)
        mean = logps / counts.clamp_min(1)
        per_pair = F.simpo_loss(mean[..., 0], mean[..., 1], beta=self.beta, gamma=self.gamma)
        out = TensorDict({self.loss_name: self._reduce(per_pair)}, batch_size=[])
        dc, dr = self._optional_deltas(tensordict, logps)
        self._pair_diagnostics(out, logps[..., 0], logps[..., 1], self.beta * mean[..., 0], self.beta * mean[..., 1], dc, dr)
        return out


class KTOLoss(PreferenceLossBase):
    """Kahneman-Tversky Optimisation: unpaired desirable / undesirable feedback.

    Ethayarajh et al. 2024, arXiv:2402.01306. Batch ``[B]`` with a boolean ``label``.
    The reference point ``z_ref`` is the KL estimate ``mean(log pi(y'|x) - log pi_ref(y'|x))``
    over mismatched pairs (prompt ``x_i`` with another row's response ``y'``, stored
    under ``"kl"`` by :func:`offline_plugins.text.data.preference.tokenize_unpaired`),
    detached and clamped at 0. The mismatched rows run in the same forward as the
    batch (``2B`` rows).

    Keyword Args:
        beta (float): implicit-reward scale. Defaults to ``0.1``.
        desirable_weight (float): weight of desirable examples. Defaults to ``1.0``.
        undesirable_weight (float): weight of undesirable examples. Defaults to ``1.0``.
        reduction (str): as :class:`DPOLoss`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> mask = torch.ones(2, 3, dtype=torch.bool)
        >>> batch = TensorDict({"log_probs": {"full": torch.zeros(2, 3)}, "masks": {"all_assistant_mask": mask},
        ...     "ref_log_probs": {"response": torch.zeros(2)}, "label": torch.tensor([True, False]),
        ...     "kl": {"log_probs": {"full": torch.zeros(2, 3)}, "masks": {"all_assistant_mask": mask},
        ...            "ref_log_probs": {"response": torch.zeros(2)}}}, [2])
        >>> KTOLoss()(batch)["loss_kto"]
        tensor(0.5000)
    """

    #: the ``loss_*`` terms a trainer minimises (their sum)
    optimised_terms: tuple[str, ...] = ("loss_kto",)

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename with ``set_keys``.

        Attributes:
            tokens: ``[B, T]`` prompt + response ids. Defaults to ``("tokens", "full")``.
            attention_mask: Defaults to ``("masks", "all_attention_mask")``.
            response_mask: Defaults to ``("masks", "all_assistant_mask")``.
            log_probs: per-token policy log-probs. Defaults to ``("log_probs", "full")``.
            ref_log_prob: summed reference log-prob ``[B]``. Defaults to ``("ref_log_probs", "response")``.
            label: ``True`` for desirable. Defaults to ``"label"``.
            kl: sub-TensorDict of mismatched rows with the same keys. Defaults to ``"kl"``.
        """

        tokens: NestedKey = ("tokens", "full")
        attention_mask: NestedKey = ("masks", "all_attention_mask")
        response_mask: NestedKey = ("masks", "all_assistant_mask")
        log_probs: NestedKey = ("log_probs", "full")
        ref_log_prob: NestedKey = ("ref_log_probs", "response")
        label: NestedKey = "label"
        kl: NestedKey = "kl"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network: Optional[torch.nn.Module] = None,
        *,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        reduction: str = "mean",
    ) -> None:
        super().__init__(actor_network, reduction=reduction)
        self.register_buffer("beta", torch.tensor(float(beta)))
        self.register_buffer("desirable_weight", torch.tensor(float(desirable_weight)))
        self.register_buffer("undesirable_weight", torch.tensor(float(undesirable_weight)))

    def kl_reference_point(self, kl_logps: torch.Tensor, kl_ref: torch.Tensor) -> torch.Tensor:
        """``max(0, mean(logp - ref_logp))`` over the mismatched rows, detached (KTO eq. 8)."""
        return (kl_logps - kl_ref).detach().mean().clamp_min(0)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        if tensordict.batch_dims != 1:
            raise PreferenceInputError(
                f"KTOLoss expects unpaired rows of batch shape [B] with a boolean 'label', got "
                f"{tuple(tensordict.batch_size)}; build it with offline_plugins.text.data.preference.tokenize_unpaired"
            )
        keys = self.tensor_keys
        kl_td = self._get(tensordict, "kl", "mismatched (prompt, other response) rows for the KL reference point")
        label = self._get(tensordict, "label", "a boolean desirable/undesirable label").bool()
        batch = tensordict.batch_size[0]
        # one forward over the rows and their mismatched partners (2B rows)
        both = _stack_rows(tensordict, kl_td, [keys.tokens, keys.attention_mask, keys.response_mask, keys.log_probs])
        logps, counts = self.sequence_log_probs(both)
        logps, kl_logps = logps[:batch], logps[batch:]
        ref = self._get(tensordict, "ref_log_prob", "reference log-probs per response (summed, fp32)").float()
        kl_ref = _kl_reference_log_probs(self, kl_td)
        self._check_shape(ref, "ref_log_prob", logps.shape)
        self._check_shape(kl_ref, "ref_log_prob", kl_logps.shape)
        z_ref = self.kl_reference_point(kl_logps, kl_ref)
        per_row = F.kto_loss(
            logps, ref, label, z_ref, beta=self.beta,
            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
        )
        out = TensorDict({"loss_kto": self._reduce(per_row)}, batch_size=[])
        out.set("kl_reference_point", z_ref)
        delta = (logps - ref).detach()
        reward = self.beta * delta
        lab = label.to(reward.dtype)
        n_pos, n_neg = lab.sum().clamp_min(1), (1 - lab).sum().clamp_min(1)
        r_pos = (reward * lab).sum() / n_pos
        r_neg = (reward * (1 - lab)).sum() / n_neg
        out.set("preference_accuracy", ((reward - self.beta * z_ref > 0) == label).float().mean())
        out.set("reward_margin", r_pos - r_neg)
        out.set("reward_chosen", r_pos)
        out.set("reward_rejected", r_neg)
        out.set("log_prob_chosen", (logps.detach() * lab).sum() / n_pos)
        out.set("log_prob_rejected", (logps.detach() * (1 - lab)).sum() / n_neg)
        d_pos = (delta * lab).sum() / n_pos
        d_neg = (delta * (1 - lab)).sum() / n_neg
        out.set("likelihood_collapse", ((d_pos < 0) & (d_neg < 0)).float())
        return out


def _kl_reference_log_probs(loss: KTOLoss, kl_td: TensorDictBase) -> torch.Tensor:
    ref = kl_td.get(loss.tensor_keys.ref_log_prob, None)
    if ref is None:
        raise PreferenceInputError(
            f"KTOLoss needs reference log-probs of the mismatched rows at "
            f"{(loss.tensor_keys.kl,) + tuple(_as_tuple(loss.tensor_keys.ref_log_prob))!r}; compute them with "
            f"offline_plugins.text.data.preference.add_reference_log_probs"
        )
    return ref.float()


def _as_tuple(key: NestedKey) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _stack_rows(a: TensorDictBase, b: TensorDictBase, keys: list) -> TensorDict:
    """Rows of ``a`` then of ``b`` for ``keys`` present in both, right-padded to one length."""
    out = TensorDict(batch_size=[a.batch_size[0] + b.batch_size[0]], device=a.device)
    for key in keys:
        x, y = a.get(key, None), b.get(key, None)
        if x is None or y is None:
            continue
        t = max(x.shape[-1], y.shape[-1])
        x = torch.nn.functional.pad(x, (0, t - x.shape[-1]))
        y = torch.nn.functional.pad(y, (0, t - y.shape[-1]))
        out.set(key, torch.cat([x, y], 0))
    return out
