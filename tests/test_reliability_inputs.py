"""Bad language-model inputs meet one line and exit 2, not an internal error or a quiet success
(reliability pass 2): model and reward-model folders that cannot load, JSONL files that are not
UTF-8 or nest too deep, out-of-range settings, batches the data or the memory cannot hold, a
completion longer than the context, and pickled code in a reward model's head."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from offline_plugins.cli import main

SRC = Path(__file__).resolve().parents[1] / "src" / "offline_plugins"


def _cli(capsys, *args) -> tuple[int, list[str]]:
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


def _one_line(code, err, says):
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("offline-plugins: error:"), err
    assert says in err[0], err


# -- every torch.load opens tensors only ------------------------------------------------------
def test_every_torch_load_in_the_package_passes_weights_only_true():
    loose = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                given = {k.arg: k.value for k in node.keywords}
                value = given.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    loose.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not loose, f"torch.load without weights_only=True: {loose}"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from offline_plugins.modules.causal_lm import CausalLMReward
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.sources.reward_source import save_reward_model

    model, tok = load_causal_lm("tiny", seed=0)
    return save_reward_model(CausalLMReward(model), tok, tmp_path_factory.mktemp("rm") / "reward_model")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_reward_head_carrying_code_is_refused_and_nothing_runs(reward_dir, tmp_path, monkeypatch):
    from offline_plugins.text.sources.reward_source import RewardModelError, load_reward_model

    bad = _copy(reward_dir, tmp_path / "bad")
    marker = tmp_path / "ran"
    torch.save({"weight": _Payload(str(marker))}, bad / "reward_head.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # what made the old loader run it
    with pytest.raises(RewardModelError, match="could not be read as tensors.*nothing in it ran"):
        load_reward_model(bad)
    assert not marker.exists()


@pytest.mark.parametrize("damage, says", [
    (lambda d: (d / "reward_head.pt").unlink(), "has no reward_head.pt"),
    (lambda d: (d / "reward_head.pt").write_bytes(b"\x00" * 10), "could not be read as tensors"),
    (lambda d: torch.save({"weight": torch.zeros(3, 7)}, d / "reward_head.pt"), "expected the score head's tensors"),
    (lambda d: torch.save({"weight": torch.zeros(1, 7), "bias": torch.zeros(1)}, d / "reward_head.pt"),
     "weight has shape (1, 7)"),
    (lambda d: (d / "reward_model.json").write_text("{oops"), "is not a JSON object"),
    (lambda d: (d / "reward_model.json").write_text('{"heads": 0}'), "heads (a whole number >= 1)"),
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
])
def test_a_damaged_reward_model_folder_is_one_line(reward_dir, tmp_path, damage, says):
    from offline_plugins.errors import UserError
    from offline_plugins.text.sources.reward_source import load_reward_model

    bad = _copy(reward_dir, tmp_path / "bad")
    damage(bad)
    with pytest.raises(UserError) as info:
        load_reward_model(bad)
    assert says in str(info.value) and "\n" not in str(info.value)


# -- --model folders ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm("tiny", seed=0)
    out = tmp_path_factory.mktemp("model") / "good"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _config(d: Path, **changes):
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, **changes}))


@pytest.mark.parametrize("damage, says", [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: [f.unlink() for f in d.iterdir() if f.name.startswith("tokenizer")], "has no tokenizer files"),
    (lambda d: _config(d, model_type="no-such-architecture"), "does not recognize this architecture"),
    (lambda d: _config(d, vocab_size=5), "a weight's shape differs from what config.json describes"),
    (lambda d: (d / "config.json").write_text("{not json"), "not a valid JSON file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "SafetensorError"),
    (lambda d: (d / "model.safetensors").unlink(), "no file named model.safetensors"),
])
def test_a_model_folder_that_cannot_load_is_one_line(model_dir, tmp_path, capsys, damage, says):
    bad = _copy(model_dir, tmp_path / "model")
    damage(bad)
    code, err = _cli(capsys, "train", "sft", "--dataset", "arithmetic", "--model", str(bad), "--steps", "1",
                     "--out", str(tmp_path / "run"), "--no-progress")
    _one_line(code, err, says)
    assert str(bad) in err[0]


def test_a_tokenizer_larger_than_the_embedding_is_refused(model_dir, tmp_path):
    from offline_plugins.modules.tiny_lm import ModelLoadError, load_causal_lm

    _, tok = load_causal_lm("tiny", seed=0)
    bad = _copy(model_dir, tmp_path / "model")
    tok.add_tokens(["<a>", "<b>"])
    tok.save_pretrained(bad)
    with pytest.raises(ModelLoadError, match="tokenizer has 101 tokens but the model's embedding has 99 rows"):
        load_causal_lm(bad)


# -- JSONL files ------------------------------------------------------------------------------
def _pairs(n=300):
    return [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("algorithm, rows", [("dpo", _pairs(20)),
                                             ("grpo", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]),
                                             ("sft", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(20)])])
@pytest.mark.parametrize("bad, says", [(b'{"prompt": "\xff\xfe"}\n', "line 21 is not UTF-8 text (byte 0xff"),
                                       (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 21 nests JSON too deeply")])
def test_a_jsonl_line_that_cannot_be_read_is_named(tmp_path, capsys, algorithm, rows, bad, says):
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with path.open("ab") as fh:
        fh.write(bad)
    code, err = _cli(capsys, "train", algorithm, "--dataset", str(path), "--steps", "1", "--out", str(tmp_path / "run"),
                     "--no-progress")
    _one_line(code, err, says)
    assert str(path) in err[0]


# -- settings out of range, batches that cannot fit --------------------------------------------
@pytest.fixture(scope="module")
def pair_file(tmp_path_factory):
    return _jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", _pairs())


@pytest.mark.parametrize("setting, says", [("beta=-5", "config key 'beta' of DPOConfig must be > 0"),
                                           ("lora_r=-1", "config key 'lora_r' of DPOConfig must be >= 0"),
                                           ("lr=0", "config key 'lr' of DPOConfig must be > 0"),
                                           ("label_smoothing=0.5", "must be in [0, 0.5)")])
def test_an_out_of_range_setting_is_refused(pair_file, tmp_path, capsys, setting, says):
    code, err = _cli(capsys, "train", "dpo", "--dataset", str(pair_file), "--set", setting, "--steps", "1",
                     "--out", str(tmp_path / "run"), "--no-progress")
    _one_line(code, err, says)
    assert not (tmp_path / "run").exists()


def test_a_batch_larger_than_the_data_is_refused_before_it_is_made(pair_file, tmp_path, capsys):
    code, err = _cli(capsys, "train", "dpo", "--dataset", str(pair_file), "--set", "batch_size=100000",
                     "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress")
    _one_line(code, err, "batch_size=100000 is larger than the")
    assert "training pairs" in err[0] and "--set batch_size=" in err[0]


def test_a_batch_that_cannot_fit_in_memory_is_refused(pair_file, tmp_path, capsys, monkeypatch):
    import offline_plugins.plugins.datakind as datakind

    monkeypatch.setattr(datakind, "available_memory_bytes", lambda device=None: 50 * 2**20)  # 50 MB free
    code, err = _cli(capsys, "train", "dpo", "--dataset", str(pair_file), "--set", "batch_size=128",
                     "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress")
    _one_line(code, err, "but 52 MB of memory is free on")
    assert "--accumulate" in err[0] and "logprob_chunk" in err[0]
    # split into micro-batches, the same batch fits
    code, err = _cli(capsys, "train", "dpo", "--dataset", str(pair_file), "--set", "batch_size=128", "--accumulate", "32",
                     "--steps", "1", "--out", str(tmp_path / "run2"), "--no-progress", "--threads", "1")
    assert code == 0, err


def test_a_round_that_cannot_fit_in_memory_is_refused(tmp_path, capsys):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)])
    code, err = _cli(capsys, "train", "grpo", "--dataset", str(path), "--set", "prompts_per_round=1000000",
                     "--set", "group_size=64", "--set", "batch_size=64", "--steps", "1", "--out", str(tmp_path / "run"),
                     "--no-progress")
    _one_line(code, err, "a round of 64000000 responses (prompts_per_round 1000000 x group_size 64")


def test_max_new_tokens_beyond_the_context_is_refused(tmp_path, capsys):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)])
    code, err = _cli(capsys, "train", "grpo", "--dataset", str(path), "--set", "max_new_tokens=100000", "--steps", "1",
                     "--out", str(tmp_path / "run"), "--no-progress")
    _one_line(code, err, "exceeds the model's context of 128 tokens")


# -- a completion longer than the context -------------------------------------------------------
def test_sft_trains_when_a_completion_is_longer_than_the_context(tmp_path, capsys, caplog):
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(300)]
    rows[5]["completion"] = "9" * 400  # past the tiny model's 128 positions
    path = _jsonl(tmp_path / "sft.jsonl", rows)
    code, err = _cli(capsys, "train", "sft", "--dataset", str(path), "--steps", "2", "--out", str(tmp_path / "run"),
                     "--no-progress", "--threads", "1")
    assert code == 0, err
    assert "truncated 0 prompts (kept their end) and 1 responses" in caplog.text


def test_held_out_rows_longer_than_the_context_are_left_out_and_counted(caplog):
    from offline_plugins.modules.tiny_lm import char_tokenizer
    from offline_plugins.text.data.rollouts import RolloutError, _held_out_within

    tok = char_tokenizer()
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4" * 200}]
    kept, longest = _held_out_within(rows, tok, 64, source="f.jsonl")
    assert kept == rows[:1] and longest == 1
    assert "1 held-out row(s) are longer than the model's context of 64 tokens" in caplog.text
    with pytest.raises(RolloutError, match="every held-out row"):
        _held_out_within(rows[1:], tok, 64, source="f.jsonl")


def test_a_transition_batch_that_cannot_fit_is_refused(monkeypatch):
    """The environment kinds' check: batch_size elements of the data's row size, with room for the
    networks' activations, against the free memory."""
    from _synthetic import synthetic_transitions

    import offline_plugins.plugins.datakind as datakind
    from offline_plugins.plugins import shared_registry

    data, _ = synthetic_transitions(40, obs_dim=3, action_dim=2, seed=0)
    kind = shared_registry().data_kind("transitions")
    layout = datakind.BatchLayout(10_000_000)
    monkeypatch.setattr(datakind, "available_memory_bytes", lambda device=None: 2**30)  # 1 GB free
    with pytest.raises(datakind.ScaleError, match=r"batch_size=10000000 \(10000000 elements of \d+ bytes per step\) "
                                                  r"needs about \d+\.\d GB, but 1\.1 GB of memory is free"):
        kind.check_scale(None, data, layout)
    kind.check_scale(None, data, datakind.BatchLayout(256))  # the default fits
    kind.check_scale(None, data, layout, accumulate=1000)  # split into micro-batches, it fits too
