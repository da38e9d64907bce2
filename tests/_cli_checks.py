"""The CLI contract for bad input, shared by the train-command tests."""

from __future__ import annotations

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
