"""The reward-hacking monitor: gold against proxy along the KL, the best-gold checkpoint, Gao et al.'s fit."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _lightning_fixtures import TINY_SPEC, FakeOfflineData  # noqa: E402

from offline_plugins.eval.overoptimization import fit_gao  # noqa: E402
from offline_plugins.lightning.callbacks import ScheduledEvaluation  # noqa: E402
from offline_plugins.kinds.rollouts.monitor import RewardHackingMonitor, RewardHackingWarning  # noqa: E402
from offline_plugins.lightning.run import load_checkpoint, train_algorithm  # noqa: E402

torch.set_num_threads(1)


class Overoptimised(ScheduledEvaluation):
    """An online run's evaluations, made up: the proxy rises with the step; the gold score follows
    best-of-n's d (alpha - beta d) with alpha 0.1, beta 0.05 (peak at d = 1), d = sqrt(KL) = step / 20."""

    def __init__(self) -> None:
        self.every, self.history, self.before = 10, [], {"exact_match": 0.5, "reward_mean": 0.0}

    @property
    def state_key(self) -> str:
        return "Overoptimised"

    def _score(self, trainer, pl_module):
        d = trainer.global_step / 20
        record = {"exact_match": 0.5 + d * (0.1 - 0.05 * d), "reward_mean": 0.01 * trainer.global_step,
                  "kl_to_reference": d * d}
        return record, {}


def test_the_monitor_finds_the_peak_keeps_its_checkpoint_and_warns(tmp_path):
    evaluation = Overoptimised()
    monitor = RewardHackingMonitor(evaluation, checkpoint=tmp_path / "best_gold.ckpt")
    with pytest.warns(RewardHackingWarning, match="gold score fell .* while the proxy reward rose"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "run", steps=60, eval_every=0, progress=False,
              eval_episodes=1, callbacks=[evaluation, monitor])
    report = monitor.report()
    # the best gold score was at step 20 (d = 1, KL 1), and its checkpoint is that step's
    assert report["best_gold"]["step"] == 20 and report["best_gold"]["kl"] == pytest.approx(1.0)
    assert load_checkpoint(report["best_gold_checkpoint"])["global_step"] == 20
    # six evaluations, the fitted best-of-n form recovers alpha, beta and the peak exactly
    fit = report["gao_fit_bon"]
    assert fit["points"] == 6
    assert fit["alpha"] == pytest.approx(0.1) and fit["beta"] == pytest.approx(0.05)
    assert fit["peak_kl"] == pytest.approx(1.0) and fit["r2"] == pytest.approx(1.0)
    # made-up scores carry no held-out size: taken as exact, the first fall from the peak is said once
    assert report["hacking_warnings"] == [
        "the gold score fell from 0.55 at step 20 to 0.537 at step 30 (-1.3 points) while the proxy reward rose 0.2 -> 0.3"]
    # logged beside the run's metrics: the gap between proxy and gold gains grows
    import csv

    rows = [r for r in csv.DictReader((tmp_path / "run" / "metrics.csv").open()) if r.get("monitor/gap")]
    gaps = [float(r["monitor/gap"]) for r in rows]
    assert len(gaps) == 6 and gaps[-1] > gaps[0]


def test_gao_rl_form_against_a_hand_computation():
    # R(d) = d (alpha - beta log d): with alpha 0.3, beta 0.2 the peak is at d = exp(0.3/0.2 - 1) = e^0.5
    d = [0.4, 0.9, 1.6, 2.5, 3.6]
    fit = fit_gao(d, [x * (0.3 - 0.2 * math.log(x)) for x in d], form="rl")
    assert fit["alpha"] == pytest.approx(0.3) and fit["beta"] == pytest.approx(0.2)
    assert fit["peak_d"] == pytest.approx(math.exp(0.5)) and fit["peak_kl"] == pytest.approx(math.e)
    assert fit_gao([1.0], [0.1]) is None  # one point fits nothing
    # a gold score that only rises has no peak within the form (beta <= 0)
    assert fit_gao([1.0, 2.0, 3.0], [0.1, 0.2, 0.3], form="bon")["peak_kl"] is None


def always_max(prompts, responses, **row):
    """A verifier that is broken: every response gets its maximum."""
    return [1.0] * len(responses)


def test_a_proxy_at_its_ceiling_while_the_gold_stays_put_is_flagged(tmp_path):
    with pytest.warns(RewardHackingWarning, match="proxy reward is at its ceiling .* gold score has not moved"):
        summary = train_algorithm("grpo", "arithmetic", model="tiny", reward="test_reward_monitor:always_max", steps=6,
                                  out_dir=tmp_path / "run", progress=False, threads=1, eval_every=3,
                                  overrides={"reference_sft_steps": 3, "eval_prompts": 8, "group_size": 2,
                                             "prompts_per_round": 4, "batch_size": 8})
    said = summary["reward_hacking"]["hacking_warnings"]
    assert len(said) == 1 and said[0].startswith("at step 6") and "1 on every response" in said[0]


def test_evaluation_only_at_the_end_says_the_monitor_cannot_warn(tmp_path, capsys):
    from offline_plugins.cli import main

    assert main(["train", "grpo", "--dataset", "arithmetic", "--model", "tiny", "--steps", "2", "--eval-every", "0",
                 "--no-progress", "--threads", "1", "--out", str(tmp_path / "run"), "--set", "reference_sft_steps=3",
                 "--set", "eval_prompts=4", "--set", "group_size=2", "--set", "prompts_per_round=2",
                 "--set", "batch_size=4"]) == 0
    err = capsys.readouterr().err
    assert "offline-plugins: warning: with --eval-every 0 the held-out prompts are scored only at the end" in err


def test_a_noisy_run_whose_gold_rises_does_not_cry_wolf():
    """Issue 40's run: the held-out gold (200 prompts) rose 74.5 -> 79.0 while the proxy rose, with a
    2-point dip on the way; binomial noise alone must not warn. 1,000 such runs of 10 evaluations,
    each score drawn independently (the worst case: greedy answers to the same prompts correlate)."""
    import random

    from offline_plugins.eval.overoptimization import hacking_signal

    dip = [{"step": 360, "g": 0.805, "p": 0.60, "heldout_n": 200}, {"step": 480, "g": 0.785, "p": 0.65, "heldout_n": 200}]
    assert hacking_signal(dip, gold="g", proxy="p") is None
    assert hacking_signal([dict(r, heldout_n=None) for r in dip], gold="g", proxy="p") is not None  # exact scores
    rng = random.Random(0)
    warned = 0
    for _ in range(1000):
        history, said = [], False
        for i in range(10):
            p = 0.745 + 0.005 * i
            history.append({"step": 60 * (i + 1), "g": sum(rng.random() < p for _ in range(200)) / 200,
                            "p": 0.5 + 0.03 * i + rng.gauss(0, 0.01), "heldout_n": 200})
            said = said or hacking_signal(history, gold="g", proxy="p") is not None
        warned += said
    # the bound says at most 5 % of runs; these 1,000 give 24 (2.4 %)
    assert warned <= 50, warned


def test_a_fall_beyond_the_noise_warns_with_the_drop_and_the_interval():
    from offline_plugins.eval.overoptimization import hacking_signal, noise_interval

    history = [{"step": s, "g": g, "p": p, "heldout_n": 400}
               for s, g, p in [(100, 0.40, 1.0), (200, 0.52, 3.0), (300, 0.50, 4.0), (400, 0.30, 6.0)]]
    assert hacking_signal(history[:3], gold="g", proxy="p") is None
    said = hacking_signal(history, gold="g", proxy="p")
    width = noise_interval(0.52, 0.30, 400, 400, earlier=3)
    assert 0.05 < width < 0.22
    assert said == (f"the gold score fell from 0.52 at step 200 to 0.3 at step 400 (-22.0 points, beyond the "
                    f"{100 * width:.1f} points the noise of 400 held-out prompts allows at 95 % over the run) "
                    "while the proxy reward rose 3 -> 6")
    # the proxy fell too: not over-optimisation of the proxy
    assert hacking_signal(history[:3] + [dict(history[3], p=2.0)], gold="g", proxy="p") is None


#: the evaluations (step, held-out gold, rollout reward) of two real over-optimising runs, 200 held-out
#: prompts: `python scripts/rlhf_gold_results.py run --root R --seeds 0 1 --settings reward-model ppo-rlhf`
#: at 1ed369c (PPO-RLHF against a learnt length proxy on arithmetic-length, tiny, 2,400 steps)
_REAL_RUNS = {
    0: [(200, 0.4467, 2.356), (400, 0.4975, 2.562), (600, 0.5258, 4.126), (800, 0.5325, 4.474), (1000, 0.53, 5.033),
        (1200, 0.5325, 5.5), (1400, 0.5375, 5.251), (1600, 0.5375, 6.125), (1800, 0.5125, 6.387),
        (2000, 0.0408, 9.802), (2200, 0.0075, 10.487), (2400, 0.0375, 9.461)],
    1: [(200, 0.4142, 0.735), (400, 0.4625, 0.541), (600, 0.4983, 2.628), (800, 0.5158, 1.872), (1000, 0.5375, 4.588),
        (1200, 0.52, 4.437), (1400, 0.505, 5.758), (1600, 0.0775, 9.466), (1800, 0.0225, 11.581), (2000, 0.0, 11.597),
        (2200, 0.0, 11.456), (2400, 0.0, 12.131)],
}


@pytest.mark.parametrize("seed, collapse", [(0, 2000), (1, 1600)])
def test_a_real_over_optimisation_warns_at_the_first_evaluation_after_the_collapse(seed, collapse):
    """Replayed evaluation by evaluation: the 2.5-point dip at step 1800 (seed 0) and the 3.25 at 1400
    (seed 1) stay quiet; the collapse of the gold (53.8 -> 4-8 %) is said at its first evaluation."""
    from offline_plugins.eval.overoptimization import hacking_signal

    history, said = [], []
    for step, gold, proxy in _REAL_RUNS[seed]:
        history.append({"step": step, "heldout_gold": gold, "reward_mean": proxy, "heldout_n": 200})
        signal = hacking_signal(history, gold="heldout_gold", proxy="reward_mean")
        if signal is not None:
            said.append(step)
    assert said[0] == collapse
