"""``bwrap-logged``: a tool sandbox from a plugin: the built-in bwrap sandbox that also keeps a log of
every program the policy ran (one JSON line each: time, sha256, length, outcome, the first 200 characters).

The log goes to ``$OFFLINE_PLUGINS_AWR_TOOL_LOG`` (default ``tool-calls.jsonl`` in the working folder).
Chosen with ``--set tool_sandbox=bwrap-logged``; ``offline-plugins list`` shows it under "sandboxes".
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from offline_plugins.text.tools.sandbox import BwrapSandbox, Limits, SandboxRun

__all__ = ["LoggedBwrapSandbox"]


class LoggedBwrapSandbox(BwrapSandbox):
    """:class:`~offline_plugins.text.tools.sandbox.BwrapSandbox`, with each program and its outcome appended to a log."""

    name = "bwrap-logged"
    isolates = "as bwrap, and every program it ran is logged (OFFLINE_PLUGINS_AWR_TOOL_LOG)"

    def __init__(self, *, log: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.log = log or os.environ.get("OFFLINE_PLUGINS_AWR_TOOL_LOG", "tool-calls.jsonl")

    def run(self, program: str, limits: Limits) -> SandboxRun:
        run = super().run(program, limits)
        line = {"time": time.time(), "sha256": hashlib.sha256(program.encode("utf-8", "replace")).hexdigest(),
                "length": len(program), "returncode": run.returncode, "timed_out": run.timed_out,
                "start": program[:200]}
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return run
