"""The CLI contract for bad input, shared by the train-command tests, and the CLI run of the RL algorithms
that read a trained PRM."""

from __future__ import annotations

import json

from offline_plugins.cli import main


def fails_cleanly(capsys, tmp_path, *args, match: str) -> None:
    """``offline-plugins train ARGS`` prints one ``offline-plugins: error:`` line holding
    ``match``, exits 2 and creates no output folder."""
    out = tmp_path / "run"
    code = main(["train", *args, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("offline-plugins: error:") and match in err, err
    assert not out.exists()


def trains_with_a_prm(capsys, tmp_path, algorithm: str, prm, settings: list[str]) -> dict:
    """``offline-plugins train ALGORITHM --dataset steps-arithmetic --set prm=PRM SETTINGS`` trains 2 steps,
    logging the held-out gold (the outcome verifier) beside the PRM's own step reward, and a folder that holds
    no PRM fails cleanly; returns the run's summary."""
    out = tmp_path / algorithm
    assert main(["train", algorithm, "--dataset", "steps-arithmetic", "--steps", "2", "--seed", "0",
                 "--out", str(out), "--no-progress", "--set", f"prm={prm}", *settings]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "offline-plugins/steps-arithmetic/v0"
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"eval/heldout_reward", "rollout/prm_step_reward"} <= set(header)
    capsys.readouterr()
    fails_cleanly(capsys, tmp_path, algorithm, "--dataset", "steps-arithmetic", "--set", f"prm={tmp_path}", *settings,
                  match="is not a trained PRM")
    return summary
