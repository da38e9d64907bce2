"""Try the CLI's language-model surface with bad inputs, as a hostile-but-honest new user would, and
count what happens (reliability pass 2).

Each case runs ``offline-plugins ...`` in a subprocess with a time limit and is classified:

* ``clean``: exit 2 (or 130 for an interruption) with exactly one ``offline-plugins:`` line on stderr;
* ``ok``: exit 0, for the cases that must work (a long completion is truncated and said);
* ``internal``: exit 1 with ``internal error`` (a bug: want 0);
* ``hang``: killed at the time limit (want 0);
* ``noisy``: a refusal with more than one line on stderr;
* ``silent``: exit 0 where a refusal or a warning was expected;
* ``crash``: any other exit (a signal, a segfault).

Cases that could run code from a file check a marker file (``code_ran``, want 0); cases that could
destroy a user's file check it is still there (``lost``, want 0).

    python scripts/hostile_inputs.py --out runs/hostile [--only NAME]

The table goes to stdout and ``OUT/hostile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


@dataclass
class Case:
    name: str
    args: list
    expect: str = "clean"  # or "ok"
    says: str = ""  # a phrase the one line must hold
    marker: Optional[Path] = None  # must not exist afterwards (code ran)
    keep: list = field(default_factory=list)  # files that must still exist afterwards
    env: dict = field(default_factory=dict)
    limit: float = 180.0
    before: Optional[Callable[[], None]] = None
    signal_after: Optional[Path] = None  # send SIGTERM once this file exists
    fsize: Optional[int] = None  # a file-size limit (ulimit -f) in bytes: a full disk for this process


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fixtures(root: Path) -> dict:
    """The files the cases read: good ones, and damaged copies."""
    import torch

    from offline_plugins.modules.causal_lm import CausalLMReward
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.sources.reward_source import save_reward_model

    root.mkdir(parents=True, exist_ok=True)
    f: dict = {}
    f["pairs"] = _jsonl(root / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)}
                                               for i in range(300)])
    f["prompts"] = _jsonl(root / "prompts.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)])
    f["plain_prompts"] = _jsonl(root / "plain.jsonl", [{"prompt": f"{i}+1="} for i in range(200)])
    f["completions"] = _jsonl(root / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(300)])
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(300)]
    rows[5]["completion"] = "9" * 400
    f["long_completion"] = _jsonl(root / "long.jsonl", rows)
    for name, tail in {"not_utf8": b'{"prompt": "\xff"}\n', "deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
                       "not_json": b"{prompt: 1}\n", "array_row": b"[1, 2]\n"}.items():
        for kind in ("pairs", "prompts", "completions"):
            p = root / f"{kind}_{name}.jsonl"
            p.write_bytes(f[kind].read_bytes() + tail)
            f[f"{kind}_{name}"] = p
    (root / "empty.jsonl").write_text("")
    f["empty"] = root / "empty.jsonl"
    f["missing_field"] = _jsonl(root / "missing.jsonl", [{"prompt": "1+1=", "chosen": "2"}] * 20)
    f["wrong_type"] = _jsonl(root / "wrongtype.jsonl", [{"prompt": "1+1=", "chosen": 2, "rejected": "3"}] * 20)

    model, tok = load_causal_lm("tiny", seed=0)
    good = root / "model"
    model.save_pretrained(good)
    tok.save_pretrained(good)
    f["model"] = good

    def damaged(name, fn, source=good, kind="model"):
        """A copy of the good ``source`` folder, damaged by ``fn``, as ``f["KIND_NAME"]``."""
        d = root / f"{kind}_{name}"
        shutil.copytree(source, d)
        fn(d)
        f[f"{kind}_{name}"] = d

    def config(d, **kw):
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, **kw}))

    damaged("noconfig", lambda d: (d / "config.json").unlink())
    damaged("notok", lambda d: [p.unlink() for p in d.iterdir() if p.name.startswith("tokenizer")])
    damaged("arch", lambda d: config(d, model_type="no-such-architecture"))
    damaged("vocab", lambda d: config(d, vocab_size=5))
    damaged("badjson", lambda d: (d / "config.json").write_text("{not json"))
    damaged("truncated", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64))
    damaged("noweights", lambda d: (d / "model.safetensors").unlink())
    big_tok = root / "model_bigtok"
    shutil.copytree(good, big_tok)
    tok2 = load_causal_lm("tiny", seed=0)[1]
    tok2.add_tokens(["<a>", "<b>"])
    tok2.save_pretrained(big_tok)
    f["model_bigtok"] = big_tok
    (root / "model_file").write_text("not a folder")
    f["model_file"] = root / "model_file"

    rm = save_reward_model(CausalLMReward(model), tok, root / "rm" / "reward_model")
    f["rm"] = rm

    def rm_damaged(name, fn):
        damaged(name, fn, source=rm, kind="rm")

    marker = root / "CODE_RAN"
    f["marker"] = marker

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    rm_damaged("nohead", lambda d: (d / "reward_head.pt").unlink())
    rm_damaged("junkhead", lambda d: (d / "reward_head.pt").write_bytes(b"\x00" * 10))
    rm_damaged("pickle", lambda d: torch.save({"weight": Payload()}, d / "reward_head.pt"))
    rm_damaged("shape", lambda d: torch.save({"weight": torch.zeros(1, 7), "bias": torch.zeros(1)},
                                             d / "reward_head.pt"))
    rm_damaged("meta", lambda d: (d / "reward_model.json").write_text("{oops"))
    rm_damaged("heads", lambda d: (d / "reward_model.json").write_text('{"heads": -1}'))
    rm_damaged("noconfig", lambda d: (d / "config.json").unlink())

    rewards = root / "hostile_rewards.py"
    rewards.write_text(
        "import os, sys, time\n"
        "def raises(p, r, **k):\n    raise RuntimeError('boom')\n"
        "def exits(p, r, **k):\n    sys.exit(0)\n"
        "def hangs(p, r, **k):\n"
        "    if os.environ.get('HOSTILE_CALLED'):\n        open(os.environ['HOSTILE_CALLED'], 'w').close()\n"
        "    time.sleep(3600)\n"
        "def nan(p, r, **k):\n    return [float('nan')] * len(r)\n"
        "def short(p, r, **k):\n    return [0.0]\n"
        "def strings(p, r, **k):\n    return ['1'] * len(r)\n"
        "def none(p, r, **k):\n    return None\n"
        "def some_fail(p, r, **k):\n"
        "    if len(r) > 1:\n        raise ValueError('one at a time')\n"
        "    return [float(len(r[0]))]\n")
    f["rewards_dir"] = root

    laughs = root / "laughs.yaml"
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    laughs.write_text("\n".join(lines) + "\n")
    f["laughs"] = laughs
    (root / "list.yaml").write_text("- 1\n- 2\n")
    f["list_yaml"] = root / "list.yaml"
    (root / "bad.yaml").write_text("a: [1, 2\n")
    f["bad_yaml"] = root / "bad.yaml"
    torch.save({"state_dict": {"w": Payload()}}, root / "pickle.ckpt")
    f["pickle_ckpt"] = root / "pickle.ckpt"
    (root / "junk.ckpt").write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    f["junk_ckpt"] = root / "junk.ckpt"
    return f


def cases(f: dict, work: Path) -> list[Case]:
    run = lambda name: str(work / "runs" / name)  # noqa: E731
    small = ["--steps", "2", "--no-progress", "--threads", "1"]
    online = ["--set", "group_size=2", "--set", "prompts_per_round=2", "--set", "batch_size=4", "--set",
              "max_new_tokens=2", "--set", "eval_prompts=4"]
    out: list[Case] = []
    # --model folders that cannot load, through three commands
    for algo, data in (("sft", "arithmetic"), ("dpo", str(f["pairs"])), ("grpo", str(f["prompts"]))):
        for m, says in (("noconfig", "has no config.json"), ("notok", "has no tokenizer files"),
                        ("arch", "does not recognize this architecture"), ("vocab", "a weight's shape differs"),
                        ("badjson", "not a valid JSON file"), ("truncated", "SafetensorError"),
                        ("noweights", "no file named"), ("bigtok", "embedding has 99 rows"),
                        ("file", "is a file")):
            out.append(Case(f"{algo} --model {m}", ["train", algo, "--dataset", data, "--model", str(f[f"model_{m}"]),
                                                    "--out", run(f"{algo}-model-{m}"), *small], says=says))
    out.append(Case("dpo --model a hub id offline", ["train", "dpo", "--dataset", str(f["pairs"]), "--model",
                                                      "no-such-user/no-such-model", "--out", run("hub"), *small],
                    says="cannot load model", env={"HF_HUB_OFFLINE": "1"}))
    # reward-model folders
    for r, says in (("nohead", "has no reward_head.pt"), ("junkhead", "could not be read as tensors"),
                    ("pickle", "nothing in it ran"), ("shape", "weight has shape (1, 7)"),
                    ("meta", "is not a JSON object"), ("heads", "heads (a whole number >= 1)"),
                    ("noconfig", "has no config.json")):
        out.append(Case(f"grpo --reward {r}", ["train", "grpo", "--dataset", str(f["plain_prompts"]), "--reward",
                                               str(f[f"rm_{r}"]), "--out", run(f"rm-{r}"), *online, *small], says=says,
                        marker=f["marker"] if r == "pickle" else None,
                        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"} if r == "pickle" else {}))
    # JSONL files
    for kind, algo in (("pairs", "dpo"), ("prompts", "grpo"), ("completions", "sft")):
        for bad, says in (("not_utf8", "is not UTF-8 text"), ("deep", "nests JSON too deeply"),
                          ("not_json", "is not valid JSON"), ("array_row", "")):
            extra = online if algo == "grpo" else []
            out.append(Case(f"{algo} {bad}.jsonl", ["train", algo, "--dataset", str(f[f"{kind}_{bad}"]),
                                                    "--out", run(f"{algo}-{bad}"), *extra, *small], says=says))
    for algo in ("dpo", "grpo", "sft", "kto"):
        out.append(Case(f"{algo} empty.jsonl", ["train", algo, "--dataset", str(f["empty"]), "--out",
                                                run(f"{algo}-empty"), *small]))
    out.append(Case("dpo missing field", ["train", "dpo", "--dataset", str(f["missing_field"]), "--out", run("mf"), *small],
                    says="lacks field"))
    out.append(Case("dpo wrong type", ["train", "dpo", "--dataset", str(f["wrong_type"]), "--out", run("wt"), *small],
                    says="expected a string"))
    out.append(Case("dpo missing file", ["train", "dpo", "--dataset", str(work / "nope.jsonl"), "--out", run("nf"),
                                         *small], says="does not exist"))
    # settings
    for key, value, says in (("beta", "-5", "must be > 0"), ("beta", "nan", "expects float"), ("lora_r", "-1", "must be >= 0"),
                             ("lora_alpha", "0", "must be > 0"), ("lr", "0", "must be > 0"),
                             ("label_smoothing", "0.7", "must be in [0, 0.5)"), ("batch_size", "0", "must be >= 1"),
                             ("batch_size", "100000", "is larger than the"), ("logprob_chunk", "-3", "must be >= 0"),
                             ("max_grad_norm", "-1", "must be >= 0"), ("lr", "abc", "lr must be a positive number"),
                             ("no_such_key", "1", "unknown config key")):
        out.append(Case(f"dpo --set {key}={value}", ["train", "dpo", "--dataset", str(f["pairs"]), "--set",
                                                     f"{key}={value}", "--out", run(f"set-{key}-{value}"), *small],
                        says=says))
    for key, value, says in (("group_size", "1", "group_size must be a whole number >= 2"),
                             ("max_new_tokens", "100000", "exceeds the model's context"),
                             ("prompts_per_round", "1000000", "a round of"), ("temperature", "0", "must be > 0"),
                             ("top_p", "2", "must be in (0, 1]"), ("batch_size", "7", "must divide"),
                             ("reward_timeout", "-1", "must be >= 0"), ("ppo_epochs", "0", "must be >= 1")):
        extra = ["--set", "group_size=64"] if key == "prompts_per_round" else []
        out.append(Case(f"grpo --set {key}={value}", ["train", "grpo", "--dataset", str(f["prompts"]), *online, *extra,
                                                      "--set", f"{key}={value}", "--out", run(f"g-{key}"), *small],
                        says=says))
    # config files
    for name, says in (("laughs", ""), ("list_yaml", "must hold a mapping"), ("bad_yaml", "not valid YAML")):
        out.append(Case(f"dpo --config {name}", ["train", "dpo", "--dataset", str(f["pairs"]), "--config", str(f[name]),
                                                 "--out", run(f"cfg-{name}"), *small], says=says, limit=60))
    # reward functions
    env = {"PYTHONPATH": str(f["rewards_dir"])}
    for fn, says in (("raises", "raised RuntimeError"), ("exits", "called sys.exit(0)"),
                     ("hangs", "ran past its time limit"), ("nan", "finite"), ("short", "returned 1 rewards"),
                     ("strings", "return floats"), ("none", "expected a list")):
        out.append(Case(f"grpo --reward {fn}", ["train", "grpo", "--dataset", str(f["plain_prompts"]), "--reward",
                                                f"hostile_rewards:{fn}", "--set", "reward_timeout=1", *online,
                                                "--out", run(f"rf-{fn}"), *small], says=says, env=env))
    out.append(Case("grpo --reward some_fail (works one at a time)",
                    ["train", "grpo", "--dataset", str(f["plain_prompts"]), "--reward", "hostile_rewards:some_fail",
                     *online, "--out", run("rf-some"), *small], expect="ok", env=env))
    called = work / "called"
    out.append(Case("grpo --reward hangs, no limit, one SIGTERM",
                    ["train", "grpo", "--dataset", str(f["plain_prompts"]), "--reward", "hostile_rewards:hangs",
                     "--set", "reward_timeout=0", *online, "--out", run("rf-sigterm"), *small],
                    says="interrupted while reward function", env={**env, "HOSTILE_CALLED": str(called)},
                    signal_after=called))
    # sizes and the context
    out.append(Case("sft completion longer than the context", ["train", "sft", "--dataset", str(f["long_completion"]),
                                                               "--out", run("long"), *small], expect="ok"))
    # --overwrite and the run's own input
    model_in_out = work / "runs" / "own" / "model"

    def own_model():
        if not model_in_out.exists():
            shutil.copytree(f["model"], model_in_out)
            (model_in_out.parent / "summary.json").write_text("{}")

    out.append(Case("--overwrite with --model inside --out", ["train", "dpo", "--dataset", str(f["pairs"]), "--model",
                                                              str(model_in_out), "--out", str(model_in_out.parent),
                                                              "--overwrite", *small],
                    before=own_model, keep=[model_in_out / "config.json"], says="--overwrite"))
    # unknown names, machine limits
    out.append(Case("unknown algorithm", ["train", "dpoo", "--dataset", str(f["pairs"]), *small], says="dpo"))
    out.append(Case("--devices 99", ["train", "dpo", "--dataset", str(f["pairs"]), "--devices", "99", "--out",
                                     run("dev"), *small], says="--devices"))
    out.append(Case("--out is a file", ["train", "dpo", "--dataset", str(f["pairs"]), "--out", str(f["model_file"]),
                                        *small]))
    out.append(Case("eval of a missing checkpoint", ["eval", str(work / "none.ckpt")], says="does not exist"))
    out.append(Case("eval of a checkpoint carrying code", ["eval", str(f["pickle_ckpt"])], says="nothing in it ran",
                    marker=f["marker"], env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}))
    out.append(Case("eval of a truncated checkpoint", ["eval", str(f["junk_ckpt"])], says="could not be read"))
    # a full disk (a file-size limit): a dataset build, then a run that cannot write its checkpoint
    store = {"MINARI_DATASETS_PATH": str(work / "store"), "OFFLINE_PLUGINS_OFFLINE": "1"}
    out.append(Case("data make on a full disk", ["data", "make", "pendulum/medium-v0", "--steps", "2000",
                                                 "--no-progress"], env=store, fsize=50_000, says="nothing was written"))
    def make_store():  # the dataset itself, made without the limit
        subprocess.run([sys.executable, "-m", "offline_plugins.cli", "data", "make", "pendulum/medium-v0", "--steps",
                        "2000", "--no-progress"], env={**os.environ, **store}, capture_output=True, timeout=600)

    out.append(Case("train on a full disk", ["train", "iql", "--dataset", "pendulum/medium-v0", "--steps", "4",
                                             "--out", run("full"), "--no-progress", "--threads", "1"],
                    env=store, fsize=20_000, says="could not write", before=make_store))
    return out


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def classify(case: Case, code: Optional[int], err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("offline-plugins:")]
    if code is None:
        return "hang"
    if code == 1 and any("internal error" in line for line in lines):
        return "internal"
    if case.expect == "ok":
        return "ok" if code == 0 else ("clean" if code == 2 else "crash")
    if code == 0:
        return "silent"
    if code in (2, 130):
        if len(ours) != 1 or len(lines) != 1:
            return "noisy"
        return "clean" if case.says in ours[0] else "wrong-line"
    return "crash"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/hostile")
    ap.add_argument("--only", default=None, help="run the cases whose name holds this text")
    args = ap.parse_args()
    work = Path(args.out).resolve()
    shutil.rmtree(work, ignore_errors=True)
    f = fixtures(work / "files")
    todo = [c for c in cases(f, work) if args.only is None or args.only in c.name]
    results = []
    for case in todo:
        if case.before:
            case.before()
        env = {**os.environ, "OMP_NUM_THREADS": "1", **case.env}
        if "PYTHONPATH" in case.env:
            env["PYTHONPATH"] = os.pathsep.join([case.env["PYTHONPATH"], os.environ.get("PYTHONPATH", "")])
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "offline_plugins.cli", *case.args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                                preexec_fn=_file_size_limit(case.fsize) if case.fsize else None)
        if case.signal_after is not None:
            while proc.poll() is None and time.monotonic() - started < case.limit and not case.signal_after.exists():
                time.sleep(0.1)
            time.sleep(0.5)
            if proc.poll() is None:
                proc.terminate()
        try:
            _, err = proc.communicate(timeout=max(1.0, case.limit - (time.monotonic() - started)))
            code: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            code = None
        verdict = classify(case, code, err)
        ran = bool(case.marker and case.marker.exists())
        lost = [str(p) for p in case.keep if not p.exists()]
        last = next((line for line in reversed(err.strip().splitlines()) if line.strip()), "")
        results.append({"case": case.name, "exit": code, "verdict": verdict, "code_ran": ran, "lost": lost,
                        "seconds": round(time.monotonic() - started, 1), "line": last[:300]})
        print(f"{verdict:10s} {str(code):>4s} {results[-1]['seconds']:6.1f}s  {case.name}: {last[:160]}", flush=True)
    counts: dict = {}
    for r in results:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    summary = {"cases": len(results), "verdicts": counts, "code_ran": sum(r["code_ran"] for r in results),
               "lost": sum(bool(r["lost"]) for r in results), "results": results}
    (work / "hostile.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))


if __name__ == "__main__":
    main()
