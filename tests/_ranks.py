"""Multi-process runs from the tests: each in its own process group, ended whole afterwards."""

from __future__ import annotations

import os
import signal
import subprocess


def launch(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a script whose Lightning launcher starts more ranks) in its own process group and
    kill the group when it returns or times out: a launched rank must not outlive a failed or
    timed-out rank 0, or it waits on gloo for Lightning's 30-minute timeout."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
