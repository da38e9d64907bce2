"""``scripts/tables.py``: every table of docs/results.md made by one command. The ``--smoke`` run of each
table trains every run it needs at a tiny budget and writes the table (its pipeline runs; its
figures mean nothing), and ``write`` refuses runs made at another commit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tables.py"


def _tables(*args: str, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def _tables_module():
    """``scripts/tables.py`` imported as a module."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import tables
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return tables


def _names() -> list[str]:
    listed = subprocess.run([sys.executable, str(SCRIPT), "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


#: each table's base table (the one whose runs it reads), from scripts/tables.py
TABLES_BASE = {name: table.base for name, table in _tables_module().TABLES.items()}


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tables")


@pytest.mark.slow
@pytest.mark.timeout(1200)
# the text tables on one worker (variants-2026 reads word-problems' runs; pytest -n with --dist loadgroup), a
# table with no base (ogbench) on a worker of its own, beside them
@pytest.mark.parametrize("table", [pytest.param(name, marks=pytest.mark.xdist_group(
    "tables-" + (TABLES_BASE.get(name) or name))) for name in _names()])
def test_each_table_runs_and_writes_at_a_smoke_budget(table, smoke_root):
    # one root and cache for the tables, as a user making them all has: a table that reads another's runs
    # (variants-2026 reads word-problems' grpo and dapo) reuses them, and the SFT references are made once
    env = {"OFFLINE_PLUGINS_CACHE": str(smoke_root / "cache"), "MINARI_DATASETS_PATH": str(smoke_root / "minari")}
    done = _tables("run", table, "--smoke", "--root", str(smoke_root), "--seeds", "0", env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    done = _tables("write", table, "--smoke", "--root", str(smoke_root), env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    text = (smoke_root / table / "results.md").read_text()
    assert text.startswith(f"<!-- table:{table} -->") and text.rstrip().endswith(f"<!-- /table:{table} -->")
    stamp = next(line for line in text.splitlines() if line.startswith("Made by"))
    in_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SCRIPT.parent, capture_output=True).returncode == 0
    assert f"python scripts/tables.py run {table} --smoke" in stamp
    assert re.search(r"at commit [0-9a-f]{7,}" if in_git else r"at commit unknown \(not a git checkout\)", stamp), stamp
    assert "cores" in stamp and "seeds 0" in stamp
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert rows and not any("not run" in row for row in rows), text
    prov = json.loads((smoke_root / table / "provenance.json").read_text())
    assert prov["seeds"] == [0] and prov["budget"].get("online_steps", prov["budget"].get("offline_steps")) == 2


def test_write_refuses_runs_made_at_another_commit(tmp_path):
    folder = tmp_path / "word-problems"
    folder.mkdir()
    (folder / "provenance.json").write_text(json.dumps({"commit": "0000000", "dirty": False, "machine": "m",
                                                        "command": "c", "budget": {}, "seeds": [0], "date": "d"}))
    done = _tables("write", "word-problems", "--root", str(tmp_path), "--doc", str(tmp_path / "r.md"), "--records", "",
                   env={})
    assert done.returncode != 0 and "were made at 0000000" in done.stderr and "run --overwrite" in done.stderr
    assert not (tmp_path / "r.md").exists()


def test_write_replaces_only_its_own_block(tmp_path, monkeypatch):
    tables = _tables_module()
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nbefore\n\n<!-- table:word-problems -->\nold\n<!-- /table:word-problems -->\n\nafter\n")
    folder = tmp_path / "word-problems"
    folder.mkdir()
    monkeypatch.setattr(tables, "_git", lambda *a: "abc1234")
    (folder / "provenance.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "machine": "m",
                                                        "command": "python scripts/tables.py run word-problems",
                                                        "budget": {"eval_prompts": 10}, "seeds": [0], "date": "d"}))
    args = type("A", (), {"table": "word-problems", "root": str(tmp_path), "doc": str(doc), "stale": False,
                          "smoke": False})
    tables.write(args)
    text = doc.read_text()
    assert text.startswith("# Results\n\nbefore\n\n<!-- table:word-problems -->") and text.endswith("\n\nafter\n")
    assert "old" not in text and "| grpo | not run |" in text and "at commit abc1234" in text


def test_a_table_of_runs_made_at_two_commits_says_so_and_needs_stale(tmp_path, monkeypatch):
    """A run re-made at a later commit (``made_at.json``) beside runs made at the table's first one: ``write``
    refuses without ``--stale``, and with it the stamp counts the runs of each commit."""
    tables = _tables_module()
    folder = tmp_path / "word-problems"
    for name, made in (("grpo", None), ("dapo", None), ("expert-iteration", "def5678")):
        out = folder / name / "s0"
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"wall_s": 1.0}))
        if made:
            (out / "made_at.json").write_text(json.dumps({"commit": made, "dirty": False, "date": "d"}))
    (folder / "provenance.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "machine": "m",
                                                        "command": "c", "budget": {"eval_prompts": 10}, "seeds": [0],
                                                        "date": "d"}))
    assert tables.run_commits(tables.TABLES["word-problems"], folder, [0], "abc1234") == {"abc1234": 2, "def5678": 1}
    monkeypatch.setattr(tables, "_git", lambda *a: "def5678")
    doc = tmp_path / "results.md"
    args = type("A", (), {"table": "word-problems", "root": str(tmp_path), "doc": str(doc), "stale": False,
                          "smoke": False})
    with pytest.raises(SystemExit, match=r"were made at abc1234 \(2 runs\), the code is at def5678"):
        tables.write(args)
    args.stale = True
    tables.write(args)
    assert "at commits abc1234 (2 runs), def5678 (1 runs)" in doc.read_text()


def test_a_run_at_a_new_commit_keeps_the_commit_of_the_runs_made_before(tmp_path, monkeypatch):
    tables = _tables_module()
    folder = tmp_path / "word-problems"
    (folder / "grpo" / "s0").mkdir(parents=True)
    (folder / "grpo" / "s0" / "summary.json").write_text("{}")
    (folder / "provenance.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "date": "d"}))
    tables._keep_run_commits(tables.TABLES["word-problems"], folder, {"commit": "def5678"})
    assert json.loads((folder / "grpo" / "s0" / "made_at.json").read_text())["commit"] == "abc1234"
    assert tables.run_commits(tables.TABLES["word-problems"], folder, [0], "def5678") == {"abc1234": 1}


def test_a_finished_run_is_recorded_and_a_new_root_keeps_it_instead_of_training_again(tmp_path, monkeypatch):
    """The records (committed under results/tables/) carry a run's small files to a machine that never trained
    it: ``run`` restores them and keeps the run, ``write`` renders the same table from them alone."""
    tables = _tables_module()
    monkeypatch.setattr(tables, "_git", lambda *a: "abc1234")
    first, records = tmp_path / "first" / "word-problems", tmp_path / "records"
    out = first / "grpo" / "s0"
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.bin").write_bytes(b"big")
    (out / "summary.json").write_text(json.dumps({"wall_s": 12.0}))
    (out / "heldout_scores.json").write_text(json.dumps({"n": 4, "model": "m", "scores": [1.0, 0.0, 1.0, 1.0]}))
    (out / "made_at.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "date": "d"}))
    (first / "reference").mkdir()
    (first / "reference" / "heldout_scores.json").write_text(json.dumps({"n": 4, "model": "r",
                                                                        "scores": [0.0, 0.0, 1.0, 1.0]}))
    (first / "provenance.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "machine": "m",
                                                      "command": "c", "budget": {"eval_prompts": 4}, "seeds": [0],
                                                      "date": "d"}))
    for folder in (out, first / "reference", first):
        tables.save_record(records, first.parent, folder)
    assert (records / "word-problems" / "grpo" / "s0" / "heldout_scores.json").is_file()
    assert not (records / "word-problems" / "grpo" / "s0" / "model").exists()  # models stay in the root

    second = tmp_path / "second"
    assert tables.restore_records(records, second) == 5
    (second / "word-problems" / "grpo" / "s0" / "summary.json").write_text(json.dumps({"wall_s": 99.0}))
    assert tables.restore_records(records, second) == 0  # what the root has wins
    trained = []
    monkeypatch.setattr(tables.subprocess, "call", lambda *a, **k: trained.append(a) or 0)
    args = type("A", (), {"overwrite": False, "smoke": False, "timeout": 1})
    tables._train(args, tables.TABLES["word-problems"].runs[0], 0, {}, second / "word-problems" / "grpo")
    assert trained == []  # kept, not trained again

    doc = tmp_path / "results.md"
    args = type("A", (), {"table": "word-problems", "root": str(tmp_path / "third"), "doc": str(doc), "stale": False,
                          "smoke": False, "records": str(records)})
    tables.write(args)
    text = doc.read_text()
    assert "| SFT reference | 50.0" in text and "| grpo | 75.0 |" in text and "12 s |" in text, text


def test_a_run_locked_by_another_process_is_skipped_not_trained_twice(tmp_path, monkeypatch):
    tables = _tables_module()
    folder = tmp_path / "word-problems" / "grpo"
    with tables._run_lock(folder, 0) as held:
        assert held
        other = subprocess.run([sys.executable, "-c", (
            "import sys; sys.path.insert(0, sys.argv[1]); import tables; from pathlib import Path\n"
            "with tables._run_lock(Path(sys.argv[2]), 0) as held: print(held)\n"
            "with tables._run_lock(Path(sys.argv[2]), 1) as held: print(held)"),
            str(Path(tables.__file__).parent), str(folder)], capture_output=True, text=True, timeout=60)
        assert other.stdout.split() == ["False", "True"], other.stderr
    with tables._run_lock(folder, 0) as held:  # released with its holder
        assert held


def _git_repo(tmp_path: Path):
    """A throw-away git repository with a ``src/`` and its ``git(*args)``."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    return repo, git


def _grpo_run_made_at(root: Path, commit: str) -> Path:
    """A finished grpo seed-0 run of word-problems under ``root`` made at ``commit``; the table's folder."""
    folder = root / "word-problems"
    (folder / "grpo" / "s0").mkdir(parents=True)
    (folder / "grpo" / "s0" / "summary.json").write_text("{}")
    (folder / "grpo" / "s0" / "made_at.json").write_text(json.dumps({"commit": commit, "dirty": False, "date": "d"}))
    (folder / "provenance.json").write_text(json.dumps({"commit": commit, "dirty": False, "machine": "m", "command": "c",
                                                        "budget": {"eval_prompts": 4}, "seeds": [0], "date": "d"}))
    return folder


def test_runs_made_at_a_commit_with_the_same_package_code_stand_for_the_current_one(tmp_path, monkeypatch):
    """``write`` takes runs made at an older commit without ``--stale`` when only tests, docs or scripts changed
    since (``git diff`` of src/, pyproject.toml and constraints.txt empty), and its stamp says so; a change under
    src/ makes it refuse again."""
    tables = _tables_module()
    repo, git = _git_repo(tmp_path)
    (repo / "src" / "code.py").write_text("x = 1\n")
    git("add", "-A"), git("commit", "-qm", "code")
    made = git("rev-parse", "--short", "HEAD")
    (repo / "docs.md").write_text("words\n")
    git("add", "-A"), git("commit", "-qm", "docs")
    monkeypatch.setattr(tables, "REPO", repo)
    monkeypatch.setattr(tables, "_git", lambda *a: git("rev-parse", "--short", "HEAD"))
    folder = _grpo_run_made_at(tmp_path / "root", made)
    doc = tmp_path / "results.md"
    args = type("A", (), {"table": "word-problems", "root": str(folder.parent), "doc": str(doc), "stale": False,
                          "smoke": False, "records": ""})
    tables.write(args)
    assert f"the package's code and pins of {git('rev-parse', '--short', 'HEAD')}" in doc.read_text()
    (repo / "src" / "code.py").write_text("x = 2\n")
    git("add", "-A"), git("commit", "-qm", "code again")
    with pytest.raises(SystemExit, match=f"were made at {made}"):
        tables.write(args)


def test_the_reference_the_runs_start_from_travels_with_the_records(tmp_path, monkeypatch):
    tables = _tables_module()
    records, made = tmp_path / "records", tmp_path / "made" / "sft-task-s0-rabc"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")
    (made / "model.safetensors").write_bytes(b"weights")
    tables.save_reference(records, made)
    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    assert tables.restore_references(records) == ["sft-task-s0-rabc"]
    restored = tmp_path / "cache" / "preference" / "sft-task-s0-rabc"
    assert (restored / "model.safetensors").read_bytes() == b"weights"
    assert tables.restore_references(records) == []  # the cache's own is kept
    assert tables.restore_references(None) == [] and not list((tmp_path / "cache" / "preference").glob("*.restoring"))


def test_a_run_stopped_part_way_is_resumed_not_kept(tmp_path, monkeypatch):
    """A run stopped by a signal writes a summary too (``"interrupted": true``): the table resumes it from its
    checkpoint, records nothing and counts it nowhere."""
    tables = _tables_module()
    out = tmp_path / "word-problems" / "grpo" / "s0"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    (out / "summary.json").write_text(json.dumps({"steps": 28, "steps_requested": 200, "interrupted": True}))
    assert not tables.finished(out)
    calls = []
    monkeypatch.setattr(tables.subprocess, "call", lambda argv, **k: calls.append(argv) or 0)
    monkeypatch.setattr(tables, "_git", lambda *a: "abc1234")
    args = type("A", (), {"overwrite": False, "smoke": False, "timeout": 1})
    tables._train(args, tables.TABLES["word-problems"].runs[0], 0, {"online_steps": 200, "run_eval_prompts": 4,
                                                                    "reference_sft_steps": 2}, out.parent)
    assert len(calls) == 1 and "--resume" in calls[0]
    assert tables.run_commits(tables.TABLES["word-problems"], tmp_path / "word-problems", [0], "abc1234") == {}
    (out / "summary.json").write_text(json.dumps({"steps": 200, "steps_requested": 200}))
    assert tables.finished(out)


def test_two_smoke_roots_compare_by_their_results_not_their_timings_or_paths(tmp_path):
    """``same-results`` compares what holds a result: weights byte for byte; summaries, metrics and held-out
    scores without seconds, rates, memory or the folder they were made in; a file one root lacks is a
    difference."""
    tables = _tables_module()
    roots = []
    for name, wall, place in (("a", 12.5, "/x/a"), ("b", 99.0, "/y/b")):
        root = tmp_path / name
        run = root / "word-problems" / "grpo" / "s0"
        (run / "model").mkdir(parents=True)
        (run / "model" / "model.safetensors").write_bytes(b"weights")
        (run / "summary.json").write_text(json.dumps({"losses": {"loss": 0.25}, "wall_s": wall, "tokens_per_s": wall,
                                                      "peak_memory_mb": wall, "model_dir": f"{root}/grpo/model"}))
        (run / "metrics.csv").write_text(f"eval/exact_match,step,train/steps_per_s\n0.5,1,{wall}\n")
        (run / "heldout_scores.json").write_text(json.dumps({"model": f"{place}/src", "scores": [1.0, 0.0]}))
        roots.append((root, Path(place)))
    assert tables.compare_roots(*roots) == (4, [])
    summary = roots[1][0] / "word-problems" / "grpo" / "s0" / "summary.json"
    summary.write_text(summary.read_text().replace("0.25", "0.2500001"))
    (roots[1][0] / "word-problems" / "grpo" / "s0" / "model" / "model.safetensors").write_bytes(b"weightz")
    (roots[0][0] / "word-problems" / "kto" / "s0").mkdir(parents=True)
    (roots[0][0] / "word-problems" / "kto" / "s0" / "metrics.csv").write_text("step\n1\n")
    count, diffs = tables.compare_roots(*roots)
    assert count == 4 and diffs == [f"word-problems/kto/s0/metrics.csv: only under {roots[0][0]}",
                                    "word-problems/grpo/s0/model/model.safetensors: differs",
                                    "word-problems/grpo/s0/summary.json: differs"]


def test_runs_whose_results_a_recorded_check_found_equal_stand_for_the_current_code(tmp_path, monkeypatch):
    """Runs made at A, the code changed at B, the docs at C (HEAD): ``write`` refuses A's runs until a
    ``same-results`` pair (A, B) of this table is recorded, then takes them and says by which check; a pair
    recorded for another table does not count."""
    tables = _tables_module()
    repo, git = _git_repo(tmp_path)
    commits = []
    for path, text in (("src/code.py", "x = 1\n"), ("src/code.py", "x = 1  # faster\n"), ("docs.md", "words\n")):
        (repo / path).write_text(text)
        git("add", "-A"), git("commit", "-qm", text)
        commits.append(git("rev-parse", "HEAD"))
    monkeypatch.setattr(tables, "REPO", repo)
    monkeypatch.setattr(tables, "_git", lambda *a: git(*a) if a[0] != "rev-parse" or "--short" not in a
                        else git("rev-parse", "--short", "HEAD"))
    made = commits[0][:7]
    folder = _grpo_run_made_at(tmp_path / "root", made)
    records = tmp_path / "records"
    records.mkdir()
    doc = tmp_path / "results.md"
    args = type("A", (), {"table": "word-problems", "root": str(folder.parent), "doc": str(doc), "stale": False,
                          "smoke": False, "records": str(records)})
    with pytest.raises(SystemExit, match=f"were made at {made}"):
        tables.write(args)
    pair = {"a": commits[0], "b": commits[1], "files": 40, "date": "2026-12-06", "machine": "m",
            "command": f"python scripts/tables.py same-results word-problems {made} {commits[1][:7]}"}
    (records / tables.SAME_RESULTS).write_text(json.dumps([{**pair, "table": "variants-2026"}]))
    with pytest.raises(SystemExit, match=f"were made at {made}"):
        tables.write(args)
    (records / tables.SAME_RESULTS).write_text(json.dumps([{**pair, "table": "word-problems"}]))
    tables.write(args)
    assert (f"{made}: its results equal {commits[2][:7]}'s at the smoke budget" in doc.read_text()
            and pair["command"] in doc.read_text())


def test_status_says_which_runs_are_done_being_made_stopped_or_left(tmp_path, monkeypatch, capsys):
    tables = _tables_module()
    root = tmp_path / "word-problems"
    done, making, stopped = root / "grpo" / "s0", root / "dapo" / "s0", root / "rloo" / "s0"
    for out in (done, making, stopped):
        out.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"steps": 200, "steps_requested": 200, "wall_s": 600.0}))
    (done / "heldout_scores.json").write_text(json.dumps({"scores": [1.0, 0.0, 0.0, 1.0]}))
    (making / "metrics.csv").write_text("rollout/reward_mean,step\n0.3,0\n0.4,40\n")
    (stopped / "checkpoints").mkdir()
    (stopped / "checkpoints" / "last.ckpt").write_bytes(b"")
    (stopped / "metrics.csv").write_text("step\n96\n")
    args = type("A", (), {"table": "word-problems", "root": str(tmp_path), "seeds": [0], "records": ""})
    with tables._run_lock(root / "dapo", 0) as held:  # this process makes dapo s0 now
        assert held
        tables.status(args)
    out = capsys.readouterr().out
    assert re.search(r"^grpo +s0 50\.0 % in 600 s$", out, re.M), out
    assert re.search(r"^dapo +s0 being made \(step 40 of 200\)$", out, re.M), out
    assert re.search(r"^rloo +s0 stopped \(step 96 of 200; resumes\)$", out, re.M), out
    assert re.search(r"^gspo +s0 to do$", out, re.M), out
    left = len(tables.TABLES["word-problems"].runs) - 1
    assert f"{left} runs left, about {left * 600 / 3600:.1f} core-hours" in out


def test_a_failing_run_does_not_stop_the_others_and_is_named_at_the_end(tmp_path, monkeypatch):
    tables = _tables_module()
    monkeypatch.setattr(tables, "reference_folder", lambda dataset, budget: tmp_path / "ref")
    monkeypatch.setattr(tables, "_scored", lambda *a, **k: [1.0])
    made = []

    def train(args, run_, seed, budget, folder):
        made.append(run_.name)
        if run_.name == "dapo":
            sys.exit(f"{folder}/s{seed}: exit 1")
        (folder / f"s{seed}").mkdir(parents=True, exist_ok=True)
        (folder / f"s{seed}" / "summary.json").write_text(json.dumps({"steps": 2, "steps_requested": 2}))

    monkeypatch.setattr(tables, "_train", train)
    args = type("A", (), {"table": "word-problems", "root": str(tmp_path), "smoke": False, "records": "", "seeds": [0],
                          "overwrite": False, "timeout": 1})
    with pytest.raises(SystemExit, match=r"1 of the table's runs failed .*word-problems/dapo/s0; .* again makes them"):
        tables.run(args)
    assert made == [r.name for r in tables.TABLES["word-problems"].runs]  # every run after dapo was made too


def test_the_table_says_which_methods_differ_from_grpo_past_the_interval_over_seeds(tmp_path):
    """The word-problems table's second block: a method whose three seeds all score 10 points over GRPO's is
    marked significant (Welch's interval over seeds excludes 0), one level with GRPO within seed noise is not,
    and a method with one seed is not tested."""
    tables = _tables_module()
    table = tables.TABLES["word-problems"]
    folder = tmp_path / "word-problems"
    n = 200

    def scored(name, seed, share):
        out = folder / name / f"s{seed}"
        out.mkdir(parents=True)
        right = round(share * n)
        (out / "heldout_scores.json").write_text(json.dumps({"scores": [1.0] * right + [0.0] * (n - right)}))
        (out / "summary.json").write_text(json.dumps({"wall_s": 10.0}))

    for seed, (g, d, r) in enumerate([(0.40, 0.50, 0.41), (0.42, 0.52, 0.39), (0.41, 0.51, 0.42)]):
        scored("grpo", seed, g)
        scored("dapo", seed, d)
        scored("rloo", seed, r)
    scored("gspo", 0, 0.60)
    text = table.render(table, folder, [0, 1, 2], {**table.budget, "eval_prompts": n})
    block = text[text.index("Each method against grpo"):]
    rows = {line.split(" | ")[0][2:]: line for line in block.splitlines()
            if line.startswith("| ") and "minus" not in line}
    assert rows["dapo"].startswith("| dapo | +10.0 ± ") and " * |" in rows["dapo"]
    assert rows["rloo"].startswith("| rloo | -0.3 ± ") and " *" not in rows["rloo"]
    assert rows["gspo"].startswith("| gspo | +19.0 |") and rows["gspo"].endswith("| 1, 3 |")
    assert "Significant at 95 % over seeds: dapo." in block


def test_a_run_stopped_and_resumed_counts_its_whole_steps_at_its_last_stretchs_pace(tmp_path):
    """A resumed run's summary times only its last stretch (100 of 200 steps in 400 s): the table's wall time
    is that pace over all 200 steps, not the stretch."""
    tables = _tables_module()
    table = tables.TABLES["word-problems"]
    out = tmp_path / "word-problems" / "grpo" / "s0"
    out.mkdir(parents=True)
    (out / "heldout_scores.json").write_text(json.dumps({"scores": [1.0, 0.0]}))
    (out / "summary.json").write_text(json.dumps({"wall_s": 400.0, "steps": 200, "steps_per_s": 0.25,
                                                  "resumed_from": str(out / "checkpoints" / "last.ckpt")}))
    text = table.render(table, tmp_path / "word-problems", [0], {**table.budget, "eval_prompts": 2})
    row = next(line for line in text.splitlines() if line.startswith("| grpo |"))
    assert row.endswith("| 800 s |"), row
