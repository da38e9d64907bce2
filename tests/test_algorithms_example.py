"""examples/compose_in_torchrl.py stays runnable: our BCQ and AWAC losses in a plain TorchRL loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compose_in_torchrl.py"


def test_compose_in_torchrl_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "5"], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "RL_WARNINGS": "False"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("BCQ", "AWAC"))]
    assert len(lines) == 2 and "loss_qvalue=" in lines[0] and "advantage_weight_mean=" in lines[1]
