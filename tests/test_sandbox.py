"""The Python tool's sandbox against hostile code (issue 38): one attack per class, each effect checked
from outside the tool's process.

A stand-in trainer (``tests/_sandbox_probe.py``: a secret in its memory and environment, an open log)
runs each program through the tool; the test then looks at what only the outside can see: a marker
folder outside the sandbox, listeners on 127.0.0.1, whether the trainer is alive and its secret
unchanged, its peak memory, and the processes left on the machine. Under ``bwrap`` every check must
pass, with the trainer as root and as an unprivileged uid (``setpriv``); the ``unsafe-subprocess``
sandbox must fail the memory-write and parent-kill checks, which shows the checks can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pluggy
import pytest

from offline_plugins.text.tools.sandbox import (
    BwrapSandbox,
    Limits,
    SandboxUnavailable,
    UnsafeSandboxWarning,
    run_bounded,
)
from offline_plugins.text.tools.tools import Calculator, PythonTool, ToolBox

PROBE = Path(__file__).with_name("_sandbox_probe.py")
SRC = Path(__file__).resolve().parents[1] / "src"
NOBODY = 65534
SECRET_ENV = "OFFLINE_PLUGINS_TEST_SECRET"
SECRET_VALUE = "env-secret-" + uuid.uuid4().hex


needs_bwrap = pytest.mark.bwrap  # skipped where bubblewrap cannot run, except in CI (conftest.py)

# what each attack runs; {pid} {addr} {logfd} come from the trainer, the rest from the test
ATTACKS = {
    "write_outside": r'''
import os, tempfile, mmap
M, E = "{marker}", "{existing}"
D = os.path.dirname(M)
def t(f):
    try:
        f()
    except BaseException:
        pass
t(lambda: os.close(os.open(M, os.O_CREAT | os.O_WRONLY)))
t(lambda: open(M + ".open", "w").write("x"))
here = os.getcwd()
t(lambda: (os.chdir(D), open("relative", "w").write("x")))
t(lambda: os.chdir(here))
t(lambda: (open(os.path.join(here, "in1"), "w").write("x"), os.rename(os.path.join(here, "in1"), M + ".renamed")))
t(lambda: (open(os.path.join(here, "in2"), "w").write("x"), os.link(os.path.join(here, "in2"), M + ".linked")))
t(lambda: tempfile.mkstemp(dir=D, prefix="mkstemp"))
t(lambda: os.symlink("/etc/passwd", M + ".symlink"))
t(lambda: os.truncate(E, 0))
t(lambda: os.chmod(E, 0o700))
def mapped():
    fd = os.open(E, os.O_RDWR)
    m = mmap.mmap(fd, 0)
    m[:4] = b"PWND"
    m.flush()
t(mapped)
t(lambda: os.unlink(os.path.basename(E), dir_fd=os.open(D, os.O_RDONLY)))
print("done")
''',
    "processes": r'''
import os, sys, subprocess, multiprocessing, pty, ctypes
T = "{token}"
SLEEP = [sys.executable, "-c", "import time; time.sleep(30)", T]
def t(f):
    try:
        f()
    except BaseException:
        pass
def forked():
    if os.fork() == 0:
        os.execv(SLEEP[0], SLEEP)
def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            import time
            time.sleep(1.5)
            try:
                open("{marker}", "w").write("daemon")
            except BaseException:
                pass
            os.execv(SLEEP[0], SLEEP)
        os._exit(0)
def ptyfork():
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(SLEEP[0], SLEEP)
t(forked)
t(daemon)
t(ptyfork)
t(lambda: subprocess.Popen(SLEEP, start_new_session=True))
t(lambda: ctypes.CDLL(None).system(("nohup " + " ".join(repr(a) for a in SLEEP) + " &").encode()))
t(lambda: multiprocessing.get_context("spawn").Process(target=print).start())
print("done")
''',
    "network": r'''
import socket
def t(f):
    try:
        f()
    except BaseException:
        pass
t(lambda: socket.create_connection(("127.0.0.1", {tcp_port}), timeout=1).sendall(b"escaped"))
t(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("127.0.0.1", {udp_port})))
t(lambda: socket.getaddrinfo("pypi.org", 443))
print("done")
''',
    "signals": r'''
import os, signal
def t(f):
    try:
        f()
    except BaseException:
        pass
t(lambda: os.kill({pid}, signal.SIGSTOP))
t(lambda: os.kill({pid}, signal.SIGKILL))
t(lambda: os.killpg(os.getpgid({pid}), signal.SIGKILL))
t(lambda: os.killpg(0, signal.SIGKILL))
''',
    "proc_memory": r'''
import os
def t(f):
    try:
        f()
    except BaseException:
        pass
def write():
    fd = os.open("/proc/{pid}/mem", os.O_RDWR)
    os.pwrite(fd, b"PWNED", {addr})
t(write)
def append():
    fd = os.open("/proc/{pid}/fd/{logfd}", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"appended by the tool\n")
t(append)
try:
    print(open("/proc/{pid}/environ").read())
except BaseException as e:
    print("no environ:", type(e).__name__)
''',
    "environment": r'''
import os
print(dict(os.environ))
print(sorted(os.listdir("/")))
''',
    "flood": r'''
import sys
chunk = b"y" * 2 ** 20
for _ in range(512):
    sys.stdout.buffer.write(chunk)
''',
    "endless": r'''
import sys
while True:
    sys.stdout.write("z" * 65536)
    sys.stderr.write("e" * 65536)
''',
}


def _leftovers(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


class Outside:
    """What the test looks at from outside: a marker folder, two listeners, a log, a token for processes."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="op-outside-"))
        os.chmod(self.dir, 0o777)
        self.marker = self.dir / "marker"
        self.existing = self.dir / "existing"
        self.existing.write_text("original")
        os.chmod(self.existing, 0o666)
        self.log = self.dir / "trainer.log"
        self.log.write_text("")
        os.chmod(self.log, 0o666)
        self.token = "op-token-" + uuid.uuid4().hex
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(4)
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)

    def values(self) -> dict:
        return {"marker": str(self.marker), "existing": str(self.existing), "token": self.token,
                "tcp_port": self.tcp.getsockname()[1], "udp_port": self.udp.getsockname()[1]}

    def received(self) -> list[str]:
        got = []
        try:
            conn, _ = self.tcp.accept()
            got.append("tcp connection")
            conn.close()
        except BlockingIOError:
            pass
        try:
            got.append(f"udp {self.udp.recv(64)!r}")
        except BlockingIOError:
            pass
        return got

    def close(self) -> None:
        for pid in _leftovers(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.tcp.close()
        self.udp.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def nobody_src():
    """The package and the probe copied where an unprivileged user can read them."""
    where = Path(tempfile.mkdtemp(prefix="op-src-"))
    shutil.copytree(SRC / "offline_plugins", where / "offline_plugins",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # and pluggy, the one package the package's light modules import (tests/test_import_rule.py)
    shutil.copytree(Path(pluggy.__file__).parent, where / "pluggy", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(PROBE, where / PROBE.name)
    for root, dirs, files in os.walk(where):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _system_python() -> str:
    return next((p for p in ("/usr/bin/python3", "/usr/bin/python3.11") if os.access(p, os.X_OK)), "")


def attack(name: str, sandbox: str, *, user: str = "root", src: Path = SRC, timeout: float = 2.0) -> dict:
    """Run attack ``name`` in a stand-in trainer; what it reported, with what the outside saw."""
    outside = Outside()
    try:
        env = {"PATH": "/usr/bin:/bin", SECRET_ENV: SECRET_VALUE, "PYTHONDONTWRITEBYTECODE": "1"}
        if user == "root":
            argv = [sys.executable, str(PROBE), sandbox, str(timeout)]
            env["PYTHONPATH"] = str(SRC)
        else:
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", _system_python(),
                    str(src / PROBE.name), sandbox, str(timeout)]
            env["PYTHONPATH"] = str(src)
        spec = {"program": ATTACKS[name], "values": outside.values(), "log": str(outside.log)}
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(spec).encode(), timeout=timeout + 20)
            hung = False
        except subprocess.TimeoutExpired:  # stopped (SIGSTOP) or frozen: the run would hang
            os.killpg(proc.pid, signal.SIGCONT)
            proc.kill()
            out, err = proc.communicate()
            hung = True
        time.sleep(2.0 if name == "processes" else 0.0)  # the daemon's delayed write, had it survived
        lines = out.decode(errors="replace").strip().splitlines()
        report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        files = sorted(p.name for p in outside.dir.iterdir())
        return {"report": report, "returncode": proc.returncode, "hung": hung, "stderr": err.decode(errors="replace"),
                "files": files, "existing": ((outside.existing.read_text(), stat.S_IMODE(outside.existing.stat().st_mode))
                                             if outside.existing.exists() else ("deleted", 0)),
                "log": outside.log.read_text(), "received": outside.received(),
                "leftovers": _leftovers(outside.token), "timeout": timeout}
    finally:
        outside.close()


def violations(name: str, seen: dict) -> list[str]:
    """What the attack ``name`` achieved, read from outside: empty when the sandbox held."""
    bad = []
    report = seen["report"]
    if seen["hung"]:
        bad.append("the trainer hung (stopped or frozen)")
    if seen["returncode"] != 0 or not report:
        bad.append(f"the trainer died or failed (exit code {seen['returncode']}): {seen['stderr'][-300:]}")
        return bad
    if not report["secret_intact"]:
        bad.append("the trainer's memory was changed")
    if seen["files"] != ["existing", "trainer.log"]:
        bad.append(f"files appeared outside: {seen['files']}")
    if seen["existing"] != ("original", 0o666):
        bad.append(f"a file outside was changed: {seen['existing']}")
    if seen["log"]:
        bad.append("the trainer's open log was written to")
    if seen["received"]:
        bad.append(f"the network reached the host: {seen['received']}")
    if seen["leftovers"]:
        bad.append(f"{len(seen['leftovers'])} processes of the call outlived it")
    if SECRET_VALUE in report["text"] or "OFFLINE_PLUGINS_TEST" in report["text"]:
        bad.append("the trainer's environment leaked into the tool's output")
    if report["seconds"] > seen["timeout"] + 3.0:  # the limit holds within a second; slack for a loaded machine
        bad.append(f"the call took {report['seconds']:.1f} s against a {seen['timeout']} s limit")
    if report["rss_growth_kb"] > 64 * 1024:
        bad.append(f"the trainer's peak memory grew by {report['rss_growth_kb'] // 1024} MiB")
    return bad


@needs_bwrap
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_bwrap_holds_against_each_attack_with_a_root_trainer(name):
    seen = attack(name, "bwrap")
    assert violations(name, seen) == []
    assert seen["report"]["failure"] != "crash"


@needs_bwrap
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_bwrap_holds_against_each_attack_with_an_unprivileged_trainer(name, nobody_src):
    if not shutil.which("setpriv") or not _system_python():
        pytest.skip("needs setpriv and a system python3 an unprivileged user can run")
    if os.geteuid() != 0:
        pytest.skip("switching to an unprivileged uid needs root")
    seen = attack(name, "bwrap", user="nobody", src=nobody_src)
    assert violations(name, seen) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the unsafe sandbox's memory write needs a root trainer (CAP_SYS_PTRACE)")
def test_the_checks_catch_what_the_unsafe_subprocess_lets_through():
    memory = violations("proc_memory", attack("proc_memory", "unsafe-subprocess"))
    killed = violations("signals", attack("signals", "unsafe-subprocess"))
    assert "the trainer's memory was changed" in memory
    assert any("the trainer died" in v or "hung" in v for v in killed)


@needs_bwrap
def test_the_bwrap_sandbox_sees_no_trainer_environment_network_or_project():
    tool = PythonTool(timeout=10)
    seen = tool.run("import os, socket\nprint(sorted(os.environ))\nprint(sorted(os.listdir('/')))\n"
                    "print(os.getuid(), os.getpid() < 10, socket.if_nameindex())")
    assert seen.ok
    env, top, ids = seen.text.splitlines()
    assert env == "['HOME', 'LC_ALL', 'PATH', 'PWD', 'PYTHONIOENCODING', 'TMPDIR']"
    assert not {"home", "work", "srv", "mnt", "opt", "var"} & set(eval(top))
    assert ids == "65534 True [(1, 'lo')]"  # uid nobody, its own PID namespace, only its own loopback
    assert "No module named 'torch'" in tool.run("import torch").text  # no venv site-packages
    assert tool.run(f"print(open({str(Path(__file__))!r}).read())").failure == "error"  # no project


@needs_bwrap
def test_a_program_writes_and_reads_its_own_private_folder_and_limits_hold():
    tool = PythonTool(timeout=10)
    assert tool.run("open('note.txt', 'w').write('kept'); print(open('note.txt').read())").text == "kept"
    big = tool.run("open('big', 'wb').write(b'x' * 2 ** 21)")  # past the 1 MiB file-size limit
    assert not big.ok
    memory = tool.run("x = bytearray(2 ** 30)")  # past the 512 MiB address space
    assert (memory.ok, memory.failure) == (False, "error") and "MemoryError" in memory.text
    cpu = PythonTool(timeout=10).run("import resource; print(resource.getrlimit(resource.RLIMIT_CPU)[0], "
                                     "resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    assert cpu.text == "11 64"


def test_the_parent_reads_output_in_bounded_chunks_and_keeps_its_time_limit():
    start = time.monotonic()
    run = run_bounded([sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('y' * 65536)"], b"",
                      limits=Limits(timeout=5.0, max_output=100))
    assert time.monotonic() - start < 5.0
    assert run.truncated and run.stdout == "y" * 100 and run.returncode is None and not run.timed_out
    start = time.monotonic()
    run = run_bounded([sys.executable, "-c", "import sys, time\nsys.stderr.write('e' * 10 ** 7)\ntime.sleep(60)"], b"",
                      limits=Limits(timeout=1.0, max_error=50))
    assert run.timed_out and run.returncode is None and run.stderr == "e" * 50
    assert time.monotonic() - start < 4.0  # 1 s and the kill (slack for a loaded machine)
    run = run_bounded([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'\\xff\\xfe ok')"], b"",
                      limits=Limits(timeout=5.0))
    assert run.stdout == "\ufffd\ufffd ok"


@pytest.mark.parametrize("sandbox", ["unsafe-subprocess", pytest.param("bwrap", marks=needs_bwrap)])
def test_odd_programs_are_defined_results_never_crashes(sandbox):
    tool = PythonTool(timeout=10, sandbox=sandbox)
    nul = tool.run("print(1)\x00")
    assert (nul.ok, nul.failure) == (False, "error") and "null bytes" in nul.text
    long = tool.run("x = 0\n" + "x += 1\n" * 20000 + "print(x)")  # 140k characters: through stdin, not argv
    assert long.ok and long.text == "20000"
    bytes_out = tool.run("import sys; sys.stdout.buffer.write(b'\\xff ok')")
    assert bytes_out.ok and bytes_out.text == "\ufffd ok"
    failed = tool.run("raise ValueError('boom')")
    assert (failed.ok, failed.failure, failed.text) == (False, "error", "python error: ValueError: boom")
    start = time.monotonic()
    hung = PythonTool(timeout=1.0, sandbox=sandbox).run("while True:\n    pass")
    assert time.monotonic() - start < 4.0
    assert (hung.ok, hung.failure, hung.text) == (False, "timeout", "python timeout: no answer within 1 s")


def test_no_response_raises_out_of_the_toolbox():
    box = ToolBox([Calculator()])
    bodies = ["[" * 1000, "1" * 4301, "[" * 990 + "]" * 990, "-" * 5000 + "1", "(" * 1000 + "1" + ")" * 1000,
              "1+" * 20000 + "1", '{"a": ' * 2000, "\x00\udcff"]
    for body in bodies:
        results = box.run_response(f'<tool name="calculator">{body}</tool>')
        assert len(results) == 1 and results[0].failure in (None, "error"), body[:20]
    assert box.run_response('<tool name="calculator">' + "-" * 5000 + "1</tool>")[0].text == "1"
    assert box.run_response('<tool name="' + "x" * 10000 + '">1</tool>')[0].failure == "unknown_tool"


def test_without_bwrap_the_python_tool_is_refused_in_one_line_naming_the_package_and_the_opt_out(tmp_path):
    with pytest.raises(SandboxUnavailable) as refused:
        PythonTool(sandbox=BwrapSandbox(binary=str(tmp_path / "bwrap"))).check()
    message = str(refused.value)
    assert "\n" not in message and "apt-get install -y bubblewrap" in message
    assert "--set tool_sandbox=unsafe-subprocess" in message


def test_the_unsafe_sandbox_warns_on_every_run_that_checks_it():
    for _ in range(2):
        with pytest.warns(UnsafeSandboxWarning, match="WITHOUT isolation"):
            PythonTool(sandbox="unsafe-subprocess").check()


@needs_bwrap
def test_a_plugin_registers_a_sandbox_that_list_shows_and_the_python_tool_uses(tmp_path, monkeypatch, capsys):
    from test_plugins import AWR_PROVIDER, needs_awr

    if needs_awr.args[0]:
        pytest.skip(needs_awr.kwargs["reason"])
    from offline_plugins.cli import main

    assert main(["list"]) == 0
    listed = [line for line in capsys.readouterr().out.split("\nsandboxes")[1].splitlines()
              if line.startswith("  bwrap-logged ")]
    assert len(listed) == 1 and AWR_PROVIDER in listed[0] and "[works here]" in listed[0]
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("OFFLINE_PLUGINS_AWR_TOOL_LOG", str(log))
    tool = PythonTool(timeout=10, sandbox="bwrap-logged")
    tool.check()
    assert tool.run("print(6*7)").text == "42"
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["start"], e["returncode"]) for e in logged] == [("print(6*7)", 0)]


def test_an_unknown_or_wrong_sandbox_is_refused_by_name():
    from offline_plugins.text.tools.tools import ToolError, make_sandbox

    with pytest.raises(ToolError, match="tool_sandbox: unknown sandbox 'bwarp'; did you mean 'bwrap'"):
        make_sandbox("bwarp")
