"""Train/rollout mismatch correction (issue 25, item 3): when the sampler's log-probs are not the
trainer's, the GRPO family weighs each token by the truncated importance weight
min(pi_trainer / pi_sample, cap) and takes its ratio against the trainer's own log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.objectives.llm.online import DAPOLoss, TextGRPOLoss


class _Fixed(torch.nn.Module):
    """An actor whose per-token log-prob is ``w * table[token]``: hand-computable, with a gradient."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.w = torch.nn.Parameter(torch.ones(()))

    def log_probs(self, tokens, attention_mask):
        return self.w * self.table[tokens]


def _rows(sample_shift: torch.Tensor) -> TensorDict:
    """Two groups of two responses; the response is the last two tokens of each row. The sampler's
    log-probs are the trainer's plus ``sample_shift`` (a different engine)."""
    tokens = torch.tensor([[0, 1, 2, 3], [0, 1, 3, 2], [0, 2, 1, 1], [0, 2, 3, 3]])
    table = torch.tensor([-0.1, -0.5, -1.0, -2.0])
    resp = torch.zeros(4, 4, dtype=torch.bool)
    resp[:, 2:] = True
    td = TensorDict({
        "tokens": {"full": tokens},
        "masks": {"all_attention_mask": torch.ones(4, 4, dtype=torch.bool), "all_assistant_mask": resp},
        "log_probs": {"full": table[tokens] + sample_shift},
        "next": {"reward": torch.tensor([[1.0], [0.0], [1.0], [0.0]])},
        "group": torch.tensor([0, 0, 1, 1]),
    }, [4])
    return td, table


def test_with_the_trainers_own_log_probs_the_correction_changes_nothing():
    td, table = _rows(torch.zeros(4, 4))
    plain = TextGRPOLoss(_Fixed(table), beta=0.0)
    corrected = TextGRPOLoss(_Fixed(table), beta=0.0, rollout_correction=2.0)
    a = plain(plain.process_rollouts(td.clone()))
    rows = corrected.process_rollouts(td.clone())
    b = corrected(rows)
    assert torch.equal(rows["rollout_weight"], rows["masks", "all_assistant_mask"].float())
    assert torch.allclose(a["loss_objective"], b["loss_objective"])
    assert b["rollout_ess"].item() == pytest.approx(1.0) and b["rollout_mismatch_kl"].item() == pytest.approx(0.0)
    assert "rollout_weight" in corrected.in_keys and "rollout_weight" not in plain.in_keys


def test_a_sampler_that_differs_is_weighted_by_the_truncated_ratio_by_hand():
    # the sampler put 0.3 less log-prob than the trainer on row 0's tokens (weight e^0.3 = 1.35) and
    # 1.5 less on row 2's (e^1.5 = 4.48, capped at 2); rows 1 and 3 agree with the trainer
    shift = torch.zeros(4, 4)
    shift[0] = -0.3
    shift[2] = -1.5
    td, table = _rows(shift)
    loss = TextGRPOLoss(_Fixed(table), beta=0.0, rollout_correction=2.0)
    rows = loss.process_rollouts(td)
    w = rows["rollout_weight"][:, 2:]
    assert torch.allclose(w, torch.tensor([[math.exp(0.3)] * 2, [1.0] * 2, [2.0] * 2, [1.0] * 2]))
    assert torch.equal(rows["log_probs", "trainer"], table[rows["tokens", "full"]].detach())
    out = loss(rows)
    # on-policy for the trainer: every ratio is 1, so the surrogate is the advantage times the weight;
    # GRPO's advantages here are +1, -1 in each group (population std), on both response tokens
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    per_row = (w.mean(-1) * adv)
    assert out["loss_objective"].item() == pytest.approx(-per_row.mean().item(), abs=1e-6)
    assert out["ratio_mean"].item() == pytest.approx(1.0)
    flat = w.flatten()
    assert out["rollout_ess"].item() == pytest.approx((flat.sum() ** 2 / (flat.numel() * (flat ** 2).sum())).item())
    # k1 estimate of KL(sampler || trainer) over the response tokens: mean of (sample - trainer)
    assert out["rollout_mismatch_kl"].item() == pytest.approx((-0.3 * 2 - 1.5 * 2) / 8)
    # the weight is a constant: the gradient flows through the ratio only
    out["loss_objective"].backward()
    assert loss.actor_network.w.grad is not None and torch.isfinite(loss.actor_network.w.grad)


def test_the_grpo_family_and_its_config_take_the_cap_and_refuse_a_bad_one():
    from offline_plugins.algorithms.online import DAPOConfig, ExpertIterationConfig, GRPOConfig

    assert DAPOLoss(_Fixed(torch.zeros(4)), rollout_correction=3).rollout_correction == 3.0
    assert GRPOConfig().rollout_correction is None and DAPOConfig(rollout_correction=2.0).rollout_correction == 2.0
    assert not hasattr(ExpertIterationConfig(), "rollout_correction")  # it has no importance ratio
    for bad in (0.5, True, "2"):
        with pytest.raises(ValueError, match=r"rollout_correction is the importance weight's cap, a number >= 1"):
            TextGRPOLoss(_Fixed(torch.zeros(4)), rollout_correction=bad)


def test_a_grpo_run_with_the_correction_trains_and_logs_the_weights(tmp_path):
    import json
    import random
    import warnings

    import lightning

    import offline_plugins.lightning as opl

    rng = random.Random(2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"}) + "\n"
                               for _ in range(60)))
    config = {"group_size": 4, "prompts_per_round": 4, "batch_size": 8, "max_new_tokens": 3, "eval_prompts": 4,
              "rollout_correction": 2.0}
    parts = opl.build("grpo", str(prompts), config=config, reward="_text_rewards:digit_share")
    assert parts.module.parts.loss.rollout_correction == 2.0
    seen = []

    class Outputs(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(pl_module.last_logged.get("train/rollout_ess", float("nan"))))

    trainer = lightning.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=1,
                                callbacks=[*parts.callbacks, Outputs()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(parts.module, datamodule=parts.datamodule)
    # the collector's log-probs are the trainer's up to float rounding: weights of 1, an ESS of 1
    assert trainer.global_step == 2 and seen and all(abs(x - 1.0) < 1e-3 for x in seen)
