"""``offline-plugins data list | make | info``: dataset recipes and the local Minari store.

Cheap to import: Minari and torch are imported inside the command functions.
"""

from __future__ import annotations

import json

__all__ = ["add_parsers", "cmd_data_list", "cmd_data_make", "cmd_data_info"]


def _registry(args):
    from offline_plugins.plugins import load_registry

    disable = [n.strip() for n in (getattr(args, "disable", "") or "").split(",") if n.strip()]
    return load_registry(disable)


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _local_metadata(dataset_id: str) -> dict:
    from offline_plugins.data.store import store_path

    path = store_path() / dataset_id / "data" / "metadata.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cmd_data_list(args) -> int:
    """Recipes (made or not) and every dataset in the local Minari store."""
    from offline_plugins.data.store import dataset_size_bytes, local_dataset_ids, store_path

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
    from offline_plugins.data.preference_sources import BUILTIN_PREFERENCE_DATASETS

    preference = [{"id": k, "summary": v[0]} for k, v in BUILTIN_PREFERENCE_DATASETS.items()]
    if args.json:
        print(json.dumps({"store": str(store_path()), "datasets": rows, "preference_datasets": preference}, indent=2))
        return 0
    _print_rows(rows)
    print("\npreference datasets (offline-plugins train dpo --dataset ID --model tiny|PATH):")
    for r in preference:
        print(f"  {r['id']}  {r['summary']}")
    print("  FILE.jsonl, hf:NAME[:SPLIT]  your prompt/chosen/rejected (or prompt/completion/label) rows")
    return 0


def _print_rows(rows: list) -> None:
    from offline_plugins.data.store import store_path

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
    import time

    from offline_plugins.data.store import dataset_size_bytes, make_dataset

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


def dataset_info(dataset_id: str, registry=None, *, drop_nonfinite: bool = False, drop_empty: bool = False) -> dict:
    """What ``data info`` prints, as a dict (the dataset must be local)."""
    from offline_plugins.data.offline import load_offline_data
    from offline_plugins.data.store import dataset_size_bytes, open_minari_dataset

    data = load_offline_data(
        dataset_id,
        make_if_missing=False,
        drop_nonfinite=drop_nonfinite,
        drop_empty_episodes=drop_empty,
        progress=False,
        registry=registry,
    )
    minari_dataset = open_minari_dataset(data.dataset_id)
    returns = data.episode_returns
    info = {
        "id": data.dataset_id,
        "env_id": data.env_id,
        "episodes": data.num_episodes,
        "steps": len(data),
        "return_min": float(returns.min()),
        "return_mean": float(returns.mean()),
        "return_max": float(returns.max()),
        "ref_min_score": data.ref_min_score,
        "ref_max_score": data.ref_max_score,
        "normalized_score_mean": (
            float(data.normalized_score(returns).mean()) if data.ref_min_score is not None and data.ref_max_score is not None else None
        ),
        "observation_space": str(minari_dataset.observation_space),
        "action_space": str(minari_dataset.action_space),
        "action_kind": data.action_space,
        "data_format": minari_dataset.storage.metadata.get("data_format", "hdf5"),
        "size_bytes": dataset_size_bytes(data.dataset_id),
        "algorithm": minari_dataset.storage.metadata.get("algorithm_name"),
        "dropped": dict(data.dropped),
    }
    return info


def _dropped_text(dropped: dict) -> str:
    """``3 episodes (412 steps) with NaN/inf values, 1 zero-length episode``, or ``nothing``."""
    parts = []
    if dropped.get("nonfinite_episodes"):
        parts.append(f"{dropped['nonfinite_episodes']} episode(s) ({dropped['nonfinite_steps']} non-finite step(s)) "
                     "with NaN/inf values")
    if dropped.get("empty_episodes"):
        parts.append(f"{dropped['empty_episodes']} zero-length episode(s)")
    return ", ".join(parts) or "nothing"


def cmd_data_info(args) -> int:
    """Episodes, steps, returns, reference scores and spaces of one local dataset."""
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
        print(f"  dropped:           {_dropped_text(info['dropped'])}")
    return 0


def add_parsers(subparsers) -> None:
    """Add ``data`` and its ``list``, ``make`` and ``info`` sub-commands."""
    p = subparsers.add_parser("data", help="dataset recipes and the local Minari store: list, make, info")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    sub.required = True

    q = sub.add_parser("list", help="recipes and local datasets, with size and tiers")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=cmd_data_list)

    q = sub.add_parser("make", help="make a recipe's dataset in the local Minari store")
    q.add_argument("id", help="recipe id, e.g. offline-plugins/pendulum/medium-v0 (or pendulum/medium-v0)")
    q.add_argument("--seed", type=int, default=0, help="seed of env resets and action noise (default 0)")
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
