"""A run's inputs and files: what --overwrite may remove, what a config file may expand to,
a resume whose data changed, and a checkpoint whose tensors were reshaped."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from _lightning_fixtures import TINY_SPEC, FakeOfflineData
from offline_plugins.cli import main
from offline_plugins.config import ConfigError, load_config_file
from offline_plugins.lightning.guards import RunError
from offline_plugins.lightning.plan import RunPlan
from offline_plugins.lightning.run import RunSettings, train, train_algorithm
from offline_plugins.plugins.datakind import DataOptions

torch.set_num_threads(1)

QUIET = dict(progress=False, eval_episodes=1, eval_every=0, seed=0)
DATASET = "pendulum/medium-v0"
TRAIN = ["--set", "hidden=[16,16]", "--set", "batch_size=32", "--eval-episodes", "1", "--eval-every", "0",
         "--no-progress", "--threads", "1"]


def _cli(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


def _one_error_line(code, err, *needles):
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("offline-plugins: error:"), err
    assert "internal error" not in err
    for needle in needles:
        assert needle in err, err


# -- D8: --overwrite never removes the run's own input ------------------------------
def _plan(**options) -> RunPlan:
    spec = TINY_SPEC
    return RunPlan(spec, spec.default_config(), FakeOfflineData(), "fake/pendulum-v0", {}, 64,
                   options=DataOptions(**options))


def test_overwrite_refuses_to_remove_the_model_the_run_reads(tmp_path):
    out = tmp_path / "run"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=2, **QUIET)
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")  # the earlier run's exported model, now an input
    with pytest.raises(RunError) as err:
        train(_plan(model=str(out / "model")), RunSettings(out_dir=out, steps=2, overwrite=True, **QUIET))
    text = str(err.value)
    assert len(text.splitlines()) == 1
    assert f"--model {str(out / 'model')!r} lies inside" in text and "--overwrite removes" in text, text
    assert "copy it elsewhere" in text and "choose another --out" in text
    assert (out / "model" / "config.json").read_text() == "{}"
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # the earlier run is untouched too


def test_overwrite_refuses_a_config_or_reward_inside_the_run_files(tmp_path):
    out = tmp_path / "run"
    train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=2, **QUIET)
    config = out / "checkpoints" / "tiny.yaml"
    config.write_text("hidden: 8\n")
    with pytest.raises(RunError, match=r"--config .*tiny.yaml' lies inside .*checkpoints', which --overwrite removes"):
        train_algorithm(TINY_SPEC, FakeOfflineData(), config=config, out_dir=out, steps=2, overwrite=True, **QUIET)
    assert config.is_file()
    (out / "reward_model").mkdir()
    with pytest.raises(RunError, match=r"--reward .*reward_model' lies inside"):
        train(_plan(reward=str(out / "reward_model")), RunSettings(out_dir=out, steps=2, overwrite=True, **QUIET))
    with pytest.raises(RunError, match=r"--reward .*reward_model' lies inside"):  # a reward-model run's OUT
        train(_plan(reward=str(out)), RunSettings(out_dir=out, steps=2, overwrite=True, **QUIET))
    assert (out / "reward_model").is_dir() and (out / "checkpoints" / "last.ckpt").is_file()
    # an input beside the run files, not inside them, is fine
    mine = out / "my-model"
    mine.mkdir()
    summary = train(_plan(model=str(mine)), RunSettings(out_dir=out, steps=3, overwrite=True, **QUIET))
    assert summary["steps"] == 3 and mine.is_dir()


def test_a_new_run_may_not_export_over_its_own_input_either(tmp_path):
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    with pytest.raises(RunError, match="which this run replaces with its own"):
        train(_plan(model=str(out / "model")), RunSettings(out_dir=out, steps=2, **QUIET))
    assert (out / "model").is_dir()


# -- D9: a config file cannot expand past a limit -----------------------------------
def _laughs(levels: int, key: str = "actor_lr") -> str:
    """A value of ``key`` whose last item expands to ``9**levels`` strings through nested anchors and aliases."""
    lines = [f"{key}:", '  - &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_billion_laughs_is_refused_before_it_is_built(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(_laughs(10))  # 9**10 strings once the aliases are followed, 1 KB on disk
    assert path.stat().st_size < 2000
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config_file(path)
    assert time.perf_counter() - started < 5
    text = str(err.value)
    assert len(text) < 400 and len(text.splitlines()) == 1, text[:1000]
    assert str(path) in text and "aliases" in text


def test_a_config_alias_bomb_on_the_cli_is_one_short_line(tmp_path, capsys):
    path = tmp_path / "laughs.yaml"
    path.write_text(_laughs(6))  # 9**6 strings: a 4 MB error message before the limit
    code, err = _cli(capsys, "train", "iql", "--dataset", "pendulum/medium-replay-v0", "--config", str(path),
                     "--out", str(tmp_path / "r"), "--no-progress")
    _one_error_line(code, err, str(path))
    assert len(err) < 500


def test_a_plain_config_with_a_few_aliases_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("width: &w 64\nhidden: [*w, *w]\nlr: 0.001\n")
    assert load_config_file(path) == {"width": 64, "hidden": [64, 64], "lr": 0.001}
    (tmp_path / "self.yaml").write_text("a: &a [*a]\n")
    with pytest.raises(ConfigError, match="contains itself"):
        load_config_file(tmp_path / "self.yaml")


# -- D7: a resume refuses data that changed; D6: eval of a reshaped checkpoint --------
@pytest.fixture(scope="module")
def iql_run(tmp_path_factory):
    """A private Minari store with a small pendulum dataset, and a 3-step IQL run on it."""
    import os

    root = tmp_path_factory.mktemp("inputs")
    old = {k: os.environ.get(k) for k in ("MINARI_DATASETS_PATH", "OFFLINE_PLUGINS_OFFLINE")}
    os.environ["MINARI_DATASETS_PATH"] = str(root / "minari")
    os.environ["OFFLINE_PLUGINS_OFFLINE"] = "1"
    try:
        assert main(["data", "make", DATASET, "--steps", "2000", "--no-progress"]) == 0
        assert main(["train", "iql", "--dataset", DATASET, "--steps", "3", "--out", str(root / "run"), *TRAIN]) == 0
        yield root
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture()
def copy_of(iql_run, tmp_path, monkeypatch):
    shutil.copytree(iql_run / "minari", tmp_path / "minari")
    shutil.copytree(iql_run / "run", tmp_path / "run")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    return tmp_path


def test_resume_after_the_data_file_changed_is_refused_naming_the_file(copy_of, capsys):
    out = copy_of / "run"
    recorded = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["offline_plugins"]["run"]
    assert sorted(recorded["data_fingerprint"]["files"]) == ["main_data.hdf5", "metadata.json"]
    # the same data: the resume goes on
    resume = ["train", "iql", "--dataset", DATASET, "--out", str(out), "--resume", *TRAIN]
    code, err = _cli(capsys, *resume, "--steps", "4")
    assert code == 0, err
    # the dataset made again with another seed: same id, other contents
    assert main(["data", "make", DATASET, "--steps", "2000", "--seed", "1", "--force", "--no-progress"]) == 0
    capsys.readouterr()
    code, err = _cli(capsys, *resume, "--steps", "6")
    _one_error_line(code, err, "cannot resume: the data of checkpoint", "main_data.hdf5",
                    "restore the data the run was trained on, or start a new run")
    assert str(copy_of / "minari" / "offline-plugins" / DATASET / "data" / "main_data.hdf5") in err
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_eval_of_a_checkpoint_with_a_reshaped_tensor_names_it_in_one_line(copy_of, capsys):
    path = copy_of / "run" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    name = next(k for k, v in ckpt["state_dict"].items() if v.dim() == 2 and v.shape[0] != v.shape[1])
    shape = tuple(ckpt["state_dict"][name].shape)
    ckpt["state_dict"][name] = ckpt["state_dict"][name].t().contiguous()
    bad = copy_of / "reshaped.ckpt"
    torch.save(ckpt, bad)
    code, err = _cli(capsys, "eval", str(bad), "--episodes", "1")
    _one_error_line(code, err, str(bad), name, f"{shape[::-1]} in the checkpoint, {shape} here",
                    "does not fit the networks")
