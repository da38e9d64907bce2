"""``offline_plugins.lightning.build(...)`` fitted by a ``lightning.Trainer`` the user builds:
their logger, their callback, their ``max_steps`` and ``ckpt_path``, for offline transitions
(IQL), preference pairs (DPO) and online rollouts (GRPO); a Trainer without a callback the
algorithm needs is refused in one line; the shell's old class names still work."""

from __future__ import annotations

import csv
import json
import os
import random
import sys
import warnings
from pathlib import Path

import lightning
import pytest
import torch
from _lightning_fixtures import TINY_SPEC, FakeOfflineData
from _ranks import launch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

import offline_plugins.lightning as opl
from offline_plugins.errors import UserError

torch.set_num_threads(1)

DDP_SCRIPT = Path(__file__).parent / "_lightning_user_ddp_run.py"


def digit_share(prompts, responses, **columns):
    """A reward for the GRPO test: the share of digits in the response."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


class CountSteps(Callback):
    """A user's own callback: counts the batches it sees and the loss terms logged."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1


def _trainer(tmp_path, max_steps: int, callbacks, **kw) -> lightning.Trainer:
    kw = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False,
          "default_root_dir": str(tmp_path), **kw}
    return lightning.Trainer(max_steps=max_steps, callbacks=callbacks, **kw)


def _fit(trainer, parts, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(parts.module, datamodule=parts.datamodule, **kw)


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _csv_rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_build_is_the_function_and_the_old_names_remain():
    import offline_plugins.lightning.builder  # noqa: F401  (a submodule named build would shadow the function)
    from offline_plugins.lightning.data import ReplayDataModule
    from offline_plugins.lightning.module import AlgorithmModule

    assert callable(opl.build) and opl.build is offline_plugins.lightning.builder.build
    assert opl.AlgorithmModule is AlgorithmModule and opl.ReplayDataModule is ReplayDataModule
    assert opl.OfflineAlgorithmModule is AlgorithmModule and opl.OfflineDataModule is ReplayDataModule
    assert "OfflineAlgorithmModule" not in opl.__all__ and "build" in opl.__all__


def test_a_user_trainer_trains_iql_with_its_own_logger_and_callback(minari_store, tmp_path):
    parts = opl.build("iql", "pendulum/medium-replay-v0", config={"hidden": [32, 32], "batch_size": 64},
                      eval_episodes=1, seed=3)
    module, datamodule, callbacks = parts  # unpacks as the three pieces
    assert module is parts.module and datamodule is parts.datamodule
    names = [type(cb).__name__ for cb in callbacks]
    assert names == ["NonFiniteGuard", "TargetNetworkUpdate", "PolicyEvaluation"]
    before = _state(module)
    target_keys = [k for k in before if "target" in k]
    assert target_keys
    mine = CountSteps()
    logger = CSVLogger(tmp_path / "logs", name="mine", version="v")
    trainer = _trainer(tmp_path, 8, [*callbacks, mine], logger=logger, log_every_n_steps=2)
    _fit(trainer, parts)
    assert trainer.global_step == 8 and mine.batches == 8  # one step per training_step by default
    after = _state(module)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in target_keys)
    # TargetNetworkUpdate moved the target critics
    assert all(not torch.equal(before[k], after[k]) for k in target_keys if after[k].is_floating_point())
    rows = _csv_rows(tmp_path / "logs" / "mine" / "v" / "metrics.csv")
    trained = [r for r in rows if r.get("train/loss_qvalue")]
    assert [int(r["step"]) for r in trained] == [2, 4, 6, 8]
    assert all(float(r["train/loss_value"]) == float(r["train/loss_value"]) for r in trained)
    # the evaluation ran at the end, into the user's logger too
    assert [h["step"] for h in parts.evaluation.history] == [8]
    assert any(r.get("eval/return_mean") for r in rows)

    # the user's checkpoint is one `offline-plugins eval` reads
    path = tmp_path / "user.ckpt"
    trainer.save_checkpoint(path)
    result = opl.evaluate_checkpoint(path, episodes=1)
    assert result["algorithm"] == "iql" and result["step"] == 8
    assert result["return_mean"] == pytest.approx(parts.evaluation.history[-1]["return_mean"])


def _pairs(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}*{i}=", "chosen": "yes", "rejected": "no"}) + "\n"
                            for i in range(n)))
    return path


def test_a_user_trainer_trains_dpo(tmp_path):
    data = _pairs(tmp_path / "pairs.jsonl", 40)
    parts = opl.build("dpo", str(data), model="tiny", config={"batch_size": 4, "lr": 3e-3})
    assert [type(cb).__name__ for cb in parts.callbacks] == ["NonFiniteGuard", "PreferenceEvaluation"]
    assert parts.required == ()  # no target networks, no callback of its data kind
    before = _state(parts.module)
    mine = CountSteps()
    trainer = _trainer(tmp_path, 4, [*parts.callbacks, mine], logger=CSVLogger(tmp_path, name="dpo", version=""),
                       log_every_n_steps=1)
    _fit(trainer, parts)
    assert trainer.global_step == 4 and mine.batches == 4
    after = _state(parts.module)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = _csv_rows(tmp_path / "dpo" / "metrics.csv")
    losses = [float(r["train/loss_dpo"]) for r in rows if r.get("train/loss_dpo")]
    assert len(losses) == 4 and all(x == x for x in losses)
    last = parts.evaluation.history[-1]
    assert last["step"] == 4 and 0.0 <= last["preference_accuracy"] <= 1.0


def test_a_user_trainer_trains_grpo_on_its_rollouts_and_refuses_without_its_data_module(tmp_path):
    from lightning.pytorch import LightningDataModule

    from offline_plugins.kinds.rollouts.rounds import RolloutDataModule

    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"}) + "\n"
                               for _ in range(60)))
    small = {"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4, "eval_prompts": 8}
    kw = dict(config=small, reward="test_lightning_user_trainer:digit_share")

    bare = opl.build("grpo", str(prompts), **kw)
    assert isinstance(bare.datamodule, RolloutDataModule) and bare.required == ()

    class Elsewhere(LightningDataModule):
        def train_dataloader(self):
            return [bare.datamodule.data.settings.rows] * 3

    before = _state(bare.module)
    with pytest.raises(UserError, match=r"fits grpo without its data module RolloutDataModule \(rounds of rollouts "
                                        r".*datamodule=parts\.datamodule"):
        _trainer(tmp_path, 3, bare.callbacks, logger=False).fit(bare.module, datamodule=Elsewhere())
    assert all(torch.equal(before[k], v) for k, v in _state(bare.module).items())

    parts = opl.build("grpo", str(prompts), **kw)
    before = _state(parts.module)
    trainer = _trainer(tmp_path, 3, parts.callbacks, logger=False)
    _fit(trainer, parts)
    # 6 prompts x 4 responses = 24 rollouts, 8 a step: one round of rollouts fed 3 steps
    assert trainer.global_step == 3 and [h["round"] for h in parts.datamodule.history] == [0]
    assert any(not torch.equal(before[k], v) for k, v in _state(parts.module).items())
    # the loaded data is as it was: the round lives in the data module
    assert not hasattr(parts.plan.data, "buffer") and not hasattr(parts.plan.data, "refill")


def test_a_trainer_without_the_target_update_is_refused_in_one_line(tmp_path):
    parts = opl.build(TINY_SPEC, FakeOfflineData(), eval_episodes=1)
    before = _state(parts.module)
    trainer = _trainer(tmp_path, 4, [parts.callbacks[0]], logger=False)  # the guard only
    with pytest.raises(UserError) as err:
        _fit(trainer, parts)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "TargetNetworkUpdate" in message and "callbacks=[*parts.callbacks" in message
    assert "tiny-td3bc" in message
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in _state(parts.module).items())
    # evaluation and the guard are not required: with the target update alone it trains
    parts = opl.build(TINY_SPEC, FakeOfflineData(), eval_episodes=1)
    trainer = _trainer(tmp_path, 2, [cb for cb in parts.callbacks if type(cb).__name__ == "TargetNetworkUpdate"],
                       logger=False)
    _fit(trainer, parts)
    assert trainer.global_step == 2


def _run_to(tmp_path, name: str, steps: int, *, ckpt_path=None, save_at=None, seed: int = 0, steps_per_call=1,
            checkpoint_every=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    parts = opl.build(TINY_SPEC, FakeOfflineData(), seed=seed, eval_every=2, eval_episodes=1,
                      steps_per_call=steps_per_call)
    mine = [ModelCheckpoint(dirpath=tmp_path / name, filename="part", every_n_train_steps=checkpoint_every,
                            save_top_k=-1)] if checkpoint_every else []
    trainer = _trainer(tmp_path / name, steps, [*parts.callbacks, *mine],
                       logger=CSVLogger(tmp_path / name, name="", version=""), log_every_n_steps=1,
                       enable_checkpointing=bool(mine))
    _fit(trainer, parts, ckpt_path=ckpt_path)
    if save_at is not None:
        trainer.save_checkpoint(save_at)
    return parts, trainer


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_fit_with_ckpt_path_resumes_exactly(tmp_path, steps_per_call):
    # TD3+BC with a delayed actor (period 2) and a soft target update: 3 steps, then 4 more
    # from the checkpoint, equal bit for bit to 7 steps in one go (parameters, targets, Adam)
    full, full_trainer = _run_to(tmp_path, "full", 7, save_at=tmp_path / "full.ckpt", steps_per_call=steps_per_call)
    # the user's own ModelCheckpoint saves step 3 (the run's end evaluation comes after it)
    _run_to(tmp_path, "part", 3, checkpoint_every=3, steps_per_call=steps_per_call)
    resumed, trainer = _run_to(tmp_path, "resumed", 7, ckpt_path=tmp_path / "part" / "part.ckpt",
                               save_at=tmp_path / "resumed.ckpt", steps_per_call=steps_per_call)
    assert trainer.global_step == 7
    a, b = _state(full.module), _state(resumed.module)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = torch.load(tmp_path / "full.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    sb = torch.load(tmp_path / "resumed.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    # the evaluation history carried over: evaluations at 2 (before the checkpoint), 4, 6 and the end
    assert [h["step"] for h in resumed.evaluation.history] == [h["step"] for h in full.evaluation.history] == [2, 4, 6, 7]


def test_a_checkpoint_saved_under_the_old_data_module_name_still_restores_it(tmp_path):
    # Lightning files the data module's state under its class name, which was OfflineDataModule;
    # such a checkpoint must still restore it (here: its seed check refuses another seed)
    _run_to(tmp_path, "part", 2, save_at=tmp_path / "part.ckpt")
    ckpt = torch.load(tmp_path / "part.ckpt", weights_only=True)
    ckpt["OfflineDataModule"] = ckpt.pop("ReplayDataModule")
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(UserError, match="trained with seed 0, this run uses seed 5"):
        _run_to(tmp_path, "other-seed", 4, ckpt_path=tmp_path / "old.ckpt", seed=5)
    _, trainer = _run_to(tmp_path, "same-seed", 4, ckpt_path=tmp_path / "old.ckpt")
    assert trainer.global_step == 4


def test_train_builds_its_run_with_build(tmp_path, monkeypatch):
    # one place decides which callbacks an algorithm needs: train() fits what build() returns
    from offline_plugins.lightning import builder, run

    seen = []

    def spy(*args, **kwargs):
        seen.append(builder.build(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(run, "build", spy)
    summary = opl.train(opl.plan_run(TINY_SPEC, FakeOfflineData()),
                        opl.RunSettings(steps=2, eval_every=0, eval_episodes=1, out_dir=tmp_path / "run",
                                        progress=False))
    assert summary["steps"] == 2 and len(seen) == 1
    assert seen[0].module.hparams["run"]["steps"] == 2  # train's own settings saved beside build's
    assert summary["eval_history"] == seen[0].evaluation.history


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_on_two_cpu_ranks_through_a_user_trainer(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = launch([sys.executable, str(DDP_SCRIPT), str(tmp_path), "6"], env, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["steps"] for r in ranks] == [6, 6]
    a, b = (r["state"] for r in ranks)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(ranks[0]["batches"]) == 6 and all(x != y for x, y in zip(ranks[0]["batches"], ranks[1]["batches"]))
    # the user's logger on rank 0: the training terms of every step, averaged over nothing
    rows = _csv_rows(tmp_path / "logs" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r.get("train/loss_qvalue")] == [1, 2, 3, 4, 5, 6]
