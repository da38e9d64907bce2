"""The LLM contracts, on each built-in model: ``tiny`` (a character tokenizer and GPT-2), ``small`` (a
byte-level BPE tokenizer with a chat template and a Qwen2: rotary positions, grouped-query attention,
RMSNorm, tied embeddings) and ``small-pad-eos`` (the same with pad = eos, as a tokenizer without a pad
token is used).

Each contract is something a user's model relies on: log-probs equal a plain transformers forward on
every path (plain, chunked, shared prefix); the eos is scored and trained and the padding is not, also
where they are the same id; a multi-turn tool episode trains only the policy's tokens; LoRA's reference is
the base with adapters off; bf16 autocast keeps fp32 log-probs; the exported model is a plain
transformers folder whose greedy ``generate`` is ours token for token; and the LLM algorithms run end
to end on ``small`` (loss finite, parameters move, resume exact).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from offline_plugins.modules.causal_lm import AdaptersOff, CausalLMLogProbs, sequence_log_probs
from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.text.backends.generation import generate
from offline_plugins.tokens import encode_example, pad_rows, pad_token_id, prompt_token_ids

torch.set_num_threads(1)

MODELS = ["tiny", "small", "small-pad-eos"]
#: prompt/response rows: two groups sharing a prompt (a GRPO group, a DPO pair) and rows of other lengths
EXAMPLES = [("12+34=", "46"), ("12+34=", "47 or 48"), ("12+34=", "4"), ("7*8=", "56"), ("7*8=", "65"),
            ("rev(12*3)=", "63"), ("1+1=", "two\nlines")]


@pytest.fixture(scope="module", params=MODELS)
def lm(request):
    model, tok = load_causal_lm(request.param, seed=0)
    model.eval()
    return request.param, model, tok


def _batch(tok, examples=EXAMPLES, max_length=48):
    encoded = [encode_example(tok, p, r, max_length=max_length) for p, r in examples]
    width = max(len(ids) for ids, _ in encoded) + 3  # padding after every row
    return encoded, pad_rows(encoded, pad_token_id(tok), width)


def _plain_log_probs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for one unpadded row from a plain transformers forward; 0 at t = 0."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
    lp = logits[0, :-1].float().log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def test_the_rows_end_with_a_scored_eos_and_padding_that_is_not(lm):
    name, model, tok = lm
    encoded, rows = _batch(tok)
    pad, eos = pad_token_id(tok), tok.eos_token_id
    assert (pad == eos) == (name == "small-pad-eos")
    for i, (ids, n_prompt) in enumerate(encoded):
        n = len(ids)
        assert rows["tokens"][i, n - 1] == eos and rows["resp"][i, n - 1]  # the eos is a response token
        assert (rows["tokens"][i, n:] == pad).all() and not rows["attn"][i, n:].any() and not rows["resp"][i, n:].any()
        assert rows["resp"][i, n_prompt:n].all() and not rows["resp"][i, :n_prompt].any()
        # tiny's 95 characters have no newline (it becomes <unk>); the BPE tokenizer keeps every byte
        want = EXAMPLES[i][1].replace("\n", "") if name == "tiny" else EXAMPLES[i][1]
        assert tok.decode(ids[n_prompt:], skip_special_tokens=True) == want
    if tok.chat_template:  # the prompt is the template's user turn and the generation prompt
        assert tok.decode(encoded[0][0][:encoded[0][1]]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path", ["plain", "chunked", "shared-prefix"])
def test_log_probs_equal_a_plain_transformers_forward(lm, path):
    name, model, tok = lm
    encoded, rows = _batch(tok)
    kwargs = {"chunked": {"chunk_size": 5}, "shared-prefix": {"shared_prefix": True}}.get(path, {})
    module = CausalLMLogProbs(model, **kwargs)
    with torch.no_grad():
        lp = module.log_probs(rows["tokens"], rows["attn"], rows["resp"] if path == "shared-prefix" else None)
    for i, (ids, _) in enumerate(encoded):
        want = _plain_log_probs(model, ids)
        assert (lp[i, : len(ids)] - want).abs().max() < 2e-5, (name, path, i)
        assert lp[i, len(ids) - 1] < 0  # the eos is scored (a real log-prob, not the padding's 0)
        assert (lp[i, len(ids):] == 0).all()  # the padding is not, whatever its id


def test_the_eos_is_trained_and_the_padding_is_not(lm):
    """The gradient of a response's summed log-prob reaches the eos position's target and none of the padding."""
    name, model, tok = lm
    encoded, rows = _batch(tok, EXAMPLES[:3])
    module = CausalLMLogProbs(model)
    embed = model.get_input_embeddings().weight
    lp = module.log_probs(rows["tokens"], rows["attn"])
    seq, _ = sequence_log_probs(lp, rows["resp"])
    eos_term = lp[torch.arange(3), torch.tensor([len(ids) - 1 for ids, _ in encoded])]
    assert seq.shape == (3,) and torch.allclose(
        seq, torch.stack([lp[i, n_prompt:len(ids)].sum() for i, (ids, n_prompt) in enumerate(encoded)]))
    # d(eos term)/d(embedding of the eos id) is non-zero: the eos target is trained (tied output row)
    (g_eos,) = torch.autograd.grad(eos_term.sum(), embed, retain_graph=True)
    assert g_eos[tok.eos_token_id].abs().sum() > 0
    # changing the padding's ids changes nothing trained: same log-probs on the real tokens
    other = rows["tokens"].clone()
    other[~rows["attn"]] = 5
    with torch.no_grad():
        lp2 = module.log_probs(other, rows["attn"])
    assert torch.equal(lp2[rows["attn"]], lp.detach()[rows["attn"]])


class _Scripted:
    """A policy writing ``script(turn)`` (``"$"``: eos) in the model's tokenizer, log-prob -0.1 per token."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script

    def generate(self, prompt_ids, *, device, max_new_tokens, pad_id, eos_id, **_):
        from offline_plugins.text.backends.generation import Generation

        turn = getattr(self, "turn", 0)
        self.turn = turn + 1
        text = self.script(turn)
        row = (self.tok(text.replace("$", ""), add_special_tokens=False)["input_ids"] + [eos_id] * text.endswith("$"))
        row = row[:max_new_tokens]
        tokens = torch.tensor([row] * len(prompt_ids))
        lengths = torch.full((len(prompt_ids),), len(row))
        return Generation(tokens, torch.ones_like(tokens), tokens, lengths, torch.full(tokens.shape, -0.1))


def test_a_tool_episode_trains_the_policys_tokens_only(lm):
    from offline_plugins.text.collectors.multiturn import run_episodes
    from offline_plugins.text.tools.multiturn import MultiTurn
    from offline_plugins.text.tools.tools import Calculator, ToolBox

    name, model, tok = lm
    call = '<tool name="calculator">12*34</tool>'
    policy = _Scripted(tok, lambda turn: call if turn == 0 else "408$")
    prompt = prompt_token_ids(tok, "12*34=")
    ep = run_episodes(model, tok, [prompt], MultiTurn(ToolBox([Calculator()]), max_turns=3), width=96,
                      max_new_tokens=40, generator=policy)
    n = int(ep.attention_mask[0].sum())
    trained = tok.decode(ep.tokens[0, :n][ep.assistant_mask[0, :n]].tolist())
    untrained = tok.decode(ep.tokens[0, :n][~ep.assistant_mask[0, :n]].tolist())
    assert trained == call + "408" + tok.eos_token
    assert "<result>408</result>" in untrained and "12*34=" in untrained
    assert ep.answers == ["408"]
    assert (ep.log_probs[0][~ep.assistant_mask[0]] == 0).all()


def test_lora_reference_is_the_base_with_adapters_off(lm):
    from peft import LoraConfig, get_peft_model

    name, _, tok = lm
    model, _ = load_causal_lm(name, seed=0)
    encoded, rows = _batch(tok)
    with torch.no_grad():
        before = CausalLMLogProbs(model).log_probs(rows["tokens"], rows["attn"])
    targets = ["c_attn"] if name == "tiny" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    reference = AdaptersOff(policy)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = -(CausalLMLogProbs(policy).log_probs(rows["tokens"], rows["attn"]) * rows["resp"]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        ref = CausalLMLogProbs(reference).log_probs(rows["tokens"], rows["attn"])
        pol = CausalLMLogProbs(policy).log_probs(rows["tokens"], rows["attn"])
    assert (ref - before).abs().max() < 1e-5  # adapters off: the base model, untouched
    assert (pol - before)[rows["resp"]].abs().max() > 1e-2  # the adapters learnt
    assert pol[rows["resp"]].sum() > before[rows["resp"]].sum()


def test_bf16_autocast_keeps_fp32_log_probs_close_to_fp32(lm):
    name, model, tok = lm
    encoded, rows = _batch(tok)
    module = CausalLMLogProbs(model)
    with torch.no_grad():
        full = module.log_probs(rows["tokens"], rows["attn"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = module.log_probs(rows["tokens"], rows["attn"])
    assert half.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: the per-token gap measured 0.002-0.02 nats on these models
    assert (half - full)[rows["attn"]].abs().max() < 0.1
    assert (half[~rows["attn"]] == 0).all()


# -- through the training shell ----------------------------------------------------------------------------
def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digit_share(prompts, responses, **columns):
    """A dense reward a random policy already earns sometimes: the share of digits in the response."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("contracts")
    sums = [(a, b) for a in range(10) for b in range(10)]
    return {
        "sft": _write(root / "sft.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in sums * 2]),
        "pairs": _write(root / "pairs.jsonl", [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                                               for a, b in sums * 2]),
        "unpaired": _write(root / "unpaired.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b + (i % 2)),
                                                      "label": i % 2 == 0} for i, (a, b) in enumerate(sums * 2)]),
        "prompts": _write(root / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in sums * 2]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_sft_learns_to_stop_and_the_export_generates_in_plain_transformers_as_ours(name, files, tmp_path):
    """SFT on answers that end in eos, then ``OUT/model`` in plain transformers: its greedy ``generate`` of
    held-out prompts is ours token for token, and it stops (the eos was trained, also where pad = eos)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("sft", str(files["sft"]), model=name, steps=60, seed=0, out_dir=tmp_path / "sft",
                              progress=False, threads=1, eval_every=0, overrides={"batch_size": 32, "lr": 3e-3})
    folder = Path(summary["model_dir"])
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    plain_tok = AutoTokenizer.from_pretrained(folder)
    ours, ours_tok = load_causal_lm(folder)
    prompts = ["3+4=", "9+9=", "0+7=", "5+6="]
    stopped = 0
    for p in prompts:
        ids = prompt_token_ids(plain_tok, p)
        eos = plain_tok.eos_token_id
        with torch.no_grad():
            out = plain.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=6, eos_token_id=eos,
                                 pad_token_id=plain_tok.pad_token_id if plain_tok.pad_token_id is not None else eos)
        theirs = out[0, len(ids):].tolist()
        mine = generate(ours, [prompt_token_ids(ours_tok, p)], pad_id=pad_token_id(ours_tok), eos_id=eos,
                        max_new_tokens=6, greedy=True)
        mine = mine.tokens[0, : int(mine.lengths[0])].tolist()
        assert theirs[: len(mine)] == mine, (name, p)
        stopped += eos in mine
    assert stopped >= 3, f"{name}: the SFT model stopped on {stopped} of 4 prompts"


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


#: algorithm -> (data file, settings): a few steps each on ``small``
_E2E = {
    "sft": ("sft", {"batch_size": 8}),
    "dpo": ("pairs", {"batch_size": 8}),
    "kto": ("unpaired", {"batch_size": 8}),
    "grpo": ("prompts", {"group_size": 4, "prompts_per_round": 2, "batch_size": 4, "max_new_tokens": 4,
                         "eval_prompts": 4}),
    "rloo": ("prompts", {"group_size": 4, "prompts_per_round": 2, "batch_size": 4, "max_new_tokens": 4,
                         "eval_prompts": 4}),
    "ppo-rlhf": ("prompts", {"group_size": 2, "prompts_per_round": 4, "batch_size": 4, "max_new_tokens": 4,
                             "eval_prompts": 4}),
    "online-dpo": ("prompts", {"group_size": 2, "prompts_per_round": 4, "batch_size": 4, "max_new_tokens": 4,
                               "eval_prompts": 4}),
    "opd": ("prompts", {"group_size": 2, "prompts_per_round": 4, "batch_size": 4, "max_new_tokens": 4,
                        "eval_prompts": 4}),
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(_E2E))
def test_the_llm_algorithms_run_on_small_and_resume_exactly(algorithm, files, tmp_path):
    from offline_plugins.lightning.run import train_algorithm
    from offline_plugins.modules.small_lm import small_model_folder

    data, settings = _E2E[algorithm]
    settings = dict(settings)
    if algorithm == "opd":  # a teacher with the student's tokenizer: the small model of another seed
        settings["teacher"] = str(small_model_folder("small", seed=1))
    online = data == "prompts"
    kwargs = dict(model="small", seed=0, progress=False, threads=1, eval_every=0, overrides=settings,
                  reward="test_llm_contracts:digit_share" if online and algorithm != "opd" else None)
    full = train_algorithm(algorithm, str(files[data]), steps=4, out_dir=tmp_path / "full", **kwargs)
    assert all(math.isfinite(v) for v in full["losses"].values()), full["losses"]
    start, _ = load_causal_lm("small", seed=0)
    trained = _weights(Path(full["model_dir"]))
    moved = max((trained[k] - v).abs().max().item() for k, v in start.state_dict().items() if k in trained)
    assert moved > 1e-6, f"{algorithm}: the parameters did not move"
    train_algorithm(algorithm, str(files[data]), steps=2, out_dir=tmp_path / "part", **kwargs)
    resumed = train_algorithm(algorithm, str(files[data]), steps=4, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 4
    part = _weights(Path(resumed["model_dir"]))
    assert all(torch.equal(trained[k], part[k]) for k in trained), f"{algorithm}: resume is not exact"


@pytest.mark.slow
@pytest.mark.bwrap
def test_the_multi_turn_tool_task_runs_on_small(tmp_path, capsys):
    from offline_plugins.cli import main

    out = tmp_path / "tool"
    assert main(["train", "grpo", "--dataset", "tool-arithmetic", "--model", "small", "--steps", "2", "--seed", "0",
                 "--out", str(out), "--no-progress", "--threads", "1", "--set", "reference_sft_steps=4",
                 "--set", "group_size=2", "--set", "prompts_per_round=2", "--set", "max_new_tokens=24",
                 "--set", "eval_prompts=4", "--set", "batch_size=4"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert all(math.isfinite(v) for v in summary["losses"].values())
    assert json.loads((out / "model" / "config.json").read_text())["model_type"] == "qwen2"
    assert "Writing model shards" not in capsys.readouterr().err  # the cached reference is saved quietly
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"rollout/tool_calls", "rollout/turns"} <= set(header)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_on_small_ends_with_the_parameters_of_ddp(tmp_path, files):
    """FSDP2 on two CPU ranks shards the Qwen2 decoder layers and ends where DDP does (DPO, 3 steps)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _ranks import launch

    script = Path(__file__).parent / "_llm_fsdp_run.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "OFFLINE_PLUGINS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parent)}
    states = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        proc = launch([sys.executable, str(script), "dpo", str(files["pairs"]), str(out), "3", strategy,
                       "--model", "small"], env, 280)
        assert proc.returncode == 0, proc.stderr[-3000:]
        states[strategy] = torch.load(out / "final.pt", weights_only=False)
    assert (states["ddp"]["sharded"], states["fsdp"]["sharded"]) == (False, True)
    a, b = states["ddp"]["state"], states["fsdp"]["state"]
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-5
