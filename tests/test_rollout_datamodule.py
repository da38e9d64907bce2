"""The online round's one home: the text-rollouts kind's RolloutDataModule, and the RolloutPlan
an online algorithm's build returns instead of writing into the data it is given."""

from __future__ import annotations

import copy
import json
import random
import warnings

import lightning
import pytest
import torch

import offline_plugins.lightning as opl
from offline_plugins.errors import UserError

torch.set_num_threads(1)

_SMALL = {"group_size": 4, "prompts_per_round": 4, "batch_size": 8, "max_new_tokens": 3, "eval_prompts": 4}


#: the dense reward of tests/test_online_train.py: the share of digits in a response
_REWARD = "_text_rewards:digit_share"


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """80 prompts of four random letters and a colon (no answers: the reward function scores them)."""
    rng = random.Random(1)
    rows = [{"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"} for _ in range(80)]
    path = tmp_path_factory.mktemp("rounds") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def _snapshot(data) -> dict:
    """What a loaded RolloutData holds, by identity and by value."""
    return {"attrs": {k: id(v) for k, v in vars(data).items()},
            "settings": data.settings, "width": data.width,
            "vocab": len(data.tokenizer),
            "reference": {k: v.clone() for k, v in data.reference.state_dict().items()},
            "held_out": copy.deepcopy(data.source.held_out)}


def _same(before: dict, data) -> None:
    after = _snapshot(data)
    assert after["attrs"] == before["attrs"]  # no attribute added, none replaced
    assert after["settings"] == before["settings"] and after["width"] == before["width"]
    assert after["vocab"] == before["vocab"] and after["held_out"] == before["held_out"]
    assert after["reference"].keys() == before["reference"].keys()
    assert all(torch.equal(after["reference"][k], v) for k, v in before["reference"].items())


def _trainer(tmp_path, steps, callbacks):
    return lightning.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks)


@pytest.mark.parametrize("algorithm, extra", [("grpo", {}), ("online-dpo", {"batch_size": 2}),
                                              ("text-dt", {}), ("ppo-rlhf", {"group_size": 1, "batch_size": 4})])
def test_build_and_training_leave_the_loaded_data_as_it_was(prompt_file, tmp_path, algorithm, extra):
    from offline_plugins.lightning.run import plan_run

    plan = plan_run(algorithm, str(prompt_file), config={**_SMALL, **extra},
                    reward=_REWARD)
    before = _snapshot(plan.data)
    parts = opl.build(algorithm, None, plan=plan)
    _same(before, plan.data)
    assert parts.module.parts.rollout is not None and parts.datamodule.data is plan.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, 2, parts.callbacks).fit(parts.module, datamodule=parts.datamodule)
    _same(before, plan.data)
    assert parts.datamodule.history and parts.datamodule.rollouts is not None


class _PolicyAt(lightning.Callback):
    """Keeps copies of the policy's weights after each gradient step (steps of one call included)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict] = {}

    def on_gradient_step(self, trainer, pl_module, losses) -> None:  # each step of a call of several
        self.weights[trainer.global_step] = copy.deepcopy(pl_module.parts.model.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights[trainer.global_step] = copy.deepcopy(pl_module.parts.model.state_dict())


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_a_round_is_sampled_by_the_policy_after_every_earlier_update(prompt_file, tmp_path, steps_per_call):
    """Lightning fetches a batch ahead; the round must still come from the policy as it is when the
    round's first step starts, not from the one the batch was fetched under."""
    parts = opl.build("grpo", str(prompt_file), config={**_SMALL, "lr": 1e-2}, steps_per_call=steps_per_call,
                      reward=_REWARD)
    rounds = parts.datamodule
    u = rounds.updates_per_round
    assert u == 2  # 4 prompts x 4 responses = 16 rollouts, 8 a step
    seen = _PolicyAt()
    collected = []
    collect = rounds.collector.collect

    def spy(model, **kw):
        td, stats = collect(model, **kw)
        collected.append((kw["round"], td.get(("tokens", "full")).clone()))
        return td, stats

    rounds.collector.collect = spy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, 2 * u, [*parts.callbacks, seen]).fit(parts.module, datamodule=parts.datamodule)
    assert [r for r, _ in collected] == [0, 1] and [h["step"] for h in rounds.history] == [0, u]
    policy = copy.deepcopy(parts.module.parts.model)

    def round_one(after_step: int) -> torch.Tensor:
        policy.load_state_dict(seen.weights[after_step])
        td, _ = collect(policy, round=1, rank=0, process=parts.module.parts.rollout.process)
        return td.get(("tokens", "full"))

    # round 1 again, sampled by a copy of the policy as it was after step u: the same tokens;
    # the policy one update older (what a batch fetched a step ahead would have seen) samples others
    assert torch.equal(round_one(u), collected[1][1])
    assert not torch.equal(round_one(u - 1), collected[1][1])


def test_the_kind_has_no_callbacks_and_its_module_refuses_a_round_that_batch_size_does_not_divide(prompt_file):
    from offline_plugins.kinds.rollouts import TextRollouts
    from offline_plugins.kinds.rollouts.rounds import RolloutDataModule

    parts = opl.build("grpo", str(prompt_file), config=_SMALL, reward=_REWARD)
    assert TextRollouts().callbacks(parts.plan.data, parts.module.parts, seed=0) == []
    with pytest.raises(UserError, match=r"batch_size 6 must divide the 16 rollouts \(prompts_per_round 4 x "
                                        r"group_size 4\) of a round; fix it with --set batch_size=2"):
        RolloutDataModule(parts.plan.data, parts.module.parts, batch_size=6)
    sft_like = copy.copy(parts.module.parts)
    sft_like.rollout = None
    with pytest.raises(UserError, match=r"TextGRPOLoss has no rollout plan \(AlgorithmParts\.rollout\)"):
        RolloutDataModule(parts.plan.data, sft_like, batch_size=8)


def test_a_checkpoint_from_before_the_data_module_resumes_its_round_exactly(prompt_file, tmp_path):
    """Runs saved before this layout kept the round in the RolloutRefill callback's state (and the
    monitor's in its own); resuming one trains on that round, as an uninterrupted run does."""
    from offline_plugins.lightning.checkpoints import load_checkpoint
    from offline_plugins.lightning.run import train_algorithm

    kwargs = dict(seed=1, progress=False, threads=1, reward=_REWARD, eval_every=0,
                  overrides={**_SMALL, "lr": 3e-3, "ppo_epochs": 2})
    # 4 prompts x 4 = 16 rollouts, batch 8, 2 epochs: 4 steps a round; step 3 is mid-round
    train_algorithm("grpo", str(prompt_file), steps=6, out_dir=tmp_path / "full", **kwargs)
    train_algorithm("grpo", str(prompt_file), steps=3, out_dir=tmp_path / "part", **kwargs)
    path = tmp_path / "part" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    rounds = ckpt.pop("RolloutDataModule")  # the old layout: the round under the callback's key
    ckpt["callbacks"]["RolloutRefill"] = {k: v for k, v in rounds.items() if k != "seed"}
    ckpt["callbacks"]["RewardHackingMonitor"] = ckpt["callbacks"]["RolloutEvaluation"].pop("monitor")
    torch.save(ckpt, path)
    assert "RolloutDataModule" not in load_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = train_algorithm("grpo", str(prompt_file), steps=6, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 6 and resumed["rounds"] == 2
    from safetensors.torch import load_file

    full, part = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("full", "part"))
    assert all(torch.equal(full[k], part[k]) for k in full)
