"""On-policy distillation (opd, gkd): the reverse KL and the generalised JSD against hand computations,
their limits, the response mask, the teacher-tokenizer refusal, and a short run whose reverse KL falls."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch
from tensordict import TensorDict

from _cli_checks import fails_cleanly
from offline_plugins.objectives.llm.distill import GKDLoss, OnPolicyDistillationLoss, generalized_jsd

torch.set_num_threads(1)


class _Logits(torch.nn.Module):
    """A model whose logits are given (a parameter, so the student's gradients can be read), whatever the ids."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids):
        return self.value


def _rows(response: list[list[int]], attention: list[list[int]]) -> TensorDict:
    mask = torch.tensor(response, dtype=torch.bool)
    return TensorDict({"tokens": {"full": torch.zeros(mask.shape, dtype=torch.long)},
                       "masks": {"all_attention_mask": torch.tensor(attention, dtype=torch.bool),
                                 "all_assistant_mask": mask}}, list(mask.shape[:1]))


def _loss(cls, student, teacher, **kwargs):
    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    return cls(CausalLMLogProbs(_Logits(student.log())), _Logits(teacher.log()), **kwargs)


# one row of 3 tokens: a prompt token, then two response tokens; the distributions at positions 0 and 1
# predict tokens 1 and 2, the one at position 2 predicts nothing (set absurd: it must not count)
STUDENT = torch.tensor([[[0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [0.98, 0.01, 0.01]]])
TEACHER = torch.tensor([[[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.01, 0.01, 0.98]]])


def test_reverse_kl_is_the_hand_computed_mean_over_response_tokens():
    out = _loss(OnPolicyDistillationLoss, STUDENT, TEACHER)(_rows([[0, 1, 1]], [[1, 1, 1]]))
    # position 0: 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln(1) = 0.25 ln 2 = 0.1732868
    # position 1: 0.8 ln(0.8/0.5) + 2 * 0.1 ln(0.1/0.25) = 0.3760029 - 0.1832581 = 0.1927448
    first = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    second = 0.8 * math.log(1.6) + 0.2 * math.log(0.4)
    assert first == pytest.approx(0.1732868, abs=1e-6) and second == pytest.approx(0.1927448, abs=1e-6)
    assert out["loss_distill"].item() == pytest.approx((first + second) / 2, abs=1e-6)  # 0.1830158
    assert out["kl_to_teacher"].item() == pytest.approx((first + second) / 2, abs=1e-6)
    assert not out["kl_to_teacher"].requires_grad and out["loss_distill"].requires_grad


def test_the_mask_excludes_prompt_and_padding_tokens():
    # 4 tokens a row. Row 0: a prompt of two tokens, two response tokens. Row 1: one prompt token, two
    # response tokens, then padding that a careless writer also marked as response (the attention mask
    # drops it). Pair A = (STUDENT, TEACHER) at position 0, B at position 1; X an absurd pair wherever a
    # prompt or padding token (or nothing) is predicted
    a_s, a_t, b_s, b_t = STUDENT[0, 0], TEACHER[0, 0], STUDENT[0, 1], TEACHER[0, 1]
    x_s, x_t = torch.tensor([0.98, 0.01, 0.01]), torch.tensor([0.01, 0.01, 0.98])
    student = torch.stack([torch.stack([x_s, a_s, b_s, x_s]), torch.stack([a_s, a_s, x_s, x_s])])
    teacher = torch.stack([torch.stack([x_t, a_t, b_t, x_t]), torch.stack([a_t, a_t, x_t, x_t])])
    loss = _loss(OnPolicyDistillationLoss, student, teacher)
    out = loss(_rows([[0, 0, 1, 1], [0, 1, 1, 1]], [[1, 1, 1, 1], [1, 1, 1, 0]]))
    first = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    second = 0.8 * math.log(1.6) + 0.2 * math.log(0.4)
    assert out["loss_distill"].item() == pytest.approx((first + second + 2 * first) / 4, abs=1e-6)  # 0.1781513
    out["loss_distill"].backward()
    grad = loss.actor_network.model.value.grad.abs().sum(-1)
    assert grad[0, 0] == 0 and grad[0, 3] == 0 and grad[1, 2] == 0 and grad[1, 3] == 0
    assert bool((grad[0, 1:3] > 0).all() and (grad[1, :2] > 0).all())


def test_gkd_generalised_jsd_by_hand_and_its_limits():
    s, t = STUDENT[0, :2].log(), TEACHER[0, :2].log()
    forward = [0.25 * math.log(0.5) + 0.5 * math.log(2), 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.25 / 0.1)]
    reverse = [0.5 * math.log(2) + 0.25 * math.log(0.5), 0.8 * math.log(1.6) + 0.2 * math.log(0.4)]
    assert generalized_jsd(s, t, 0.0).tolist() == pytest.approx(forward, abs=1e-6)
    assert generalized_jsd(s, t, 1.0).tolist() == pytest.approx(reverse, abs=1e-6)
    # beta = 0.5, position 0: m = (0.375, 0.375, 0.25);
    # KL(t || m) = 0.25 ln(0.25/0.375) + 0.5 ln(0.5/0.375) = -0.1013663 + 0.1438410 = 0.0424747
    # KL(s || m) = 0.5 ln(0.5/0.375) + 0.25 ln(0.25/0.375) = 0.1438410 - 0.1013663 = 0.0424747
    kl_t = 0.25 * math.log(0.25 / 0.375) + 0.5 * math.log(0.5 / 0.375)
    kl_s = 0.5 * math.log(0.5 / 0.375) + 0.25 * math.log(0.25 / 0.375)
    assert generalized_jsd(s, t, 0.5)[0].item() == pytest.approx(0.5 * kl_t + 0.5 * kl_s, abs=1e-6)
    assert 0.5 * kl_t + 0.5 * kl_s == pytest.approx(0.0424747, abs=1e-6)
    # the paper's limits: JSD(beta) / beta -> forward KL, JSD(beta) / (1 - beta) -> reverse KL
    small = 1e-4
    assert (generalized_jsd(s.double(), t.double(), small) / small).tolist() == pytest.approx(forward, rel=1e-3)
    assert (generalized_jsd(s.double(), t.double(), 1 - small) / small).tolist() == pytest.approx(reverse, rel=1e-3)


def test_gkd_loss_is_the_jsd_mean_and_refuses_a_beta_outside_0_1():
    out = _loss(GKDLoss, STUDENT, TEACHER, beta=0.0)(_rows([[0, 1, 1]], [[1, 1, 1]]))
    forward = [0.25 * math.log(0.5) + 0.5 * math.log(2), 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.25 / 0.1)]
    assert out["loss_distill"].item() == pytest.approx(sum(forward) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="beta must be a number in \\[0, 1\\].*got 1.5"):
        _loss(GKDLoss, STUDENT, TEACHER, beta=1.5)


def test_the_teacher_is_frozen_in_eval_mode_and_outside_the_module_tree():
    teacher = torch.nn.Embedding(6, 6)
    loss = OnPolicyDistillationLoss(torch.nn.Module(), teacher)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    loss.train()
    assert not teacher.training
    assert not any(name.startswith("teacher") for name in loss.state_dict())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A prompt/answer file; a teacher of the student's tokenizer (tiny, 64 wide, sharpened logits) and one
    of another tokenizer."""
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    root = tmp_path_factory.mktemp("distill")
    rng = random.Random(0)
    rows = []
    for _ in range(220):
        word = "".join(rng.choice("abc") for _ in range(3))
        rows.append({"prompt": word + "=", "answer": word[::-1]})
    (root / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, tok in (("teacher", char_tokenizer()), ("other", char_tokenizer("0123456789+="))):
        model = tiny_causal_lm(tok, hidden_size=64, num_layers=1, seed=1)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(4.0)  # sharper distributions: a KL far from 0 to reduce
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(folders, capsys, tmp_path):
    other = folders / "other"
    fails_cleanly(capsys, tmp_path, "opd", "--dataset", str(folders / "rl.jsonl"), "--model", "tiny", "--steps", "2",
                  "--set", f"teacher={other}", match=f"the teacher '{other}' has another tokenizer than the student "
                                                      "'tiny' (16 tokens against 99")
    fails_cleanly(capsys, tmp_path, "gkd", "--dataset", str(folders / "rl.jsonl"), "--model", "tiny", "--steps", "2",
                  match="gkd distils a teacher into the student: give one with --set teacher=PATH")


def test_opd_run_lowers_the_students_reverse_kl_to_the_teacher(folders, tmp_path):
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("opd", str(folders / "rl.jsonl"), steps=40, seed=0, out_dir=tmp_path / "run",
                              progress=False, threads=1, eval_every=0, log_every=1,
                              overrides={"teacher": str(folders / "teacher"), "prompts_per_round": 16,
                                         "batch_size": 16, "max_new_tokens": 4, "eval_prompts": 20, "lr": 3e-3})
    assert summary["steps"] == 40 and summary["rounds"] == 40
    with open(tmp_path / "run" / "metrics.csv") as fh:
        kl = [float(r["train/kl_to_teacher"]) for r in csv.DictReader(fh) if r.get("train/kl_to_teacher")]
    assert len(kl) == 40
    # mean of the first 4 steps -> the last 4, seeds 0-2 (opd; gkd alike): 0.70-0.76 -> 0.44-0.51, a fall to
    # 0.58-0.72 of the start; a student that learnt nothing stays at 1.0
    assert sum(kl[-4:]) / 4 < 0.8 * sum(kl[:4]) / 4, kl
    assert (tmp_path / "run" / "model" / "config.json").is_file()
