"""``offline-plugins data list | make | info | audit | label``: dataset recipes, the local Minari store, preference
audits, AI-feedback labelling.

The library functions these call are in :mod:`offline_plugins.data` and :mod:`offline_plugins.audit`.

Cheap to import: Minari and torch are imported inside the command functions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from offline_plugins.data.files import atomic_write_text
from offline_plugins.data.store import dataset_size_bytes, local_dataset_ids, make_dataset, store_path
from offline_plugins.kinds.environment import dropped_text
from offline_plugins.text.data.preference_sources import BUILTIN_PREFERENCE_DATASETS
from offline_plugins.text.tasks.ids import text_tasks as registered_text_tasks

__all__ = ["add_parsers", "cmd_data_list", "cmd_data_make", "cmd_data_info", "cmd_data_audit", "cmd_data_label"]


from offline_plugins.cli.args import non_negative as _non_negative
from offline_plugins.cli.args import positive as _positive
from offline_plugins.cli.args import seed as _seed
from offline_plugins.cli.registry import registry_for as _registry


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _local_metadata(dataset_id: str) -> dict:
    path = store_path() / dataset_id / "data" / "metadata.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cmd_data_list(args) -> int:
    """Recipes (made or not) and every dataset in the local Minari store."""
    registry = _registry(args)
    local = set(local_dataset_ids())
    rows = []
    for spec in sorted(registry.datasets.values(), key=lambda s: s.id):
        made = spec.id in local
        meta = _local_metadata(spec.id) if made else {}
        rows.append(
            {
                "id": spec.id,
                "env_id": spec.env_id,
                "tier": spec.tier,
                "recipe": True,
                "local": made,
                "size_bytes": dataset_size_bytes(spec.id) if made else None,
                "episodes": meta.get("total_episodes"),
                "steps": meta.get("total_steps"),
                "requires": list(spec.requires),
                "provider": spec.provider,
            }
        )
    for dataset_id in sorted(local - set(registry.datasets)):
        meta = _local_metadata(dataset_id)
        env_id = None
        if meta.get("env_spec"):
            try:
                env_id = json.loads(meta["env_spec"]).get("id")
            except (TypeError, ValueError):
                env_id = None
        rows.append(
            {
                "id": dataset_id,
                "env_id": env_id,
                "tier": "",
                "recipe": False,
                "local": True,
                "size_bytes": dataset_size_bytes(dataset_id),
                "episodes": meta.get("total_episodes"),
                "steps": meta.get("total_steps"),
                "requires": [],
                "provider": "",
            }
        )

    preference = [{"id": k, "summary": v[0]} for k, v in BUILTIN_PREFERENCE_DATASETS.items()]
    text_tasks = [{"id": k, "summary": v.summary} for k, v in registered_text_tasks().items()]
    if args.json:
        print(json.dumps({"store": str(store_path()), "datasets": rows, "preference_datasets": preference,
                          "text_tasks": text_tasks}, indent=2))
        return 0
    _print_rows(rows)
    print("\npreference datasets (offline-plugins train dpo --dataset ID --model tiny|small|PATH):")
    for r in preference:
        print(f"  {r['id']}  {r['summary']}")
    print("  FILE.jsonl, hf:NAME[:SPLIT]  your prompt/chosen/rejected (or prompt/completion/label) rows")
    print("\ntext tasks for the online algorithms (offline-plugins train grpo --dataset ID):")
    for r in text_tasks:
        print(f"  {r['id']}  {r['summary']}")
    print("  FILE.jsonl  your prompt/answer rows (prompt rows with --reward module:function)")
    return 0


def _print_rows(rows: list) -> None:
    print(f"Minari store: {store_path()}")
    if not rows:
        print("no dataset recipes and no local datasets")
        return
    w = max(len(r["id"]) for r in rows)
    ew = max(len(r["env_id"] or "?") for r in rows)
    print(f"{'ID':<{w}}  {'ENV':<{ew}}  {'TIER':<13}  {'SIZE':>9}  {'EPISODES':>8}  {'STEPS':>8}  SOURCE")
    for r in rows:
        size = _human_size(r["size_bytes"]) if r["local"] else "-"
        source = "recipe" if r["recipe"] else "local"
        if r["recipe"] and not r["local"]:
            source += " (not made: offline-plugins data make ID)"
        if r["requires"]:
            source += f" [needs {','.join(r['requires'])}]"
        eps = "-" if r["episodes"] is None else str(r["episodes"])
        steps = "-" if r["steps"] is None else str(r["steps"])
        print(f"{r['id']:<{w}}  {r['env_id'] or '?':<{ew}}  {r['tier'] or '-':<13}  {size:>9}  {eps:>8}  {steps:>8}  {source}")


def cmd_data_make(args) -> int:
    """Make one recipe's dataset in the local store."""
    options = {}
    if args.steps is not None:
        options["steps"] = args.steps
    if args.episodes is not None:
        options["episodes"] = args.episodes
    if args.format is not None:
        options["data_format"] = args.format
    start = time.perf_counter()
    dataset = make_dataset(
        args.id, _registry(args), seed=args.seed, progress=not args.no_progress, force=args.force, **options
    )
    seconds = time.perf_counter() - start
    dataset_id = dataset.spec.dataset_id
    summary = {
        "id": dataset_id,
        "episodes": dataset.total_episodes,
        "steps": dataset.total_steps,
        "seconds": round(seconds, 2),
        "steps_per_second": round(dataset.total_steps / max(seconds, 1e-9), 1),
        "size_bytes": dataset_size_bytes(dataset_id),
        "path": dataset.spec.data_path,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"made {dataset_id}: {summary['episodes']} episodes, {summary['steps']} steps in {seconds:.1f} s "
            f"({summary['steps_per_second']:.0f} steps/s), {_human_size(summary['size_bytes'])} at {summary['path']}"
        )
    return 0


def cmd_data_info(args) -> int:
    """Episodes, steps, returns, reference scores and spaces of one local dataset."""
    from offline_plugins.data.offline import dataset_info

    info = dataset_info(args.id, _registry(args), drop_nonfinite=args.drop_nonfinite, drop_empty=args.drop_empty)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    ref = (
        f"{info['ref_min_score']:.1f} (random) .. {info['ref_max_score']:.1f} (expert)"
        if info["ref_min_score"] is not None and info["ref_max_score"] is not None
        else "none in the metadata"
    )
    norm = "-" if info["normalized_score_mean"] is None else f"{info['normalized_score_mean']:.1f}"
    print(f"{info['id']}")
    print(f"  env:               {info['env_id'] or 'none recorded'}")
    print(f"  episodes / steps:  {info['episodes']} / {info['steps']}")
    print(f"  return min/mean/max: {info['return_min']:.1f} / {info['return_mean']:.1f} / {info['return_max']:.1f}")
    print(f"  reference scores:  {ref}")
    print(f"  normalised score:  {norm} (mean over episodes, D4RL: 100 * (R - min) / (max - min))")
    print(f"  observation space: {info['observation_space']}")
    print(f"  action space:      {info['action_space']} ({info['action_kind']})")
    print(f"  storage:           {info['data_format']}, {_human_size(info['size_bytes'])}")
    if info["algorithm"]:
        print(f"  made by:           {info['algorithm']}")
    if args.drop_nonfinite or args.drop_empty:
        print(f"  dropped:           {dropped_text(info['dropped'])}")
    return 0


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _print_audit(r: dict) -> None:
    """The audit as a plain-text table (``--json`` prints the dict itself)."""
    ln = r["length"]
    print(f"{r['dataset']}: {r['rows']} pairs" + (f" ({r['notes']['rows']})" if r["notes"].get("rows") else ""))
    print(f"\nlength bias (length in {ln['unit']})")
    ci = ln["chosen_longer_untied_ci95"]
    print(f"  chosen is the longer one       {ln['chosen_longer']:.3f}  (rejected longer {ln['rejected_longer']:.3f}, "
          f"ties {ln['ties']:.3f}; untied {_fmt(ln['chosen_longer_untied'])}"
          + (f", 95% CI {ci[0]:.3f}..{ci[1]:.3f})" if ci else ")"))
    d = ln["difference"]
    print(f"  length chosen - rejected       mean {d['mean']:.1f}, median {d['median']:.1f}, p10..p90 "
          f"{d['p10']:.1f}..{d['p90']:.1f}, min..max {d['min']:.0f}..{d['max']:.0f}")
    print(f"  mean length chosen / rejected  {ln['chosen_mean']:.1f} / {ln['rejected_mean']:.1f}")
    print(f"  length-only classifier         {ln['length_only_accuracy']:.3f}  (rule: the {ln['length_only_rule']} "
          "response is chosen; 0.5 = no length bias)")
    st = r["style"]
    print(f"\nstyle bias (markdown outside code blocks; {st['pairs_with_style']} of {st['pairs']} pairs have any)")
    if not st["pairs_with_style"]:
        print("  no response has a heading, list item, bold span or code block")
    else:
        print(f"  {'FEATURE':<12}  MEAN CHOSEN/REJECTED  DIFFER  CHOSEN-MORE  95% CI")
        for name, f in [*st["features"].items(), ("all", st["combined"])]:
            ci = f["chosen_more_untied_ci95"]
            means = "" if name == "all" else f"{f['chosen_mean']:.2f} / {f['rejected_mean']:.2f}"
            print(f"  {name:<12}  {means:>20}  {f['pairs_differing']:>6}  {_fmt(f['chosen_more_untied']):>11}  "
                  + (f"{ci[0]:.3f}..{ci[1]:.3f}" if ci else "-"))
        print(f"  style-only classifier          {st['style_only_accuracy']:.3f}  (rule: the response with "
              f"{st['style_only_rule']} markdown is chosen; 0.5 = no style bias)")
    pos = r["position"]
    print("\nposition bias")
    if pos is None:
        print("  no row has shown_first")
    else:
        lo, hi = pos["first_preferred_ci95"]
        print(f"  first shown is chosen          {pos['first_preferred']:.3f}  ({pos['pairs']} pairs, 95% CI "
              f"{lo:.3f}..{hi:.3f}; 0.5 = no position bias)")
    ag, gold = r["agreement"], r["gold"]
    print("\nannotator agreement" + (" and accuracy on gold rows (whose chosen is the known answer)" if gold else ""))
    if gold is not None:
        print(f"  {gold['rows']} gold rows, {gold['annotated_rows']} with annotations; accuracy of all "
              f"{gold['labels']} labels on them {_fmt(gold['accuracy'])}")
    if ag is None:
        print("  no row has annotations")
    else:
        print(f"  {ag['pairs']} pairs, {ag['annotators']} annotators, {ag['labels']} labels "
              f"({ag['pairs_with_two_or_more']} pairs with two or more)")
        print(f"  observed agreement             {_fmt(ag['observed_agreement'])}")
        kappa = _fmt(ag["cohen_kappa"]) if ag["annotators"] == 2 else "- (needs exactly two annotators)"
        print(f"  Cohen's kappa                  {kappa}")
        print(f"  Krippendorff's alpha (nominal) {_fmt(ag['krippendorff_alpha'])}")
        w = max(len(a["annotator"]) for a in ag["per_annotator"])
        on_gold = {a["annotator"]: a for a in gold["per_annotator"]} if gold else {}
        print(f"  {'ANNOTATOR':<{max(w, 9)}}  LABELS  AGREES-WITH-OTHERS  AGREES-WITH-ROW-LABEL"
              + ("  GOLD-CORRECT  GOLD-ACCURACY (95% CI)" if on_gold else ""))
        for a in ag["per_annotator"]:
            g = on_gold.get(a["annotator"])
            print(f"  {a['annotator']:<{max(w, 9)}}  {a['labels']:>6}  {_fmt(a['agreement_with_others']):>18}  "
                  f"{a['agrees_with_row_label']:>21.3f}" + ("" if not on_gold else "  " + (
                      f"{g['correct']:>7}/{g['gold_labels']:<4}  {g['accuracy']:.3f} ({g['accuracy_ci95'][0]:.3f}.."
                      f"{g['accuracy_ci95'][1]:.3f})" if g else f"{'-':>12}  -")))
    jd = r.get("judge")
    if jd is not None:
        lo, hi = jd["position_consistency_ci95"]
        print(f"\njudge {jd['judge']} (each pair judged in both display orders; a verdict that flips is a tie)")
        print(f"  position consistency           {jd['position_consistency']:.3f}  ({jd['pairs']} pairs, 95% CI "
              f"{lo:.3f}..{hi:.3f}); ties {jd['ties']:.3f}")
        print(f"  agrees with the row label      {_fmt(jd['agrees_with_row_label'])}  (Cohen's kappa "
              f"{_fmt(jd['cohen_kappa_with_row_label'])})")
        for a in jd["per_annotator"]:
            print(f"  with annotator {a['annotator']:<15} agreement {_fmt(a['agreement'])}, Cohen's kappa "
                  f"{_fmt(a['cohen_kappa'])} ({a['pairs']} pairs)")
    cp = r["contradictory_pairs"]
    print(f"\ncontradictory pairs (labelled both ways): {cp['count']}")
    for c in cp["pairs"]:
        print(f"  rows {','.join(map(str, c['rows']))}: {c['votes_chosen']} for {c['chosen']!r}, "
              f"{c['votes_rejected']} for {c['rejected']!r} (prompt {c['prompt']!r})")
    iss = r["issues"]
    print(f"\nrow issues (context {iss['context_tokens']} tokens of {iss['tokenizer_of']})")
    for key, label in (("duplicate_rows", "duplicate rows"), ("chosen_equals_rejected", "chosen == rejected"),
                       ("empty_responses", "empty responses"), ("prompts_over_context", "prompts over the context")):
        rows = iss["examples"][key]
        print(f"  {label:<29}  {iss[key]}" + (f"  (rows {', '.join(map(str, rows))})" if rows else ""))
    if iss.get("loader_dropped"):
        print(f"  dropped by the loader before decoding: {iss['loader_dropped']}")
    m = r["model"]
    if m is None:
        print("\nmodel: none (--model OUT adds accuracy per length difference, score-length correlation and "
              "candidate label flips)")
        return
    print(f"\nmodel: {m['algorithm']} run {m['path']} (trained on {m['trained_on']}; score: {m['score']})")
    print(f"  pairs scored                   {m['pairs_scored']} ({m['pairs_skipped']} unusable)")
    if not m["pairs_scored"]:
        print(f"  {m.get('note', '')}")
        return
    print(f"  ranks the chosen first         {m['accuracy']:.3f}  ({m['ranked_against_label']} pairs against their label)")
    print(f"  score vs length                Pearson {_fmt(m['score_length_pearson'])}, Spearman "
          f"{_fmt(m['score_length_spearman'])}; margin vs length difference Spearman "
          f"{_fmt(m['margin_length_difference_spearman'])}")
    print(f"  accuracy per length difference d = chosen - rejected (t = median |d| = {m['length_buckets']['threshold']:g})")
    for b in m["length_buckets"]["buckets"]:
        ci = b["accuracy_ci95"]
        print(f"    {b['bucket']:<16} {b['pairs']:>6} pairs  accuracy {_fmt(b['accuracy'])}"
              + (f"  (95% CI {ci[0]:.3f}..{ci[1]:.3f})" if ci else ""))
    print(f"  candidate label flips (most confidently against the label): {len(m['candidate_flips'])}")
    for f in m["candidate_flips"]:
        p = "" if f["p_label"] is None else f", P(label) {f['p_label']:.3f}"
        print(f"    row {f['row']}: margin {f['margin']:.3f}{p}; chosen {f['chosen']!r}, rejected {f['rejected']!r}")


def _output_file(option: str, value: str, example: str):
    """``value`` as a path with ``example``'s suffix in a folder that exists, else an error naming ``option``."""
    from offline_plugins.audit import AuditError

    path, suffix = Path(value), Path(example).suffix
    if path.suffix.lower() != suffix:
        raise AuditError(f"{option} {value!r} should name a {suffix} file, e.g. {option} {example}")
    if not path.parent.is_dir():
        raise AuditError(f"{option} {value!r}: folder {str(path.parent)!r} does not exist; create it or pick another "
                         "path")
    return path


def _set_threads(args) -> None:
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def cmd_data_audit(args) -> int:
    """Length and position bias, annotator agreement, row issues and candidate label flips of a preference dataset."""
    from offline_plugins.audit import plot_audit

    if args.plot is not None:
        _output_file("--plot", args.plot, "audit.png")
    _set_threads(args)
    from offline_plugins.audit import audit_preference_data

    report = audit_preference_data(args.dataset, model=args.model, judge=args.judge, base_model=args.base_model,
                                   length_unit=args.length_unit, top=args.top, device=args.device,
                                   progress=not args.no_progress, registry=_registry(args) if args.model else None)
    if args.plot is not None:
        report["plot"] = str(plot_audit(report, args.plot))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_audit(report)
        if args.plot is not None:
            print(f"\nplot: {report['plot']}")
    return 0


def cmd_data_label(args) -> int:
    """Relabel preference pairs with a judge (AI feedback), both display orders, into a JSONL file."""
    from offline_plugins.audit import read_pairs
    from offline_plugins.eval.judge import judge_from, label_pairs

    out = _output_file("--out", args.out, "labelled.jsonl")
    _set_threads(args)
    principles = args.principles
    try:
        if principles and Path(principles).is_file():
            principles = Path(principles).read_text(encoding="utf-8")
    except OSError:  # text too long to be a file name: it is the principles themselves
        pass
    judge = judge_from(args.judge, device=args.device, margin=args.margin,
                       **({"principles": principles} if principles else {}))
    dataset_id, rows = read_pairs(args.dataset, progress=not args.no_progress)
    labelled, summary = label_pairs(judge, rows, ties=args.ties)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in labelled))
    summary.update(dataset=dataset_id, out=str(out))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{dataset_id}: {summary['pairs']} pairs judged by {summary['judge']} in both orders; "
              f"{summary['decided']} decided, {summary['ties']} ties ({args.ties}); position consistency "
              f"{_fmt(summary['position_consistency'])}, agrees with the file's labels "
              f"{_fmt(summary['agrees_with_input'])}; wrote {summary['rows_written']} rows to {out}")
    return 0


def add_parsers(subparsers) -> None:
    """Add ``data`` and its ``list``, ``make``, ``info`` and ``audit`` sub-commands."""
    p = subparsers.add_parser("data", help="dataset recipes and the local Minari store: list, make, info; "
                              "preference data: audit")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    sub.required = True

    q = sub.add_parser("list", help="recipes and local datasets, with size and tiers")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=cmd_data_list)

    q = sub.add_parser("make", help="make a recipe's dataset in the local Minari store")
    q.add_argument("id", help="recipe id, e.g. offline-plugins/pendulum/medium-v0 (or pendulum/medium-v0)")
    q.add_argument("--seed", type=_seed, default=0, help="seed of env resets and action noise (default 0)")
    q.add_argument(
        "--force", action="store_true", help="replace the dataset if it exists (the old one is kept until the new one is complete)"
    )
    q.add_argument("--steps", type=int, help="collect at least this many steps (default: the recipe's)")
    q.add_argument("--episodes", type=int, help="stop after this many episodes")
    q.add_argument("--format", choices=("hdf5", "arrow"), help="Minari storage format (default: Minari's)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.add_argument("--json", action="store_true", help="print a JSON summary")
    q.set_defaults(func=cmd_data_make)

    q = sub.add_parser("info", help="episodes, steps, returns, reference scores and spaces of a local dataset")
    q.add_argument("id", help="a local Minari dataset id")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.add_argument("--drop-nonfinite", action="store_true", help="skip episodes with NaN/inf values")
    q.add_argument("--drop-empty", action="store_true", help="skip zero-length episodes")
    q.set_defaults(func=cmd_data_info)

    q = sub.add_parser("audit", help="length, style and position bias, annotator agreement and gold accuracy, bad "
                       "rows and candidate label flips of a preference dataset")
    q.add_argument("dataset", metavar="DATASET",
                   help="a built-in preference dataset (arithmetic), a .jsonl file or hf:NAME[:SPLIT]")
    q.add_argument("--model", metavar="PATH", help="a reward-model or dpo-family run (OUT or its .ckpt): adds "
                   "score-length correlation and candidate label flips")
    q.add_argument("--base-model", default="tiny", metavar="NAME",
                   help="without --model: the model whose tokenizer counts tokens and context (default tiny)")
    q.add_argument("--length-unit", choices=("chars", "words", "tokens"), default="chars",
                   help="how response length is counted (default chars)")
    q.add_argument("--top", type=_non_negative, default=10, metavar="N",
                   help="candidate flips, contradictory pairs and example rows to list (default 10)")
    q.add_argument("--device", default="cpu", help="device that scores pairs with --model (default cpu)")
    q.add_argument("--threads", type=_positive, default=None, metavar="N", help="torch CPU threads")
    q.add_argument("--plot", metavar="FILE.png", help="write the length-difference histogram (and per-annotator "
                   "agreement) to this PNG")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.add_argument("--judge", metavar="MODEL", help="also judge every pair in both display orders with a rubric "
                   "judge (a save_pretrained folder, 'tiny', or MODULE:FUNCTION): its position consistency and "
                   "Cohen's kappa with the labels")
    q.add_argument("--json", action="store_true", help="print the audit as JSON")
    q.set_defaults(func=cmd_data_audit)

    q = sub.add_parser("label", help="relabel preference pairs with an AI judge (both display orders; a verdict "
                       "that flips with the order is a tie) into a JSONL file")
    q.add_argument("dataset", metavar="DATASET", help="pairs to judge: a .jsonl file, hf:NAME[:SPLIT] or a built-in")
    q.add_argument("--judge", required=True, metavar="MODEL",
                   help="a registered judge ('offline-plugins list': rubric, ...), a causal LM (save_pretrained "
                   "folder, hub id, 'tiny') scoring a rubric prompt, or MODULE:FUNCTION, a function f(prompt, first, "
                   "second) -> P(first is better)")
    q.add_argument("--out", required=True, metavar="FILE.jsonl", help="where the labelled pairs go")
    q.add_argument("--principles", metavar="TEXT|FILE", help="the rubric's principles (text or a file holding it)")
    q.add_argument("--ties", choices=("drop", "both"), default="drop",
                   help="ties left out (drop, default) or written both ways (both: the loss pulls them to no "
                   "preference)")
    q.add_argument("--margin", type=float, default=0.0, help="a probability within this of 1/2 is a tie (default 0)")
    q.add_argument("--device", default="cpu", help="device of the judge model (default cpu)")
    q.add_argument("--threads", type=_positive, default=None, metavar="N", help="torch CPU threads")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.set_defaults(func=cmd_data_label)
