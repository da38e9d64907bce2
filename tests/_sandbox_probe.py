"""A stand-in trainer for the sandbox tests: it holds a secret in memory and in its environment,
keeps a log file open, runs one program through the Python tool in the named sandbox, and prints
what it saw as JSON. Standard library only, so it also runs from the system interpreter as an
unprivileged user. Usage: probe.py SANDBOX TIMEOUT < spec.json (spec: the program's template and
the paths and ports it may use)."""

import ctypes
import json
import os
import resource
import sys
import time

from offline_plugins.text.tools.sandbox import BwrapSandbox, UnsafeSubprocessSandbox
from offline_plugins.text.tools.tools import PythonTool

SECRET = b"the-trainer-secret-0123456789"


def main() -> None:
    name, timeout = sys.argv[1], float(sys.argv[2])
    spec = json.loads(sys.stdin.read())
    secret = bytearray(SECRET)
    address = ctypes.addressof((ctypes.c_char * len(secret)).from_buffer(secret))
    log = open(spec["log"], "a")  # the trainer's open log
    sandbox = BwrapSandbox() if name == "bwrap" else UnsafeSubprocessSandbox(warn=False)
    tool = PythonTool(timeout=timeout, sandbox=sandbox)
    tool.check()
    program = spec["program"].format(pid=os.getpid(), addr=address, logfd=log.fileno(), **spec["values"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = tool.run(program)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"ok": result.ok, "failure": result.failure, "text": result.text[:5000], "seconds": seconds,
                      "secret_intact": bytes(secret) == SECRET, "rss_growth_kb": after - before,
                      "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
