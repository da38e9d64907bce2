"""The built-in tool sandboxes (``offline-plugins list``, "sandboxes"), named by import path so listing imports nothing.

``bwrap`` is the default of every tool that runs model-written code; ``unsafe-subprocess`` only
runs when chosen by name (``--set tool_sandbox=unsafe-subprocess``), with a warning each run.
"""

from __future__ import annotations

from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import SandboxSpec

SANDBOXES = (
    SandboxSpec("bwrap", "the default: bubblewrap namespaces (new user, PID, IPC, UTS, network: no network), read-only "
                "system and interpreter, private tmpfs, rlimits, the whole sandbox killed on timeout",
                "offline_plugins.text.tools.sandbox:BwrapSandbox"),
    SandboxSpec("unsafe-subprocess", "NOT isolation: a plain subprocess with rlimits and an audit hook; code can write "
                "where the trainer can, signal it and read its /proc (explicit opt-in, warned each run)",
                "offline_plugins.text.tools.sandbox:UnsafeSubprocessSandbox"),
)


@hookimpl
def offline_plugins_register_sandboxes(registry):
    for spec in SANDBOXES:
        registry.add(spec)
