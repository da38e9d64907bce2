"""Where model-written code runs: the :class:`Sandbox` interface, the ``bwrap`` sandbox and the unsafe fallback.

A tool that runs code a policy wrote (the Python tool) hands the program to a sandbox. The
parent's side is the same for every sandbox (:func:`run_bounded`): the program goes in on
stdin (no argv length limit, no NUL crash), the child starts in its own session and process
group, stdout and stderr are read in bounded chunks while it runs (stdout cut at ``max_output``
characters, stderr kept to its last lines), bytes are decoded with replacement, the wall-clock
limit kills the whole group, and cleanup never raises. What differs is the wall around the child:

- :class:`BwrapSandbox` (``"bwrap"``, the default): bubblewrap's namespaces. A new user (uid
  65534 inside), PID, IPC, UTS, cgroup and network namespace (no network at all, not even the
  host's loopback); a read-only ``/usr`` and interpreter with its site-packages hidden; no
  ``/home``, ``/root``, ``/etc`` (bar the loader's cache), project, venv or trainer's ``/proc``; a
  private size-bounded tmpfs as working folder; a cleared environment; no capabilities, no nested
  user namespaces; ``--die-with-parent``. Killing the sandbox's process group kills its PID
  namespace, so nothing it started outlives the call.
- :class:`UnsafeSubprocessSandbox` (``"unsafe-subprocess"``): a plain subprocess in a temporary
  folder with an audit hook. Not a security boundary: code can write anywhere the trainer can,
  signal it, read its ``/proc`` and start daemons. Only by explicit choice, with a warning per run.

Inside either, the child sets resource limits before it reads the program: address space, CPU
seconds, file size, open files and processes (the kernel does not apply the process limit to
uid 0: a root trainer's sandboxed code is bounded by its PID namespace and time limit instead).

A plugin adds another sandbox (a container runner, a remote service) through the
``offline_plugins_register_sandboxes`` hook (:class:`~offline_plugins.plugins.registry.SandboxSpec`);
``--set tool_sandbox=NAME`` picks it.

This module imports only the standard library, so a sandbox runs from any interpreter.

>>> limits = Limits(timeout=5.0)
>>> run = UnsafeSubprocessSandbox(warn=False).run("print(6 * 7)", limits)
>>> run.stdout, run.returncode, run.timed_out
('42\\n', 0, False)
>>> BwrapSandbox(binary="/nonexistent/bwrap").check()
Traceback (most recent call last):
...
offline_plugins.text.tools.sandbox.SandboxUnavailable: the 'bwrap' tool sandbox cannot run here: /nonexistent/bwrap is not an executable file. The Python tool runs model-written code only in an OS sandbox: install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap), or opt out at your own risk with --set tool_sandbox=unsafe-subprocess
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import functools
import os
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional, Sequence

from offline_plugins.errors import UserError

__all__ = ["Limits", "SandboxRun", "Sandbox", "BwrapSandbox", "UnsafeSubprocessSandbox", "SandboxError",
           "SandboxUnavailable", "UnsafeSandboxWarning", "run_bounded", "make_parent_undumpable", "no_process_filter",
           "INSTALL_HINT"]

#: what to do when bwrap is missing
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap), "
                "or opt out at your own risk with --set tool_sandbox=unsafe-subprocess")


class SandboxError(UserError, RuntimeError):
    """A sandbox that cannot run programs (set up wrongly, or broken), as opposed to a program that failed."""


class SandboxUnavailable(SandboxError):
    """The chosen sandbox cannot run on this machine; the message names what to install or choose."""


class UnsafeSandboxWarning(UserWarning):
    """Model-written code runs without an OS isolation layer."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use.

    Attributes:
        timeout: wall-clock seconds; past them the whole sandbox is killed.
        memory_bytes: address space of each process.
        cpu_seconds: CPU time of each process (None: ``ceil(timeout) + 1``).
        file_bytes: the largest file a process may write.
        open_files: file descriptors per process.
        processes: processes of the sandbox's user (not enforced by the kernel for uid 0).
        max_output: characters of stdout kept; past them the program is stopped and its output cut.
        max_error: characters of stderr kept (its last ones: a traceback's last line).
        tmpfs_bytes: the size of the private working folder (sandboxes that make one).
    """

    timeout: float = 5.0
    memory_bytes: int = 512 * 2 ** 20
    cpu_seconds: Optional[int] = None
    file_bytes: int = 2 ** 20
    open_files: int = 64
    processes: int = 32
    max_output: int = 2000
    max_error: int = 4000
    tmpfs_bytes: int = 16 * 2 ** 20

    def __post_init__(self) -> None:
        if not self.timeout or not float(self.timeout) > 0:
            raise SandboxError(f"Limits: timeout must be positive seconds, got {self.timeout!r}")
        for name in ("memory_bytes", "file_bytes", "open_files", "processes", "max_output", "max_error",
                     "tmpfs_bytes"):
            if int(getattr(self, name)) < 1:
                raise SandboxError(f"Limits: {name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def cpu(self) -> int:
        return int(self.cpu_seconds) if self.cpu_seconds else int(-(-float(self.timeout) // 1)) + 1

    def rlimit_args(self) -> list[str]:
        """The child prelude's arguments: address space, CPU, file size, open files, processes."""
        return [str(int(v)) for v in (self.memory_bytes, self.cpu, self.file_bytes, self.open_files, self.processes)]


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """What a program did: its output (decoded, cut), exit status and whether it was stopped.

    Attributes:
        stdout: what it printed, cut at ``max_output`` characters.
        stderr: the last ``max_error`` characters of its error output.
        returncode: its exit status (negative: killed by that signal; None: it did not end by itself).
        timed_out: it ran past the wall-clock limit and was killed.
        truncated: its output passed ``max_output`` and it was stopped.
        seconds: wall-clock time of the call.
    """

    stdout: str
    stderr: str
    returncode: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0


# The child's first code, given on the command line; the program comes on stdin. Limits first (argv:
# address space, CPU, file size, open files, processes), then the program is compiled and run as __main__.
_PRELUDE = r'''
import sys, resource
for _k, _v in zip(("AS", "CPU", "FSIZE", "NOFILE", "NPROC"), sys.argv[1:6]):
    try:
        resource.setrlimit(getattr(resource, "RLIMIT_" + _k), (int(_v), int(_v)))
    except (ValueError, OSError, AttributeError):
        pass
_src = sys.stdin.buffer.read()
sys.stdin.close()
del sys.argv[1:], _k, _v
try:
    _code = compile(_src, "<tool>", "exec")
except (SyntaxError, ValueError) as _e:
    sys.stderr.write("%s: %s\n" % (type(_e).__name__, _e))
    sys.exit(1)
del _src
__AUDIT__
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''

# The unsafe sandbox's courtesy hook (careless code kept in its folder; hostile code walks around it)
_AUDIT = r'''
import os as _os
_box = _os.path.realpath(_os.getcwd())
def _guard(event, args, _os=_os, _box=_box):
    if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        full = _os.path.realpath(_os.path.join(_box, _os.fsdecode(args[0]))) if isinstance(args[0], (str, bytes)) else _box
        if not (full == _box or full.startswith(_box + _os.sep)):
            raise PermissionError("writing outside the sandbox folder: " + full)
    if event in ("socket.connect", "socket.bind", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                 "os.fork", "os.spawn"):
        raise PermissionError(event + " is not allowed")
sys.addaudithook(_guard)
del _guard
'''

_CHUNK = 65536


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its own session); never raises."""
    for target in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            target()
            return
        except (ProcessLookupError, PermissionError, OSError):
            continue


def run_bounded(argv: Sequence[str], program: bytes, *, limits: Limits, env: Optional[dict] = None,
                cwd: Optional[str] = None, pass_fds: Sequence[int] = ()) -> SandboxRun:
    """Run ``argv`` with ``program`` on its stdin, the parent safe from what it does.

    The child starts in a new session (its own process group, no controlling terminal). Its
    stdout is read in chunks and cut at ``limits.max_output`` characters while reading (the child
    is then stopped), its stderr kept to the last ``limits.max_error`` characters, so the parent's
    memory stays bounded whatever it prints; at ``limits.timeout`` seconds the whole group is
    killed. The group is killed on the way out in every case, and nothing here raises once the
    child started.

    >>> run = run_bounded([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"], b"abc",
    ...                   limits=Limits(timeout=5.0))
    >>> run.stdout, run.returncode
    ('cba\\n', 0)
    """
    start = time.monotonic()
    deadline = start + float(limits.timeout)
    cap = int(limits.max_output) * 4 + 4  # bytes enough for max_output characters of UTF-8
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=cwd, start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds))
    out, err = bytearray(), bytearray()
    timed_out = truncated = False
    sel = selectors.DefaultSelector()
    try:
        pending = memoryview(bytes(program))
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        ended_at = None
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = proc.poll() is None
                break
            if ended_at is None and proc.poll() is not None:
                ended_at = now  # what is left in the pipes comes within a moment; a daemon holding them does not
            if ended_at is not None and now - ended_at > 0.5:
                break
            for key, _ in sel.select(timeout=min(0.1, deadline - now)):
                stream = key.fileobj
                if stream is proc.stdin:
                    try:
                        n = os.write(stream.fileno(), pending[:_CHUNK])
                        pending = pending[n:]
                    except BlockingIOError:
                        continue
                    except OSError:  # the child closed its stdin early
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(stream)
                        stream.close()
                    continue
                try:
                    chunk = os.read(stream.fileno(), _CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(stream)
                    continue
                if stream is proc.stdout:
                    out += chunk[: cap - len(out)]
                    if len(out) >= cap:
                        truncated = True
                else:
                    err += chunk
                    if len(err) > 2 * cap:
                        del err[: len(err) - cap]
            if truncated:
                break
    finally:
        _kill_group(proc)
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # the kernel reaps it later; nothing to raise about
            pass
    text = out.decode("utf-8", "replace")
    if len(text) > limits.max_output:
        text, truncated = text[: limits.max_output], True
    error = err.decode("utf-8", "replace")[-int(limits.max_error):]
    code = None if timed_out else proc.returncode
    if truncated and code is not None and code < 0:
        code = None  # stopped by us for its output, not by its own failure
    return SandboxRun(text, error, code, timed_out=timed_out, truncated=truncated,
                      seconds=time.monotonic() - start)


@functools.lru_cache(maxsize=1)
def make_parent_undumpable() -> bool:
    """Mark this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) so that a process of the same
    user cannot read or write its memory through ``/proc``; True where the platform allowed it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        return False


class Sandbox(abc.ABC):
    """Where a tool runs a program: :meth:`check` before the run, :meth:`run` per call.

    A subclass sets ``name`` and ``isolates`` (one line for ``list``), implements :meth:`run`
    (usually :func:`run_bounded` over its own command line) and :meth:`check` (raise
    :class:`SandboxUnavailable` naming the fix when it cannot run here). ``safe`` says whether it
    is an isolation layer meant to hold against hostile code.
    """

    name: str = ""
    isolates: str = ""
    safe: bool = True

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` when this sandbox cannot run here (called before a run starts)."""

    @abc.abstractmethod
    def run(self, program: str, limits: Limits) -> SandboxRun:
        """Run the Python ``program`` under ``limits``; a broken sandbox raises :class:`SandboxError`."""

    def interpreter(self) -> str:
        """The Python that runs programs: this one's base interpreter (not a venv's wrapper)."""
        return os.path.realpath(sys.executable)


def _python_argv(python: str, limits: Limits, audit: str = "") -> list[str]:
    return [python, "-I", "-S", "-B", "-c", _PRELUDE.replace("__AUDIT__", audit), *limits.rlimit_args()]


def _encode(program: str) -> bytes:
    return str(program).encode("utf-8", "surrogatepass")


class UnsafeSubprocessSandbox(Sandbox):
    """A subprocess in a temporary folder, with an audit hook: no isolation against hostile code.

    Args:
        warn: warn (:class:`UnsafeSandboxWarning`) at :meth:`check`, once per run that uses it.
    """

    name = "unsafe-subprocess"
    isolates = ("NOT a security boundary: a plain subprocess (own folder, rlimits, an audit hook); code can write "
                "where the trainer can, signal it and read its /proc")
    safe = False

    def __init__(self, *, warn: bool = True) -> None:
        self.warn = bool(warn)

    def check(self) -> None:
        if self.warn:
            warnings.warn("tool_sandbox=unsafe-subprocess: the Python tool runs model-written code WITHOUT isolation; "
                          "it can write anywhere this run can, kill or stop this run, read and change its memory "
                          "through /proc and start processes that outlive the call. Use it only with code you trust; "
                          "the default sandbox, bwrap, needs bubblewrap (Debian/Ubuntu: apt-get install -y "
                          "bubblewrap)",
                          UnsafeSandboxWarning, stacklevel=2)

    def run(self, program: str, limits: Limits) -> SandboxRun:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"}
        with tempfile.TemporaryDirectory(prefix="offline-plugins-tool-") as box:
            run = run_bounded(_python_argv(self.interpreter(), limits, _AUDIT), _encode(program), limits=limits,
                              env=env, cwd=box)
        return run


@functools.lru_cache(maxsize=8)
def _bwrap_problem(binary: str) -> str:
    """``""`` when ``binary`` can make a sandbox like :class:`BwrapSandbox`'s here, else why not."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        return f"{binary} is not an executable file"
    try:
        proc = subprocess.run([binary, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                               "--unshare-uts", "--die-with-parent", "--new-session", "--uid", "65534", "--gid",
                               "65534", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=30, start_new_session=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} did not start: {exc}"
    if proc.returncode != 0:
        said = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return (f"{binary} could not make a user, PID and network namespace (exit code {proc.returncode}: "
                f"{said[-1] if said else 'no message'}); user namespaces may be switched off "
                "(sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces) or blocked by a container's "
                "seccomp profile")
    return ""


# seccomp (classic BPF over struct seccomp_data): the sandboxed program may start threads but no process
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {"x86_64": {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435},
             "aarch64": {"clone": 220, "clone3": 435}}
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS, _CLONE_THREAD = 1, 38, 0x00010000


@functools.lru_cache(maxsize=4)
def no_process_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """A seccomp program (bwrap's ``--seccomp``) that refuses new processes and allows everything else.

    ``fork``, ``vfork`` and a ``clone`` without ``CLONE_THREAD`` fail with ``EPERM`` (threads still
    start); ``clone3``, whose flags a filter cannot read, fails with ``ENOSYS`` (the C library then
    uses ``clone``); syscalls of another ABI (x32, i386 on x86_64) fail with ``EPERM``. None on a
    machine it has no syscall table for (the sandbox then runs without it). Why a filter and not
    only ``RLIMIT_NPROC``: the kernel does not apply that limit to a root trainer's sandbox (its user
    maps to uid 0), so a fork bomb would run free until the time limit.

    >>> len(no_process_filter("x86_64")) % 8, no_process_filter("sparc") is None
    (0, True)
    """
    machine = machine or platform.machine()
    if machine not in _SYSCALLS:
        return None
    nr = _SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog: list[tuple[int, int, Optional[str], Optional[str]]] = []  # (code, k, label if true, label if false)
    allow, deny, nosys = "allow", "deny", "nosys"

    def op(code: int, k: int, true: Optional[str] = None, false: Optional[str] = None) -> None:
        prog.append((code, k, true, false))

    op(ld, 4)  # arch
    op(jeq, _AUDIT_ARCH[machine], None, deny)
    op(ld, 0)  # syscall number
    op(jge, 0x40000000, deny, None)  # the x32 ABI's numbers
    for name in ("fork", "vfork"):
        if name in nr:
            op(jeq, nr[name], deny, None)
    op(jeq, nr["clone3"], nosys, None)
    op(jeq, nr["clone"], None, allow)
    op(ld, 16)  # clone's flags (args[0], low 32 bits)
    op(jset, _CLONE_THREAD, allow, deny)
    labels = {allow: len(prog), deny: len(prog) + 1, nosys: len(prog) + 2}
    prog += [(ret, _RET_ALLOW, None, None), (ret, _RET_ERRNO | _EPERM, None, None),
             (ret, _RET_ERRNO | _ENOSYS, None, None)]
    # a jump's offset counts the instructions after this one
    return b"".join(struct.pack("=HBBI", code, labels[t] - i - 1 if t else 0, labels[f] - i - 1 if f else 0, k)
                    for i, (code, k, t, f) in enumerate(prog))


class BwrapSandbox(Sandbox):
    """bubblewrap: new user, PID, IPC, UTS, cgroup and network namespaces, a read-only system, a private tmpfs.

    Args:
        binary: the ``bwrap`` executable (default: found on ``PATH``).
        uid: the user id inside the sandbox (65534, ``nobody``).
        readonly: more host paths to mount read-only at the same place (data a tool needs).
        no_processes: refuse new processes (threads still start) with a seccomp filter
            (:func:`no_process_filter`); the default.
    """

    name = "bwrap"
    isolates = ("bubblewrap: new user/PID/IPC/UTS/network namespaces (no network), read-only /usr and interpreter, "
                "no /home, /root, /etc, project or trainer /proc, private tmpfs, rlimits, killed as a whole")

    def __init__(self, *, binary: Optional[str] = None, uid: int = 65534, readonly: Sequence[str] = (),
                 no_processes: bool = True) -> None:
        self.binary = binary or shutil.which("bwrap") or "bwrap"
        self.no_processes = bool(no_processes)
        self.uid = int(uid)
        self.readonly = tuple(str(p) for p in readonly)

    def check(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable(f"the 'bwrap' tool sandbox needs Linux (this is {sys.platform}); run the Python "
                                     "tool in a container sandbox from a plugin, or opt out at your own risk with "
                                     "--set tool_sandbox=unsafe-subprocess")
        binary = self.binary if os.sep in self.binary else shutil.which(self.binary)
        problem = _bwrap_problem(binary) if binary else "the bwrap program is not installed (not on PATH)"
        if problem:
            raise SandboxUnavailable(f"the 'bwrap' tool sandbox cannot run here: {problem}. The Python tool runs "
                                     f"model-written code only in an OS sandbox: {INSTALL_HINT}")

    def argv(self, limits: Limits, python: Optional[str] = None, seccomp_fd: Optional[int] = None) -> list[str]:
        """The command line of one call (the program comes on stdin; ``seccomp_fd``: a descriptor holding
        :func:`no_process_filter`)."""
        python = python or self.interpreter()
        args = [self.binary, *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []), "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
                "--uid", str(self.uid), "--gid", str(self.uid), "--hostname", "sandbox", "--cap-drop", "ALL",
                "--ro-bind", "/usr", "/usr"]
        for top in ("bin", "lib", "lib32", "lib64", "sbin"):
            path = "/" + top
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        # the interpreter's own tree, read-only at the same path (its shared library is found there), its
        # installed packages hidden: the program gets the standard library and nothing of the venv or project
        prefix = os.path.realpath(sys.base_prefix)
        if not prefix.startswith("/usr/") and prefix != "/usr":
            args += ["--ro-bind", prefix, prefix]
        for site in _site_dirs(prefix):
            args += ["--tmpfs", site]
        if os.path.exists("/etc/ld.so.cache"):
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for path in self.readonly:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(limits.tmpfs_bytes)), "--tmpfs", "/tmp",
                 "--size", str(int(limits.tmpfs_bytes)), "--tmpfs", "/box", "--chdir", "/box", "--clearenv",
                 "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/box", "--setenv", "TMPDIR", "/tmp",
                 "--setenv", "LC_ALL", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8", "--"]
        return args + _python_argv(python, limits)

    def run(self, program: str, limits: Limits) -> SandboxRun:
        program_filter = no_process_filter() if self.no_processes else None
        if program_filter is None:
            run = run_bounded(self.argv(limits), _encode(program), limits=limits, env={}, cwd="/")
        else:
            read, write = os.pipe()  # the filter is a few hundred bytes: the pipe holds it whole
            try:
                os.write(write, program_filter)
                os.close(write)
                write = -1
                run = run_bounded(self.argv(limits, seccomp_fd=read), _encode(program), limits=limits, env={},
                                  cwd="/", pass_fds=(read,))
            finally:
                for fd in (read, write):
                    if fd >= 0:
                        os.close(fd)
        if run.returncode == 1 and run.stderr.startswith("bwrap:") and not run.stdout:
            raise SandboxError(f"the bwrap sandbox did not start: {run.stderr.strip().splitlines()[0]}")
        return run


def _site_dirs(prefix: str) -> list[str]:
    """The package folders under ``prefix`` (hidden in the sandbox)."""
    found = []
    for lib in ("lib", "lib64", "local/lib"):
        base = os.path.join(prefix, lib)
        if not os.path.isdir(base):
            continue
        for entry in sorted(os.listdir(base)):
            if entry.startswith("python"):
                for name in ("site-packages", "dist-packages"):
                    path = os.path.join(base, entry, name)
                    if os.path.isdir(path):
                        found.append(path)
    return found
