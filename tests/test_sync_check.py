"""The live sync check (issue 43 item 3): a sampler that holds the trainer's weights passes it, one whose
weight load is skipped makes it warn or stop the run with one line; its figures are logged and it is
on by default with a generator and off without one."""

from __future__ import annotations

import copy

import pytest
import torch

from offline_plugins.text.collectors.sync_check import SyncCheck, SyncCheckError, SyncCheckWarning

torch.set_num_threads(1)


class CopySampler:
    """A generator with :class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`'s contract that
    samples from its own copy of the policy, reloaded before a round once a step passed since the
    last load; the loads at the steps in ``skip`` do not happen, though it records them as done (the
    failure the check is for: an engine that says it synced and serves older weights)."""

    def __init__(self, skip=()) -> None:
        self.copy = None
        self.synced_step = None
        self.skip = set(skip)
        self.loads = 0

    def before_round(self, model, step: int) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(model).eval()
            self.synced_step = int(step)
        elif int(step) - self.synced_step >= 1:
            if int(step) not in self.skip:
                self.copy.load_state_dict(model.state_dict())
                self.loads += 1
            self.synced_step = int(step)

    def generate(self, prompt_ids, *, device=None, **kwargs):
        from offline_plugins.text.backends.generation import generate

        return generate(self.copy, prompt_ids, log_probs=True, **kwargs)

    def close(self) -> None:
        pass


def _train(prompt_file, out, sampler, monkeypatch, steps=6, **overrides):
    import offline_plugins.algorithms.online as online
    from offline_plugins.lightning.run import train_algorithm

    monkeypatch.setattr(online, "rollout_generator", lambda config, data, name: sampler)
    # one update a round (batch = round), so every round starts one step after the last load
    return train_algorithm("grpo", str(prompt_file), steps=steps, seed=0, out_dir=out, progress=False, threads=1,
                           reward="_text_rewards:digit_share", eval_every=0, log_every=1,
                           overrides={"group_size": 4, "prompts_per_round": 4, "batch_size": 16, "max_new_tokens": 4,
                                      "eval_prompts": 8, "lr": 3e-2, "sync_check_every": 1, **overrides})


@pytest.mark.slow
def test_a_sampler_holding_the_trainers_weights_passes_and_its_figures_are_logged(prompt_file, tmp_path,
                                                                                 monkeypatch):
    import csv

    sampler = CopySampler()
    with _no_sync_warnings():
        summary = _train(prompt_file, tmp_path / "run", sampler, monkeypatch)
    assert summary["steps"] == 6 and sampler.loads == 5
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    gaps = [float(r["rollout/sync_logprob_gap"]) for r in rows if r.get("rollout/sync_logprob_gap")]
    ess = [float(r["rollout/sync_ess"]) for r in rows if r.get("rollout/sync_ess")]
    assert len(gaps) == 6 and max(gaps) < 1e-4 and min(ess) > 0.9999  # the same weights: float noise only


@pytest.mark.slow
def test_a_skipped_weight_load_makes_the_check_fire(prompt_file, tmp_path, monkeypatch, capsys):
    # the load before step 3's round is skipped: that round is sampled by step-2 weights while the sampler
    # claims the policy's; at lr 3e-2 one step moves the tiny policy's log-probs past the default stop threshold
    sampler = CopySampler(skip={3})
    with pytest.raises(SyncCheckError, match=r"sync check: .*'s log-probs of its own \d+ sampled tokens differ from "
                                             r"the trainer's by .* at step 3, round 3, .*past the stop threshold 0.5: "
                                             r"the sampler is not holding the trainer's weights \(a weight load that "
                                             r"failed or was skipped"):
        _train(prompt_file, tmp_path / "run", sampler, monkeypatch)
    # with a stop threshold it does not reach, the same skip warns and the run goes on
    sampler = CopySampler(skip={3})
    with pytest.warns(SyncCheckWarning, match="past the warning threshold 0.0001"):
        summary = _train(prompt_file, tmp_path / "run2", sampler, monkeypatch, sync_check_stop=50.0,
                         sync_check_warn=1e-4)
    assert summary["steps"] == 6


def test_the_check_is_due_right_after_a_load_only_and_every_n_rounds():
    check = SyncCheck(every=3)
    assert check.due(0, lag=0) and not check.due(0, lag=2)
    check.last = 0
    assert [check.due(r, lag=0) for r in range(1, 5)] == [False, False, True, True]


def test_the_check_measures_the_gap_and_the_effective_sample_size_by_hand():
    from tensordict import TensorDict

    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    torch.manual_seed(0)
    model = torch.nn.Embedding(5, 5)
    tokens = torch.randint(0, 5, (2, 4))
    attn = torch.ones(2, 4, dtype=torch.bool)
    resp = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]).bool()
    trainer = CausalLMLogProbs(model).log_probs(tokens, attn).detach()
    shift = torch.tensor([[0.0, 0.0, 0.1, -0.3], [0.0, 0.2, 0.0, 0.4]])
    td = TensorDict({"tokens": {"full": tokens}, "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
                     "log_probs": {"full": trainer - shift}}, [2])
    stats = SyncCheck(every=1).measure(model, td)
    d = shift[resp]
    w = d.exp()
    assert stats["sync_logprob_gap"] == pytest.approx(d.abs().mean().item(), rel=1e-5)
    assert stats["sync_max_gap"] == pytest.approx(0.4, rel=1e-5)
    assert stats["sync_ess"] == pytest.approx((w.sum() ** 2 / (5 * (w * w).sum())).item(), rel=1e-5)


def test_it_is_on_by_default_with_a_generator_off_without_and_bad_settings_are_one_line():
    from offline_plugins.algorithms.online import GRPOConfig, sync_check
    from offline_plugins.errors import UserError

    assert sync_check(GRPOConfig(), None, "grpo") is None
    assert sync_check(GRPOConfig(), object(), "grpo").every == 10
    assert sync_check(GRPOConfig(sync_check_every=0), object(), "grpo") is None
    assert sync_check(GRPOConfig(sync_check_every=2), None, "grpo").every == 2
    with pytest.raises(UserError, match="grpo: sync_check_warn .* must be > 0 and below sync_check_stop"):
        sync_check(GRPOConfig(sync_check_every=1, sync_check_warn=1.0, sync_check_stop=0.5), None, "grpo")


class _no_sync_warnings:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", SyncCheckWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

