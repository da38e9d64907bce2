"""On-policy distillation on the built-in task: a 2x128 tiny teacher into a 2x64 student, against SFT
on the teacher's samples, several seeds.

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/distill_results.py run \\
        --root runs/results-distill --steps 1000 --eval-every 0 --seeds 0 1 2
    python scripts/distill_results.py table --root runs/results-distill

``run`` makes, once (kept when present; ``--set KEY=VALUE`` goes to the compared runs only):

* ``ROOT/teacher``: ``offline-plugins train sft --dataset arithmetic --model tiny`` (the tiny
  2-layer, 128-wide GPT-2, ~0.4M parameters), 2000 steps;
* ``ROOT/student-init``: a 2-layer, 64-wide GPT-2 (~0.1M parameters) at its random init, the
  same character tokenizer, written with ``save_pretrained``; then ``ROOT/student``: ``sft`` of it
  for 500 steps on the task's answers (a weak start that samples the format);
* ``ROOT/teacher_samples.jsonl``: the teacher's sampled responses (temperature 1, as the
  distillation rounds sample the student) to ``--steps * 32`` train-split prompts: the
  responses the SFT baseline trains on, as many as the distillation runs sample.

then, per seed, ``opd`` and ``gkd`` (``--set teacher=ROOT/teacher/model``, 32 fresh samples per
step) and ``sft`` on the teacher's samples (32 rows per step), each ``--steps`` steps at the
same learning rate (1e-3) from ``ROOT/student``. ``table`` scores every exported model the same way
(greedy exact match on the task's 200 held-out test prompts, and the full-vocabulary reverse KL
to the teacher per response token on the student's greedy responses to them) and prints the
docs/results-history.md table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt as _fmt, results_main, run_logged  # noqa: E402

METHODS = ("opd", "gkd", "sft-teacher-samples")
ROWS_PER_STEP = 32
#: the teacher's and the student start's sft steps, and the compared runs' learning rate
TEACHER_STEPS, STUDENT_STEPS, LR = 2000, 500, 1e-3


def _cli(args, cmd: list[str], out: Path) -> None:
    if (out / "summary.json").is_file() and not args.overwrite:
        print(f"{out}: done, kept", flush=True)
        return
    run_logged(["offline-plugins", "train", *cmd, "--threads", "1", "--no-progress", "--out", str(out), "--overwrite"],
               args.timeout)


def _student_init(path: Path) -> None:
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    if (path / "config.json").is_file():
        return
    tok = char_tokenizer()
    tiny_causal_lm(tok, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, seed=0).save_pretrained(path)
    tok.save_pretrained(path)


def _teacher_samples(root: Path, n: int) -> Path:
    import torch

    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.backends.generation import generate_texts as generate
    from offline_plugins.text.data.rollouts import _task_of
    from offline_plugins.text.data.task_data import sft_rows

    path = root / "teacher_samples.jsonl"
    if path.is_file() and sum(1 for _ in path.open()) == n:
        return path
    torch.set_num_threads(1)
    _, task = _task_of("arithmetic", "")
    model, tok = load_causal_lm(root / "teacher" / "model")
    prompts = [r["prompt"] for r in sft_rows(task, n, seed=7)]
    with torch.no_grad():
        texts = generate(model, tok, prompts, max_new_tokens=6, temperature=1.0, seed=0, batch_size=256)
    path.write_text("".join(json.dumps({"prompt": p, "completion": t[0].strip()}) + "\n" for p, t in zip(prompts, texts)))
    return path


def run(args) -> None:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    _cli(args, ["sft", "--dataset", "arithmetic", "--model", "tiny", "--steps", str(TEACHER_STEPS),
                "--eval-every", "0"], root / "teacher")
    _student_init(root / "student-init")
    _cli(args, ["sft", "--dataset", "arithmetic", "--model", str(root / "student-init"), "--steps",
                str(STUDENT_STEPS), "--eval-every", "0", "--set", "lr=3e-3"], root / "student")
    samples = _teacher_samples(root, args.steps * ROWS_PER_STEP)
    student, teacher = str(root / "student" / "model"), str(root / "teacher" / "model")
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--set", f"lr={LR}",
              *(x for kv in args.set or [] for x in ("--set", kv))]
    for seed in args.seeds:
        for method in args.methods:
            out = root / method / f"s{seed}"
            if method == "sft-teacher-samples":
                cmd = ["sft", "--dataset", str(samples), "--set", f"batch_size={ROWS_PER_STEP}"]
            else:
                cmd = [method, "--dataset", "arithmetic", "--set", f"teacher={teacher}"]
            _cli(args, [*cmd, "--model", student, "--seed", str(seed), *common], out)


def _scores(data, teacher, folder: Path) -> tuple[float, float]:
    """Greedy exact match on the held-out prompts, and the reverse KL to the teacher per response token."""
    import torch
    from tensordict import TensorDict

    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm.distill import OnPolicyDistillationLoss
    from offline_plugins.tokens import prompt_token_ids

    model, tok = load_causal_lm(folder)
    rows = data.source.held_out
    responses, em = data.greedy_answers(model, tok, rows, "answer", max_new_tokens=data.settings.max_new_tokens)
    seqs, masks = [], []
    for r, resp in zip(rows, responses):
        p = prompt_token_ids(tok, r["prompt"])
        y = tok(resp, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + y)
        masks.append([False] * len(p) + [True] * len(y))
    width = max(map(len, seqs))
    tokens = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    td = TensorDict({"tokens": {"full": tokens},
                     "masks": {"all_attention_mask": tokens != tok.pad_token_id,
                               "all_assistant_mask": torch.tensor([m + [False] * (width - len(m)) for m in masks])}},
                    [len(seqs)])
    with torch.no_grad():
        kl = OnPolicyDistillationLoss(CausalLMLogProbs(model), teacher)(td)["kl_to_teacher"]
    return em, float(kl)


def table(args) -> None:
    import torch

    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.rollouts import load_rollout_data

    torch.set_num_threads(1)
    root = Path(args.root)
    data = load_rollout_data("arithmetic", model=str(root / "student" / "model"))
    teacher, _ = load_causal_lm(root / "teacher" / "model")
    print("| model | held-out exact match | per seed | reverse KL to the teacher per response token | steps "
          "| responses trained on | wall time per run |")
    print("|---|---|---|---|---|---|---|")
    for name, folder in (("teacher (2x128, sft)", root / "teacher"), ("student start (2x64, sft)", root / "student")):
        em, kl = _scores(data, teacher, folder / "model")
        print(f"| {name} | {100 * em:.1f} | | {kl:.3f} | {json.loads((folder / 'summary.json').read_text())['steps']} "
              "| | |")
    for method in METHODS:
        runs = sorted((root / method).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        scored = [_scores(data, teacher, p.parent / "model") for p in runs]
        ems, kls = [e for e, _ in scored], [k for _, k in scored]
        print(f"| {method} | {_fmt(ems)} | {', '.join(f'{100 * e:.1f}' for e in ems)} | {_fmt(kls, 1, 3)} "
              f"| {s[0]['steps']} | {s[0]['steps'] * ROWS_PER_STEP} | {statistics.mean(r['wall_s'] for r in s):.0f} s |")
    print(f"\nseeds: {len(runs)}")


def main() -> None:
    results_main(__doc__, "runs/results-distill", run, table, pick=("--methods", METHODS))


if __name__ == "__main__":
    main()
