"""Preference losses: the seeds' worked examples, gradients, diagnostics and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.objectives.llm import (
    BradleyTerryLoss,
    DPOLoss,
    IPOLoss,
    KTOLoss,
    ORPOLoss,
    PreferenceInputError,
    RobustDPOLoss,
    RPOLoss,
    SimPOLoss,
)
from offline_plugins.objectives.llm import functional as F

torch.set_num_threads(1)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- seeds, example 5.6.1: DPO by hand -------------------------------------------------


def test_dpo_worked_example_loss_and_gradients():
    delta_w = torch.tensor(-1.0, requires_grad=True)
    delta_l = torch.tensor(-2.0, requires_grad=True)
    zero = torch.tensor(0.0)
    loss = F.dpo_loss(delta_w, delta_l, zero, zero, beta=0.1)
    assert round(loss.item(), 3) == 0.644
    assert loss.item() == pytest.approx(-math.log(0.52498), abs=1e-5)
    loss.backward()
    # dL/dz = -(1 - sigma(0.1)) = -0.475; times beta
    assert round(delta_w.grad.item(), 4) == -0.0475
    assert round(delta_l.grad.item(), 4) == 0.0475
    z = torch.tensor(0.1, requires_grad=True)
    (-torch.nn.functional.logsigmoid(z)).backward()
    assert round(z.grad.item(), 3) == -0.475


def test_dpo_worked_example_both_fall_has_smaller_loss():
    zero = torch.tensor(0.0)
    both_fall = F.dpo_loss(torch.tensor(-4.0), torch.tensor(-6.0), zero, zero, beta=0.1)
    assert round(both_fall.item(), 3) == 0.598
    assert both_fall < F.dpo_loss(torch.tensor(-1.0), torch.tensor(-2.0), zero, zero, beta=0.1)


def test_dpo_loss_module_flags_likelihood_collapse_in_worked_example():
    # policy log-probs -4 / -6 against a reference at 0: both fell, loss 0.598
    batch = _pair_batch_from_logps(torch.tensor([[-4.0, -6.0]]), ref=torch.zeros(1, 2))
    out = DPOLoss(beta=0.1)(batch)
    assert round(out["loss_dpo"].item(), 3) == 0.598
    assert out["likelihood_collapse"].item() == 1.0
    assert out["preference_accuracy"].item() == 1.0
    assert out["reward_margin"].item() == pytest.approx(0.2)
    assert out["reward_chosen"].item() == pytest.approx(-0.4)
    assert out["reward_rejected"].item() == pytest.approx(-0.6)
    ok = DPOLoss(beta=0.1)(_pair_batch_from_logps(torch.tensor([[1.0, -6.0]]), ref=torch.zeros(1, 2)))
    assert ok["likelihood_collapse"].item() == 0.0


# ---- seeds, example 5.6.2(b): Bradley-Terry by hand -------------------------------------


def test_bradley_terry_worked_example():
    r_w = torch.tensor(1.0, requires_grad=True)
    r_l = torch.tensor(0.0, requires_grad=True)
    loss = F.bradley_terry_loss(r_w, r_l)
    assert round(loss.item(), 4) == 0.3133
    loss.backward()
    assert round(r_w.grad.item(), 4) == -0.2689
    assert round(r_l.grad.item(), 4) == 0.2689
    # swapped labels reverse the gradient (the seeds' warning)
    r_w.grad = None
    F.bradley_terry_loss(r_l, r_w).backward()
    assert round(r_w.grad.item(), 4) == round(_sig(1.0), 4)  # now pushed down


def test_bradley_terry_module_margin_and_centering():
    reward = torch.tensor([[1.0, 0.0], [0.5, 1.5]], requires_grad=True)
    batch = TensorDict({"reward": reward}, [2, 2])
    out = BradleyTerryLoss(margin=0.5, center_coeff=0.01)(batch)
    expected = (-torch.nn.functional.logsigmoid(torch.tensor([0.5, -1.5]))).mean()
    assert out["loss_reward"].item() == pytest.approx(expected.item())
    assert out["loss_center"].item() == pytest.approx(0.01 * (1.0 + 4.0) / 2)
    assert out["preference_accuracy"].item() == 0.5
    assert not any(out[k].requires_grad for k in out.keys() if not k.startswith("loss_"))


# ---- gradients against autograd of the formulas ----------------------------------------


@pytest.mark.parametrize(
    "fn,kwargs,n",
    [
        (F.bradley_terry_loss, {"margin": 0.3}, 2),
        (F.dpo_loss, {"beta": 0.1, "label_smoothing": 0.1}, 4),
        (F.robust_dpo_loss, {"beta": 0.5, "label_smoothing": 0.2}, 4),
        (F.ipo_loss, {"tau": 0.1}, 4),
        (F.simpo_loss, {"beta": 2.0, "gamma": 1.0}, 2),
    ],
)
def test_functional_gradcheck(fn, kwargs, n):
    torch.manual_seed(0)
    args = [(-torch.rand(5, dtype=torch.float64) * 3).requires_grad_() for _ in range(n)]
    assert torch.autograd.gradcheck(lambda *a: fn(*a, **kwargs), args)


def test_closed_form_gradients_match_autograd():
    torch.manual_seed(0)
    pw, pl, rw, rl = (-torch.rand(6) * 5 for _ in range(4))
    pw.requires_grad_()
    pl.requires_grad_()
    beta, eps = 0.3, 0.1
    F.dpo_loss(pw, pl, rw, rl, beta=beta, label_smoothing=eps).sum().backward()
    z = beta * ((pw - rw) - (pl - rl)).detach()
    # d/dz [-(1-eps) log s(z) - eps log s(-z)] = -(1-eps) s(-z) + eps s(z)
    dz = -(1 - eps) * torch.sigmoid(-z) + eps * torch.sigmoid(z)
    torch.testing.assert_close(pw.grad, beta * dz)
    torch.testing.assert_close(pl.grad, -beta * dz)

    h = torch.tensor([0.5, 7.0], requires_grad=True)
    F.ipo_loss(h, torch.zeros(2), torch.zeros(2), torch.zeros(2), tau=0.1).sum().backward()
    torch.testing.assert_close(h.grad, 2 * (h.detach() - 5.0))


def test_orpo_and_kto_gradcheck():
    torch.manual_seed(0)
    cm = (-torch.rand(4, dtype=torch.float64) * 2 - 1e-3).requires_grad_()
    rm = (-torch.rand(4, dtype=torch.float64) * 2 - 1e-3).requires_grad_()
    nll = torch.rand(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: F.orpo_loss(a, b, c, lam=0.5), (cm, rm, nll))
    pol = (-torch.rand(4, dtype=torch.float64) * 3).requires_grad_()
    ref = -torch.rand(4, dtype=torch.float64) * 3
    lab = torch.tensor([True, False, True, False])
    assert torch.autograd.gradcheck(
        lambda p: F.kto_loss(p, ref, lab, torch.tensor(0.2, dtype=torch.float64), beta=0.5, undesirable_weight=1.5),
        (pol,),
    )


# ---- loss modules equal the functional forms, one forward over B*2 rows -------------------


class _CountingLM(torch.nn.Module):
    def __init__(self, vocab: int = 11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 16)
        self.out = torch.nn.Linear(16, vocab)
        self.rows = []

    def forward(self, input_ids):
        self.rows.append(input_ids.shape[0])
        return self.out(torch.tanh(self.emb(input_ids)))


def _token_batch(b=3, t=7, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, 2, t), generator=g)
    lengths = torch.tensor([[7, 5], [6, 7], [4, 6]])[:b]
    attn = torch.arange(t).expand(b, 2, t) < lengths.unsqueeze(-1)
    resp = attn & (torch.arange(t) >= 2)
    return TensorDict(
        {
            "tokens": {"full": tokens},
            "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
            "ref_log_probs": {"response": -torch.rand(b, 2, generator=g) * 10},
        },
        [b, 2],
    )


def _pair_batch_from_logps(logps, ref=None):
    b = logps.shape[0]
    lp = torch.zeros(b, 2, 2)
    lp[..., 1] = logps
    td = TensorDict(
        {"log_probs": {"full": lp}, "masks": {"all_assistant_mask": torch.tensor([False, True]).expand(b, 2, 2)}},
        [b, 2],
    )
    if ref is not None:
        td["ref_log_probs", "response"] = ref
    return td


def _naive_logps(lm, batch):
    tokens, attn = batch["tokens", "full"], batch["masks", "all_attention_mask"]
    resp = batch["masks", "all_assistant_mask"]
    out = torch.zeros(tokens.shape[:2])
    count = torch.zeros(tokens.shape[:2])
    for i in range(tokens.shape[0]):
        for j in range(2):
            n = int(attn[i, j].sum())
            row = tokens[i, j, :n]
            logits = lm(row[None])[0]
            lp = torch.log_softmax(logits, -1)
            for t in range(1, n):
                if resp[i, j, t]:
                    out[i, j] = out[i, j] + lp[t - 1, row[t]]
                    count[i, j] += 1
    return out, count


def test_dpo_module_matches_functional_and_runs_one_forward():
    torch.manual_seed(0)
    lm = _CountingLM()
    batch = _token_batch()
    loss = DPOLoss(CausalLMLogProbs(lm), beta=0.1)
    out = loss(batch)
    assert lm.rows == [6]  # B*2 rows in one call
    logps, _ = _naive_logps(lm, batch)
    ref = batch["ref_log_probs", "response"]
    expected = F.dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.1).mean()
    torch.testing.assert_close(out["loss_dpo"], expected)
    # gradients of the module equal autograd through the naive formula
    g_mod = torch.autograd.grad(out["loss_dpo"], lm.out.weight)[0]
    g_ref = torch.autograd.grad(expected, lm.out.weight)[0]
    torch.testing.assert_close(g_mod, g_ref)
    assert all(not out[k].requires_grad for k in out.keys() if not k.startswith("loss_"))
    assert not any("loss" in k for k in out.keys() if not k.startswith("loss_"))


def test_variants_match_functional():
    torch.manual_seed(0)
    lm = _CountingLM()
    batch = _token_batch()
    actor = CausalLMLogProbs(lm)
    with torch.no_grad():
        logps, count = _naive_logps(lm, batch)
        ref = batch["ref_log_probs", "response"]
        mean, ref_mean = logps / count, ref / count
        cases = {
            "robust": (RobustDPOLoss(actor, beta=0.2, label_smoothing=0.2), "loss_dpo",
                       F.robust_dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.2, label_smoothing=0.2)),
            "cdpo": (DPOLoss(actor, beta=0.2, label_smoothing=0.2), "loss_dpo",
                     F.dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.2, label_smoothing=0.2)),
            "ipo": (IPOLoss(actor, tau=0.1), "loss_ipo",
                    F.ipo_loss(mean[:, 0], mean[:, 1], ref_mean[:, 0], ref_mean[:, 1], tau=0.1)),
            "ipo_sum": (IPOLoss(actor, tau=0.1, length_normalize=False), "loss_ipo",
                        F.ipo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], tau=0.1)),
            "simpo": (SimPOLoss(actor, beta=2.0, gamma=1.0), "loss_simpo",
                      F.simpo_loss(mean[:, 0], mean[:, 1], beta=2.0, gamma=1.0)),
        }
        for name, (loss, key, expected) in cases.items():
            torch.testing.assert_close(loss(batch)[key], expected.mean(), msg=name)
        rpo = RPOLoss(actor, alpha=0.5, beta=0.1)(batch)
        torch.testing.assert_close(rpo["loss_nll"], 0.5 * (-mean[:, 0]).mean())
        orpo = ORPOLoss(actor, lam=0.1)(batch)
        torch.testing.assert_close(
            orpo["loss_nll"] + orpo["loss_odds_ratio"], F.orpo_loss(mean[:, 0], mean[:, 1], -mean[:, 0], lam=0.1).mean()
        )
        assert "likelihood_collapse" in orpo.keys()  # reference present in the batch


def test_hyperparameters_are_buffers_and_keys_renamable():
    loss = DPOLoss(beta=0.3)
    assert "beta" in dict(loss.named_buffers())
    batch = _pair_batch_from_logps(torch.tensor([[-1.0, -2.0]]))
    batch["ref"] = torch.zeros(1, 2)
    loss = DPOLoss(beta=0.1)
    loss.set_keys(ref_log_prob="ref")
    assert round(loss(batch)["loss_dpo"].item(), 3) == 0.644


# ---- KTO reference point ---------------------------------------------------------------


def _kto_batch(pol, ref, label, kl_pol, kl_ref, requires_grad=False):
    b = len(pol)
    lp = torch.zeros(b, 2)
    lp[:, 1] = torch.tensor(pol)
    klp = torch.zeros(b, 2)
    klp[:, 1] = torch.tensor(kl_pol)
    klp.requires_grad_(requires_grad)
    mask = torch.tensor([False, True]).expand(b, 2)
    return TensorDict(
        {
            "log_probs": {"full": lp},
            "masks": {"all_assistant_mask": mask},
            "ref_log_probs": {"response": torch.tensor(ref)},
            "label": torch.tensor(label),
            "kl": {"log_probs": {"full": klp}, "masks": {"all_assistant_mask": mask},
                   "ref_log_probs": {"response": torch.tensor(kl_ref)}},
        },
        [b],
    ), klp


def test_kto_reference_point_from_mismatched_pairs_detached_and_clamped():
    loss = KTOLoss(beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    batch, klp = _kto_batch([-1.0, -3.0], [-2.0, -2.0], [True, False], [-1.0, -2.0], [-2.0, -2.5], True)
    out = loss(batch)
    z = ((1.0 + 0.5) / 2)  # mean over mismatched rows of policy - ref
    assert out["kl_reference_point"].item() == pytest.approx(z)
    expected = torch.tensor([1 - _sig(1.0 - z), 2 * (1 - _sig(z - (-1.0)))]).mean()
    assert out["loss_kto"].item() == pytest.approx(expected.item(), abs=1e-6)
    out["loss_kto"].backward()
    assert klp.grad is None or torch.all(klp.grad == 0)  # reference point is detached
    # a negative KL estimate is clamped at 0
    batch, _ = _kto_batch([-1.0, -3.0], [-2.0, -2.0], [True, False], [-5.0, -5.0], [-2.0, -2.5])
    assert KTOLoss()(batch)["kl_reference_point"].item() == 0.0


def test_kto_runs_rows_and_mismatched_rows_in_one_forward():
    lm = _CountingLM()
    pairs = _token_batch(b=3)
    rows = pairs[:, 0]
    kl_rows = pairs[:, 1]
    batch = rows.clone()
    batch["label"] = torch.tensor([True, False, True])
    batch["ref_log_probs", "response"] = rows["ref_log_probs", "response"]
    batch["kl"] = kl_rows.select("tokens", "masks", "ref_log_probs")
    out = KTOLoss(CausalLMLogProbs(lm))(batch)
    assert lm.rows == [6]
    assert torch.isfinite(out["loss_kto"])


# ---- ORPO's log odds stay finite near log-prob 0 ------------------------------------------


def test_log1mexp_is_stable_near_zero_and_far():
    x = torch.tensor([-1e-12, -1e-6, -0.1, -0.7, -5.0, -100.0], dtype=torch.float64)
    torch.testing.assert_close(F.log1mexp(x), torch.log(-torch.expm1(x)))
    x32 = torch.tensor([-1e-7, -1e-4], requires_grad=True)
    y = F.log1mexp(x32)
    assert torch.isfinite(y).all()
    assert y[0].item() == pytest.approx(math.log(1e-7), rel=1e-3)
    y.sum().backward()
    assert torch.isfinite(x32.grad).all()
    naive = torch.log(1 - torch.exp(torch.tensor(-1e-9)))
    assert not torch.isfinite(naive)  # what the stable form avoids
    assert torch.isfinite(F.orpo_log_odds_ratio(torch.tensor(-1e-9), torch.tensor(-2.0)))


# ---- bad inputs ---------------------------------------------------------------------------


def test_missing_key_names_key_and_fix():
    batch = _pair_batch_from_logps(torch.tensor([[-1.0, -2.0]]))
    with pytest.raises(PreferenceInputError, match=r"ref_log_probs.*set_keys\(ref_log_prob="):
        DPOLoss()(batch)
    assert issubclass(PreferenceInputError, UserError)
    with pytest.raises(UserError, match="label"):
        batch, _ = _kto_batch([-1.0], [-1.0], [True], [-1.0], [-1.0])
        del batch["label"]
        KTOLoss()(batch)
    with pytest.raises(UserError, match=r"actor reads"):
        DPOLoss(CausalLMLogProbs(_CountingLM()))(_pair_batch_from_logps(torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2)))


def test_shape_mismatch_names_input():
    batch = _pair_batch_from_logps(torch.tensor([[-1.0, -2.0]]), ref=torch.zeros(1, 2))
    with pytest.raises(PreferenceInputError, match=r"\[B, 2\]"):
        DPOLoss()(batch.reshape(2, 1))
    bad = _pair_batch_from_logps(torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]), ref=torch.zeros(2, 2))
    bad = bad.exclude(("ref_log_probs", "response"))
    bad.set_non_tensor("x", 0)
    bad["ref_log_probs"] = TensorDict({"response": torch.zeros(2, 2, 3)}, [2, 2])
    with pytest.raises(PreferenceInputError, match=r"ref_log_prob.*shape \(2, 2, 3\)"):
        DPOLoss()(bad)
    with pytest.raises(PreferenceInputError, match="reward"):
        BradleyTerryLoss()(TensorDict({"reward": torch.zeros(3, 2, 4)}, [3, 2]))
