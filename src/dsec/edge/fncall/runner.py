#!/usr/bin/env python3
"""FnCall pool runner: serves short stateless calls inside one warm pool sandbox.

Standalone on purpose (stdlib only, Python >= 3.11, never imports dsec): it is copied into the
sandbox and run by the image's python3, which has neither pydantic nor dsec. The edge starts it
once per sandbox, as root, through a pipe:

    python3 runner.py --workdir /tmp/fncall --preload json,math
                      [--uid 65534 --gid 65534] [--scrub /tmp,/var/tmp,/dev/shm,/run/lock,/dev/mqueue]
                      [--mergeable SEED]

and speaks newline-delimited JSON (the shapes of ``dsec.protocol.fncall``). First line out:
``{"ready": true, "preloaded": [...], "private_net": bool, "call_uid": int, "mergeable_bytes":
int, "fixed_layout": bool}``, or
``{"ready": false, "error": "..."}`` and exit status 2. Then one FnTask per line in, one
FnResult per line out, in order; EOF on stdin ends the runner.

With ``--mergeable`` (an edge that runs ksmd passes its pool's seed), the runner re-execs
itself once without address randomization and with SEED as its hash seed, and marks what its
preloads built mergeable: the runners of a pool then hold the same pages, which KSM keeps once.

Isolation of a call:
- Every process of a call is forked by a zygote, itself forked from this runner after the
  preloads and before any task was read: a Python call starts with the modules imported, but
  cannot find an earlier call's task or inputs, or its own ``expected_stdout``, in its memory.
- The child: its own session (one killpg reaches its tree), when the runner may create
  namespaces its own IPC namespace and a network namespace with no socket of an earlier call
  in it (shared by calls while that holds: ``_SharedNet``), a fresh 0700 call dir as cwd,
  rlimits, then the unprivileged call uid with no_new_privs; stdin from a memfd, output to pipes read here.
- After it: when neither the runner nor the zygote has a child of the call left (every process
  of a call descends from its first one, and orphans come to the runner, the subreaper), none
  is alive and none can start: proven without a fork. Otherwise kill(-1, SIGKILL) from a
  helper running as the call uid (the kernel signals every process of the uid while holding
  the task list lock, so a fork bomb cannot outrun it), reap (the runner is the subreaper of
  orphans), repeat until /proc shows no process of the uid;
  then fetch files, remove the call dir and the uid's entries in the scrub dirs, and verify
  all of that: the result's ``clean``. Not root: calls run as the runner's own uid, which only
  the process group kill can clean after, so every result says ``clean: false``.

The call uid must belong to calls alone: every process of it is killed after each call, and
RLIMIT_NPROC counts all of its processes and threads. ``--scrub`` must name every directory,
outside the call dir, where that uid can create files (with the pool's layers read-only: the
tmpfs ones). Per process of a call: RLIMIT_AS = memory_limit_mb (compilers: at least 1 GiB),
RLIMIT_CPU = ceil(run_timeout_s) + 1 s (SIGXCPU; SIGKILL a second later), RLIMIT_NPROC 2048
(processes and threads), RLIMIT_FSIZE 256 MiB, RLIMIT_NOFILE 1024, no core files; the
wall-clock timeout is the runner's, which kills the call's session.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import dataclasses
import gc
import importlib
import json
import math
import os
import re
import resource
import secrets
import select
import selectors
import shutil
import signal
import socket
import stat
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

LANGUAGES = ("python", "bash", "c", "cpp")
SOURCE = {"python": "main.py", "bash": "main.sh", "c": "main.c", "cpp": "main.cpp"}
RUN_ARGV: dict[str, list[str] | None] = {"python": None, "bash": ["bash", "main.sh"], "c": ["./main"]}
RUN_ARGV["cpp"] = RUN_ARGV["c"]
RESERVED = frozenset([*SOURCE.values(), "main"])  # input files may not take these names
# field: (type, default, min, max); dsec.protocol.fncall.FnTask declares the same (a test checks).
BOUNDS: dict[str, tuple[type, float, float, float]] = {
    "compile_timeout_s": (float, 30.0, 0.1, 3600.0),
    "run_timeout_s": (float, 10.0, 0.1, 3600.0),
    "memory_limit_mb": (int, 256, 32, 16384),  # null: no address-space limit (NULLABLE)
    "max_output_bytes": (int, 1 << 20, 1, 64 << 20),
}
NULLABLE = frozenset({"memory_limit_mb"})
MAX_CODE = 1 << 20  # bytes of UTF-8
MAX_STDIN = 16 << 20
MAX_EXPECTED = 16 << 20
MAX_FILES = 4096  # input files, and paths to fetch
MAX_FILES_BYTES = 32 << 20  # all input files together, decoded
MAX_FETCH_BYTES = 32 << 20  # all fetched files together
MAX_PATH = 512
MAX_LINE = 64 << 20
# Per call: processes+threads of the call uid (RLIMIT_NPROC counts threads; real programs start
# a thread pool per core, graders 100s of threads), fds, file size. The pool sandbox's pids
# cgroup is the hard bound; NPROC stays below it so the runner can always fork its killer.
NPROC, NOFILE, FSIZE = 2048, 1024, 256 << 20
# Absolute paths: not under these (dsec.protocol.fncall.SYSTEM_DIRS says why; a test keeps them equal).
SYSTEM_DIRS = frozenset(
    {
        "proc",
        "sys",
        "dev",
        ".dsec",
        "etc",
        "usr",
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "boot",
        "run",
        "var",
    }
)
OPEN_SYSTEM_DIRS = ("/dev/shm/", "/var/tmp/")
COMPILE_MEMORY_MB = 1024  # compilers need more address space than most programs they build
KILL_ROUNDS = 50
# A failing program with one of these in the tail of its stderr ran out of memory (FnResult doc).
MEMORY_RE = re.compile(rb"std::bad_alloc|MemoryError|[Cc]annot allocate|[Oo]ut of memory")
# USER and LOGNAME: the call uid has no passwd entry, and getpass.getuser() (cache dirs of
# torch, matplotlib) asks the environment first. MPLBACKEND: a call has no display, and
# Debian's matplotlibrc names a GUI backend.
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "MPLBACKEND": "Agg",
}
CLONE_NEWIPC, CLONE_NEWNET, IPC_RMID = 0x08000000, 0x40000000, 0
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
MADV_MERGEABLE, ADDR_NO_RANDOMIZE, PER_QUERY = 12, 0x0040000, 0xFFFFFFFF
LAYOUT_ENV = "DSEC_FNCALL_LAYOUT"  # set in the runner's re-exec with the pool's layout
_libc = ctypes.CDLL(None, use_errno=True)
_own_layout = False  # this runner turned address randomization off: exec'd programs get it back


def same_layout(seed: int) -> None:
    """Become this runner again with address randomization off and ``seed`` as the hash seed:
    every runner of the pool, started alike, then builds its preloads at the same addresses
    with the same contents, which KSM keeps once (measured: 92% of a runner's anonymous pages
    merge across two, 4% with randomization). It gives up nothing between calls: all calls of
    a sandbox fork from one zygote, so they share its layout and seed already. Left alone
    under a persona the operator chose."""
    global _own_layout
    if os.environ.get(LAYOUT_ENV) == str(seed):
        _own_layout = True  # the re-exec'd runner
        return
    if _libc.personality(PER_QUERY) != 0 or _libc.personality(ADDR_NO_RANDOMIZE) == -1:
        return
    env = dict(os.environ, PYTHONHASHSEED=str(seed), **{LAYOUT_ENV: str(seed)})
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        _libc.personality(0)  # serve as started, unmerged


def mark_mergeable() -> int:
    """``madvise(MADV_MERGEABLE)`` on every private writable mapping (heap, arenas, modules'
    data: what the preloads built); the zygote and its calls inherit the mark. Bytes marked.

    Called again just before the zygote forks and before the runner says it is ready: the
    heap grows by new mappings (brk past a marked one makes an unmarked one), and whether
    anything allocated after a mark crosses that line depends on sizes nothing here controls
    (paths, environment). Marking again is idempotent and cheap."""
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()
    marked = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        name = fields[5] if len(fields) > 5 else ""
        if fields[1][1] != "w" or fields[1][3] != "p" or name in ("[vvar]", "[vdso]", "[vsyscall]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_MERGEABLE) == 0:
            marked += hi - lo
    return marked


class TaskError(ValueError):
    """The task line is not a valid FnTask."""


class CallFailed(RuntimeError):
    """The runner could not carry the call out (not the code's fault)."""


class ZygoteLost(CallFailed):
    """The zygote died or stopped answering: no further call can run here."""


@dataclasses.dataclass
class Task:
    language: str
    code: str
    stdin: bytes
    files: dict[str, bytes]
    fetch_files: list[str]
    expected_stdout: str | None
    compile_timeout_s: float
    run_timeout_s: float
    memory_limit_mb: int | None
    max_output_bytes: int


def check_path(p: object, workdir: str = "/tmp/fncall") -> str:
    if not isinstance(p, str) or not 0 < len(p) <= MAX_PATH or "\0" in p:
        raise TaskError(f"bad path {p!r}: give a path of 1-{MAX_PATH} characters")
    parts = p[1:].split("/") if p.startswith("/") else p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise TaskError(f"bad path {p!r}: empty, '.' and '..' components are refused")
    if p.startswith("/"):
        system = parts[0] in SYSTEM_DIRS and not p.startswith(OPEN_SYSTEM_DIRS)
        if len(parts) < 2 or system or (p + "/").startswith(workdir + "/"):
            raise TaskError(f"bad path {p!r}: absolute paths in system directories are refused")
    return p


def _text(obj: dict[str, Any], name: str, default: str | None, limit: int) -> Any:
    v = obj.get(name, default)
    if v is not None and (not isinstance(v, str) or len(v.encode()) > limit):
        raise TaskError(f"{name} must be a string of at most {limit} bytes")
    return v


def parse_task(obj: Any) -> Task:
    """Validate a decoded task line; mirrors FnTask, as the last line of defence."""
    if not isinstance(obj, dict):
        raise TaskError("a task is a JSON object")
    unknown = set(obj) - {"language", "code", "stdin", "files", "fetch_files", "expected_stdout", *BOUNDS}
    if unknown:
        raise TaskError(f"unknown fields {sorted(unknown)}")
    if obj.get("language") not in LANGUAGES:
        raise TaskError(f"language must be one of {', '.join(LANGUAGES)}")
    limits: dict[str, Any] = {}
    for name, (typ, default, lo, hi) in BOUNDS.items():
        v = obj.get(name, default)
        if v is None and name in NULLABLE:
            limits[name] = None
            continue
        ok_type = (int, float) if typ is float else int
        if isinstance(v, bool) or not isinstance(v, ok_type) or not lo <= v <= hi:
            raise TaskError(f"{name} must be a {typ.__name__} in [{lo}, {hi}]")
        limits[name] = v
    files_in, fetch = obj.get("files", {}), obj.get("fetch_files", [])
    if not isinstance(files_in, dict) or len(files_in) > MAX_FILES:
        raise TaskError(f"files must map at most {MAX_FILES} paths to base64 contents")
    if not isinstance(fetch, list) or len(fetch) > MAX_FILES:
        raise TaskError(f"fetch_files must list at most {MAX_FILES} paths")
    files: dict[str, bytes] = {}
    for path, data in files_in.items():
        if not isinstance(data, str):
            raise TaskError(f"files[{path!r}] must be base64 text")
        files[check_path(path)] = base64.b64decode(data, validate=True)
    if sum(map(len, files.values())) > MAX_FILES_BYTES:
        raise TaskError(f"input files exceed {MAX_FILES_BYTES} bytes")
    for path in files:
        parts = path.split("/")
        if any("/".join(parts[:i]) in files or "/".join(parts[:i]) in RESERVED for i in range(1, len(parts))):
            raise TaskError(f"file {path!r} would sit under another file")
        if path in RESERVED:
            raise TaskError(f"file {path!r} would replace the program ({', '.join(sorted(RESERVED))})")
    return Task(
        language=obj["language"],
        code=_text(obj, "code", None, MAX_CODE),
        stdin=_text(obj, "stdin", "", MAX_STDIN).encode(),
        files=files,
        fetch_files=[check_path(p) for p in fetch],
        expected_stdout=_text(obj, "expected_stdout", None, MAX_EXPECTED),
        **limits,
    )


def result(status: str, message: str = "", clean: bool = False) -> dict[str, Any]:
    """An FnResult with nothing run yet; the call fills in what happened."""
    res: dict[str, Any] = dict.fromkeys(("exit_code", "signal", "judged"))
    res.update(dict.fromkeys(("compile_time_s", "run_time_s", "cpu_time_s"), 0.0))
    res.update(dict.fromkeys(("stdout_truncated", "stderr_truncated"), False))
    res.update(
        status=status, stdout="", stderr=message, files={}, fetch_errors={}, max_rss_kib=0, clean=clean
    )
    return res


def _lines(text: str) -> list[str]:
    """The judge's view of an output: trailing whitespace of lines and trailing blank lines ignored."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _exit_code(status: int) -> tuple[int | None, int | None]:
    """A wait status as (exit code, None) or (None, signal)."""
    return (os.WEXITSTATUS(status), None) if os.WIFEXITED(status) else (None, os.WTERMSIG(status))


def _limits(memory_mb: int | None, cpu_s: float) -> list[list[int]]:
    mem = resource.RLIM_INFINITY if memory_mb is None else memory_mb << 20
    cpu = math.ceil(cpu_s) + 1
    return [
        [resource.RLIMIT_AS, mem, mem],
        [resource.RLIMIT_CPU, cpu, cpu + 1],  # SIGXCPU first, SIGKILL a second later
        [resource.RLIMIT_NPROC, NPROC, NPROC],
        [resource.RLIMIT_FSIZE, FSIZE, FSIZE],
        [resource.RLIMIT_NOFILE, NOFILE, NOFILE],
        [resource.RLIMIT_CORE, 0, 0],
    ]


# ---------------------------------------------------------------- zygote and call processes


def _zygote(sock: socket.socket, netns: bool, root: bool) -> NoReturn:
    """Fork one call process per request; report its pid, then its wait status and rusage.

    The process for the next call is forked ahead (``_spare``), right after the last one was
    reaped, while the runner cleans up and the edge answers: the fork, the new session and
    namespaces are then off the next call's path. It is forked from this zygote, which holds
    no task, and learns its request only when the call starts."""
    global _shared_net
    spare: tuple[int, socket.socket | None, str] = (-1, None, "")
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)  # calls must never reach the edge's pipe
        os.dup2(null, 0)
        os.dup2(null, 1)
        # A call's collections then skip the preloads' objects instead of writing to (and so
        # copying) every page that holds one.
        gc.freeze()
        _shared_net = _SharedNet.create() if netns else None
        # A process the call made with clone(CLONE_PARENT) is this zygote's child: reaped as soon
        # as it ends (the runner's cleanup kills it), or it would stay a zombie of the call uid.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        spare = _fork_spare(sock, netns, root)
        while True:
            ready = select.select([sock.fileno(), wake_r], [], [])[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
                spare = _reap_strays(spare)
                if sock.fileno() not in ready:
                    continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
            if not msg:
                code = 0
                break
            if _shared_net is not None and not _shared_net.empty():
                # The last call left a socket (a cycle of descriptors in flight, TIME_WAIT): the
                # calls from here on share a fresh namespace, this one included.
                spare = _drop(spare)
                _shared_net = _shared_net.renew()
            if spare[0] < 0:
                spare = _fork_spare(sock, netns, root)
            (pid, chan, error), spare = spare, (-1, None, "")
            if chan is not None:
                try:
                    socket.send_fds(chan, [msg], fds)
                except OSError as exc:  # it died waiting: nothing of this call ran
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pid, error = -1, f"fork: the waiting call process is gone ({exc})"
                chan.close()
            for fd in fds:
                os.close(fd)
            if pid < 0:
                sock.send(json.dumps({"error": error}).encode())
            else:
                sock.send(json.dumps({"pid": pid}).encode())
                _, status, ru = os.wait4(pid, 0)
                cpu = ru.ru_utime + ru.ru_stime
                sock.send(json.dumps({"status": status, "maxrss": ru.ru_maxrss, "cpu": cpu}).encode())
            spare = _fork_spare(sock, netns, root)
    finally:
        try:
            _drop(spare)
        finally:
            os._exit(code)


def _drop(spare: tuple[int, socket.socket | None, str]) -> tuple[int, socket.socket | None, str]:
    """Kill and reap a spare that will serve no call."""
    if spare[0] > 0:
        os.kill(spare[0], signal.SIGKILL)
        os.waitpid(spare[0], 0)
    if spare[1] is not None:
        spare[1].close()
    return -1, None, ""


class _SharedNet:
    """The network namespace calls share while no socket of an earlier call is in it.

    Creating a namespace per call cost ~1 ms of CPU (its loopback, sysctls, and the kernel's
    teardown after the call). The zygote holds one instead, and before each call reads its
    socket counts: once the runner has proven every process of the last call gone, a socket
    there outlives them (descriptors in flight in a cycle of unix sockets, TCP TIME_WAIT), and
    the calls from then on get a fresh namespace. So a call never meets anything an earlier
    one bound or left queued; the IPC namespace (System V objects outlive their processes)
    stays per call. Counts that are not per namespace (alloc, mem) are left out."""

    def __init__(self, ns: int, stats: list[int]) -> None:
        self.ns, self.stats = ns, stats

    @staticmethod
    def create() -> _SharedNet | None:
        """A fresh namespace (the zygote stays in its own); None when one cannot be made."""
        here = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                return None
            fds: list[int] = []
            try:
                fds.append(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
                for name in ("sockstat", "sockstat6"):  # no sockstat6 without IPv6
                    try:
                        fds.append(os.open(f"/proc/self/net/{name}", os.O_RDONLY | os.O_CLOEXEC))
                    except FileNotFoundError:
                        pass
            except OSError:
                for fd in fds:
                    os.close(fd)
                fds = []
            finally:
                if _libc.setns(here, CLONE_NEWNET) != 0:  # never serve from a call's namespace
                    os._exit(1)
            return _SharedNet(fds[0], fds[1:]) if len(fds) > 1 else None
        finally:
            os.close(here)

    def empty(self) -> bool:
        """No per-namespace count (sockets used, TCP inuse/orphan/tw, UDP, RAW, FRAG) above 0."""
        for fd in self.stats:
            for line in os.pread(fd, 4096, 0).split(b"\n"):
                fields = line.split()[1:]
                for key, value in zip(fields[::2], fields[1::2], strict=False):
                    if key not in (b"alloc", b"mem") and value != b"0":
                        return False
        return True

    def renew(self) -> _SharedNet | None:
        for fd in (self.ns, *self.stats):
            os.close(fd)
        return _SharedNet.create()


_shared_net: _SharedNet | None = None  # the zygote's; its spares enter it


def _reap_strays(spare: tuple[int, socket.socket | None, str]) -> tuple[int, socket.socket | None, str]:
    """Reap every ended child of the zygote; the spare, if it is one of them, is forked anew later."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return spare
        if pid == 0:
            return spare
        if pid == spare[0]:
            if spare[1] is not None:
                spare[1].close()
            spare = (-1, None, "")


def _fork_spare(sock: socket.socket, netns: bool, root: bool) -> tuple[int, socket.socket | None, str]:
    """The next call's process, waiting for its request: (pid, channel to it, why not)."""
    chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
    except OSError as exc:
        chan.close()
        theirs.close()
        return -1, None, f"fork: {exc}"
    if pid == 0:
        sock.close()
        chan.close()
        _spare(theirs, netns, root)
    theirs.close()
    return pid, chan, ""


def _spare(chan: socket.socket, netns: bool, root: bool) -> NoReturn:
    """What a call process does before it has a request: nothing of any task is known yet."""
    early: BaseException | None = None
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if netns and _shared_net is not None:
            if _libc.setns(_shared_net.ns, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
            for fd in (_shared_net.ns, *_shared_net.stats):
                os.close(fd)
            if _libc.unshare(CLONE_NEWIPC) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWIPC)")
        elif netns and _libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET|CLONE_NEWIPC)")
        if root:
            try:
                with open("/proc/self/oom_score_adj", "w") as f:  # an OOM kill takes a call, not the runner
                    f.write("1000")
            except OSError:
                pass  # no /proc: a preference, not a requirement
    except BaseException as exc:
        early = exc
    try:
        msg, fds, _, _ = socket.recv_fds(chan, 1 << 16, 4)
    except BaseException:
        os._exit(1)
    if not msg:
        os._exit(0)  # the zygote ended
    _child(msg, fds, chan, early)


def _child(msg: bytes, fds: list[int], chan: socket.socket, early: BaseException | None) -> NoReturn:
    """Become the call: fds 0-3 from the runner, limits, the call uid; then exec or run Python.

    fd 3 is a close-on-exec status pipe: b"E<why>" when setup failed (an internal error),
    b"S" when Python user code starts, then b"M" if a MemoryError escaped it.
    """
    code = 127
    try:
        chan.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.set_inheritable(3, False)
        os.closerange(4, 1 << 20)
        if early is not None:
            raise early
        req = json.loads(msg)
        os.chdir(req["cwd"])
        for res, soft, hard in req["limits"]:
            resource.setrlimit(res, (soft, hard))
        if req["uid"] is not None:
            os.setgroups([])
            os.setgid(req["gid"])
            os.setuid(req["uid"])
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if _own_layout:  # the layout of this process stays the zygote's; what it execs is randomized
            _libc.personality(0)
        if req["argv"] is not None:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; programs expect defaults
                signal.signal(sig, signal.SIG_DFL)
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        code = _run_python(req["cwd"], req["env"])
    except BaseException as exc:
        try:
            os.write(3, b"E" + f"call setup failed: {exc!r}".encode()[:4000])
        except BaseException:
            pass
    finally:
        os._exit(code)


def _run_python(cwd: str, env: dict[str, str]) -> int:
    """Run main.py in this warm process the way `python3 main.py` would; return the exit status."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.argv, sys.path[0] = ["main.py"], cwd
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(cwd, "main.py")
    sys.modules["__main__"] = main
    os.write(3, b"S")
    status = 0
    try:
        with open("main.py", "rb") as f:
            exec(compile(f.read(), "main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        status = 0 if exc.code is None else exc.code & 0xFF if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except MemoryError as exc:
        os.write(3, b"M")  # before anything that allocates
        main.__dict__.clear()  # room to format the traceback
        _print_user_exception(exc)
        status = 1
    except BaseException as exc:
        _print_user_exception(exc)
        status = 1
    join_threads = getattr(sys.modules.get("threading"), "_shutdown", None)
    flush_original = getattr(sys.__stdout__, "flush", None)  # the zygote's, still on fd 1
    for finish in (join_threads, sys.stdout.flush, sys.stderr.flush, flush_original):  # as exit does
        try:
            if finish is not None:
                finish()
        except BaseException:
            status = status or 120
    return status


def _print_user_exception(exc: BaseException) -> None:
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop the runner's own frame
    try:
        traceback.print_exception(type(exc), exc, tb)
    except BaseException:
        pass


# ---------------------------------------------------------------- the runner


@dataclasses.dataclass
class _Stream:
    """One output pipe: the first ``cap`` bytes are kept, the rest read and dropped."""

    fd: int
    cap: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    tail: bytes = b""  # the last bytes, for memory-failure signatures past the cap
    truncated: bool = False
    eof: bool = False

    def read(self) -> None:
        chunk = os.read(self.fd, 1 << 16)
        self.eof = not chunk
        room = max(self.cap - len(self.data), 0)
        self.truncated = self.truncated or len(chunk) > room
        self.data += chunk[:room]
        self.tail = (self.tail + chunk)[-8192:]

    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclasses.dataclass
class Proc:
    out: _Stream
    err: _Stream
    status: int = 0
    maxrss_kib: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    timed_out: bool = False
    marker: bytes = b""


def _pump(streams: list[_Stream], until: float, sock: socket.socket | None = None) -> bool:
    """Read the streams until they end or ``until``; with ``sock``, stop when it is readable."""
    with selectors.DefaultSelector() as sel:
        for s in streams:
            if not s.eof:
                sel.register(s.fd, selectors.EVENT_READ, s)
        if sock is not None:
            sel.register(sock, selectors.EVENT_READ, None)
        while sel.get_map() and (left := until - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if key.data is None:
                    return True
                key.data.read()
                if key.data.eof:
                    sel.unregister(key.fd)
    return False


def _remove(path: str) -> None:
    def unlock(_func: Callable[..., Any], p: str, _exc: Any) -> None:
        for d in (os.path.dirname(p), p):  # a call may leave dirs unreadable or unwritable
            try:
                if not os.path.islink(d):
                    os.chmod(d, 0o700)
            except OSError:
                pass

    for _ in range(8):  # each pass can open one more level of locked dirs
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=unlock)
            else:
                os.unlink(path)
        except OSError:
            pass
        if not os.path.lexists(path):
            return


def _fetch(cdir: str, paths: list[str], uid: int) -> tuple[dict[str, str], dict[str, str]]:
    """Read the fetch_files back; no process of the call is alive, so the checks cannot race.
    An absolute path comes back only if the call uid owns it: the call brings back what it
    wrote or was given, never a file of the pool sandbox's own."""
    root, files, errors, total = os.path.realpath(cdir), {}, {}, 0
    for rel in paths:
        full = os.path.join(root, rel)
        if rel.startswith("/"):
            if os.path.realpath(os.path.dirname(rel)) != os.path.dirname(rel):
                errors[rel] = "a link on the way"
                continue
        elif os.path.commonpath([os.path.realpath(full), root]) != root:
            errors[rel] = "escapes the call directory"
            continue
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            errors[rel] = "missing" if isinstance(exc, FileNotFoundError) else f"cannot open: {exc.strerror}"
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                errors[rel] = "not a regular file"
            elif rel.startswith("/") and st.st_uid != uid:
                errors[rel] = "not the call's: an absolute path comes back only if the call made it"
            elif total + st.st_size > MAX_FETCH_BYTES:
                errors[rel] = f"too large: all fetched files together are capped at {MAX_FETCH_BYTES} bytes"
            else:
                chunks, left = [], st.st_size
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    chunks.append(chunk)
                    left -= len(chunk)
                total += st.st_size - left
                files[rel] = base64.b64encode(b"".join(chunks)).decode()
        finally:
            os.close(fd)
    return files, errors


def _all_root(pid: str) -> bool:
    """Every uid of the process is 0: the zygote's spare, never a call's (no call gains root)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        uids = next(line for line in f if line.startswith(b"Uid:"))
    return uids.split()[1:] == [b"0"] * 4


def _children(pid: int, tasks: list[str]) -> list[str]:
    """The child pids of every thread of ``pid`` (zombies included)."""
    found: list[str] = []
    for tid in tasks:
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
            found += f.read().decode().split()
    return found


def _sysv_ipc_of(uid: int) -> list[tuple[str, int]]:
    """The System V IPC objects (kind, id) of this IPC namespace that ``uid`` owns or created."""
    found = []
    for kind, id_column in (("shm", "shmid"), ("sem", "semid"), ("msg", "msqid")):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as f:
                header, *rows = f.read().split(b"\n")
        except OSError:
            continue
        columns = header.decode().split()
        for row in rows:
            entry = dict(zip(columns, row.split(), strict=False))
            if entry and str(uid).encode() in (entry.get("uid"), entry.get("cuid")):
                found.append((kind, int(entry[id_column])))
    return found


def _remove_sysv_ipc(objects: list[tuple[str, int]]) -> int:
    """IPC_RMID on each (as their owner or creator: without CAP_SYS_ADMIN root may not)."""
    for kind, ident in objects:
        if kind == "shm":
            _libc.shmctl(ident, IPC_RMID, None)
        elif kind == "sem":
            _libc.semctl(ident, 0, IPC_RMID)
        else:
            _libc.msgctl(ident, IPC_RMID, None)
    return 0


class Runner:
    def __init__(
        self, workdir: str, uid: int, gid: int, scrub: list[str], mark: Callable[[], int] | None = None
    ) -> None:
        self.root = os.geteuid() == 0
        self.uid, self.gid = (uid, gid) if self.root else (os.getuid(), os.getgid())
        self.scrub, self.calls, self.proven_dead = scrub, 0, False
        # This call's absolute paths: directories made for it, ones opened to it (with their
        # modes before), and every directory holding such a path (scanned for the uid's entries).
        self.made_dirs: list[str] = []
        self.opened_dirs: list[tuple[str, int]] = []
        self.abs_parents: set[str] = set()
        if self.root and not os.path.isdir("/dev/shm"):
            # POSIX semaphores and shared memory (multiprocessing's SemLock) live there; the
            # sandbox's /dev is a small tmpfs of its own, and --scrub empties it after each call.
            os.makedirs("/dev/shm", exist_ok=True)
            os.chmod("/dev/shm", 0o1777)
        os.makedirs(workdir, exist_ok=True)
        os.chmod(workdir, 0o711)  # calls may pass through to their dir, not list or write here
        self.workdir = os.path.realpath(workdir)
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        unshare = lambda: _libc.unshare(CLONE_NEWNET | CLONE_NEWIPC)  # noqa: E731
        self.private_net = self.root and self._try_in_child(unshare)
        self.sock, zsock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if mark is not None:
            mark()  # the zygote (every call's parent) inherits what is marked now
        self.own_pid = os.getpid()
        self.zygote_pid = os.fork()
        if self.zygote_pid == 0:
            self.sock.close()
            _zygote(zsock, self.private_net, self.root)
        zsock.close()
        self.zygote_dead = False
        if self.root and not self._try_in_child(self._kill_as_call_uid):
            raise OSError(f"cannot become uid {uid} / gid {gid} (setgroups, setgid, setuid)")
        if not self._cleanup(None) and self.root:  # also clears what an earlier runner left behind
            raise OSError(f"cannot start clean: processes of uid {uid} survive, or {workdir} stays non-empty")

    @property
    def healthy(self) -> bool:
        """Nothing ran since the last cleanup proved the sandbox clean."""
        return self.root and not self.zygote_dead

    def _try_in_child(self, fn: Callable[[], int]) -> bool:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if fn() == 0 else 1)
            finally:
                os._exit(1)
        return os.waitpid(pid, 0)[1] == 0

    def _recv(self, timeout: float) -> dict[str, Any]:
        if not select.select([self.sock], [], [], timeout)[0]:
            self.zygote_dead = True
            raise ZygoteLost("the zygote stopped answering")
        msg = self.sock.recv(1 << 16)
        if not msg:
            self.zygote_dead = True
            raise ZygoteLost("the zygote died")
        reply: dict[str, Any] = json.loads(msg)
        if "error" in reply:
            raise CallFailed(reply["error"])
        return reply

    def spawn(
        self,
        argv: list[str] | None,
        cdir: str,
        limits: list[list[int]],
        stdin: bytes,
        timeout: float,
        cap: int,
    ) -> Proc:
        """Run one process of the call (argv None: main.py in a warm Python); kill its leftovers."""
        if self.zygote_dead:
            raise ZygoteLost("the zygote is gone")
        self.proven_dead = False
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        mem = os.memfd_create("stdin")  # the whole stdin up front: no writer to block on
        try:
            view = memoryview(stdin)
            while view:
                view = view[os.write(mem, view) :]
            os.lseek(mem, 0, os.SEEK_SET)
            uid = self.uid if self.root else None
            env = {**ENV, "HOME": cdir, "TMPDIR": cdir}
            req: dict[str, Any] = {"argv": argv, "cwd": cdir, "limits": limits}
            req |= {"uid": uid, "gid": self.gid, "env": env}
            start = time.monotonic()  # from the request: the fork and setup count as the call's time
            socket.send_fds(self.sock, [json.dumps(req).encode()], [mem, out_w, err_w, st_w])
        finally:
            for fd in (mem, out_w, err_w, st_w):
                os.close(fd)
        proc = Proc(out=_Stream(out_r, cap), err=_Stream(err_r, cap))
        streams = [proc.out, proc.err]
        try:
            pid = int(self._recv(10.0)["pid"])
            if not _pump(streams, start + timeout, self.sock):
                proc.timed_out = True
                for kill in (os.kill, os.killpg):  # not reaped yet: the pid is still this call's
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                _pump(streams, time.monotonic() + 10.0, self.sock)
            report = self._recv(0.0)
            proc.wall_s = time.monotonic() - start
            proc.status, proc.maxrss_kib, proc.cpu_s = report["status"], report["maxrss"], report["cpu"]
            # Background processes would hold the pipes open: kill them, unless none is left.
            self.proven_dead = self._none_left() or self._kill_all(pid)
            _pump(streams, time.monotonic() + 2.0)
            os.set_blocking(st_r, False)
            try:
                while chunk := os.read(st_r, 4096):
                    proc.marker += chunk
            except BlockingIOError:
                pass
        finally:
            for fd in (out_r, err_r, st_r):
                os.close(fd)
        return proc

    def _kill_all(self, pgid: int | None) -> bool:
        """Kill the call's processes; True when /proc shows none of the call uid left."""
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        if not self.root:
            return False
        for attempt in range(KILL_ROUNDS):
            if self._try_in_child(self._kill_as_call_uid):
                self._reap()
                if not self._uid_pids():
                    return True
            time.sleep(0.001 * attempt)
        return False

    def _none_left(self) -> bool:
        """True when no process of the call can be alive, read without a fork or a /proc scan.

        The call's first process is reaped (its children were reparented before it became a
        zombie), and every process of a call descends from it: an orphan goes to the runner,
        the subreaper above it, and ``clone(CLONE_PARENT)`` from the first process makes a
        child of the zygote. So when the runner (any of its threads: numpy's BLAS pool may adopt
        the orphan) has no child but the zygote, and the zygote none but its spare (all uids 0,
        which no call can gain), zombies included, none of the call's processes exists and none
        can start again. Anything else, or a thread of the runner changing meanwhile, falls
        back to ``_kill_all``'s proof."""
        if not self.root:
            return False
        try:
            tasks = os.listdir(f"/proc/{self.own_pid}/task")
            spares = _children(self.zygote_pid, os.listdir(f"/proc/{self.zygote_pid}/task"))
            if len(spares) > 1 or not all(_all_root(pid) for pid in spares):
                return False
            if _children(self.own_pid, tasks) != [str(self.zygote_pid)]:
                return False
            return os.listdir(f"/proc/{self.own_pid}/task") == tasks
        except OSError:
            return False

    def _kill_as_call_uid(self) -> int:
        self._as_call_uid()
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing left to kill
        return 0

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.zygote_dead = self.zygote_dead or pid == self.zygote_pid

    def _uid_pids(self) -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
            except (OSError, StopIteration, ValueError):
                continue  # not a process, or it ended meanwhile
            if uid == self.uid:
                found.append(int(name))
        return found

    def _cleanup(self, cdir: str | None) -> bool:
        procs_gone = self.proven_dead or self._kill_all(None)  # no process ran since the proof
        self.proven_dead = False
        if cdir is not None:
            _remove(cdir)
        absolute_undone = self._close_absolute()
        for entry in os.listdir(self.workdir):
            _remove(os.path.join(self.workdir, entry))
        scrubbed = True
        for d in self.scrub if self.root else []:
            try:
                with os.scandir(d) as it:
                    mine = [e.path for e in it if e.stat(follow_symlinks=False).st_uid == self.uid]
            except OSError:
                continue
            for path in mine:
                _remove(path)
                scrubbed = scrubbed and not os.path.lexists(path)
        # Without a private IPC namespace per call (a sandbox without CAP_SYS_ADMIN: every pool
        # sandbox), System V objects outlive the call, readable by the next one (same uid).
        ipc_gone = not self.root or self.private_net or self._drop_sysv_ipc()
        clean = procs_gone and scrubbed and absolute_undone and ipc_gone and not self.zygote_dead
        return clean and not os.listdir(self.workdir)

    def _drop_sysv_ipc(self) -> bool:
        """Remove the call uid's System V objects (no process of the call is alive, so a segment
        goes at once); True when none is left. A read of three /proc files when there is none."""
        if objects := _sysv_ipc_of(self.uid):
            self._try_in_child(lambda: self._as_call_uid() or _remove_sysv_ipc(objects))
        return not _sysv_ipc_of(self.uid)

    def _as_call_uid(self) -> int:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)
        return 0

    def _uid_entries(self, d: str) -> list[str]:
        try:
            with os.scandir(d) as it:
                return [e.path for e in it if e.stat(follow_symlinks=False).st_uid == self.uid]
        except OSError:
            return []

    def _open_absolute(self, t: Task) -> None:
        """Let the call write its absolute paths, for this call only (``_close_absolute`` undoes it):
        missing directories are made and given to the call uid; an existing one it cannot write
        is opened to it, sticky, so what was there stays out of its reach."""
        for path in [p for p in [*t.files, *t.fetch_files] if p.startswith("/")]:
            if (path + "/").startswith(self.workdir + "/"):
                raise TaskError(f"bad path {path!r}: the runner's own directory")
            parent, missing = os.path.dirname(path), []
            while not os.path.lexists(parent):
                missing.append(parent)
                parent = os.path.dirname(parent)
            st = os.lstat(parent)
            if not stat.S_ISDIR(st.st_mode) or os.path.realpath(parent) != parent:
                raise TaskError(f"bad path {path!r}: {parent} is not a directory (or is a link)")
            self.abs_parents.add(parent)
            if missing:
                self.made_dirs.append(missing[-1])
                for d in reversed(missing):
                    os.mkdir(d, 0o755)
                    if self.root:
                        os.lchown(d, self.uid, self.gid)
            elif self.root and st.st_uid != self.uid and not st.st_mode & stat.S_IWOTH:
                if parent not in (d for d, _ in self.opened_dirs):
                    self.opened_dirs.append((parent, stat.S_IMODE(st.st_mode)))
                    os.chmod(parent, stat.S_IMODE(st.st_mode) | stat.S_ISVTX | stat.S_IWOTH | stat.S_IXOTH)
        for path, data in t.files.items():
            if path.startswith("/"):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with open(fd, "wb") as f:
                    f.write(data)
                if self.root:
                    os.lchown(path, self.uid, self.gid)

    def _close_absolute(self) -> bool:
        """Remove what the call made at its absolute paths; True when that is proven done."""
        for d in self.made_dirs:
            _remove(d)
        for d in self.abs_parents:
            for path in self._uid_entries(d):
                _remove(path)
        for d, mode in self.opened_dirs:
            os.chmod(d, mode)
        undone = not any(os.path.lexists(d) for d in self.made_dirs)
        undone = undone and all(stat.S_IMODE(os.lstat(d).st_mode) == m for d, m in self.opened_dirs)
        undone = undone and not any(self._uid_entries(d) for d in self.abs_parents)
        self.made_dirs, self.opened_dirs, self.abs_parents = [], [], set()
        return undone

    def _prepare(self, cdir: str, t: Task) -> None:
        os.mkdir(cdir, 0o700)
        relative = [(p, d) for p, d in t.files.items() if not p.startswith("/")]
        for rel, data in [*relative, (SOURCE[t.language], t.code.encode())]:
            path = os.path.join(cdir, rel)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
                f.write(data)
        if self.root:
            for d, _, names in os.walk(cdir):
                for p in [d, *(os.path.join(d, n) for n in names)]:
                    os.lchown(p, self.uid, self.gid)

    def call(self, t: Task) -> dict[str, Any]:
        res = result("internal_error")
        self.calls += 1
        cdir = os.path.join(self.workdir, f"call-{self.calls}-{secrets.token_hex(8)}")
        try:
            self._prepare(cdir, t)
            self._open_absolute(t)
            argv = RUN_ARGV[t.language]
            if t.language in ("c", "cpp"):
                cc = ["gcc", "-std=c17"] if t.language == "c" else ["g++", "-std=c++17"]
                cc += ["-O2", "-o", "main", SOURCE[t.language], "-lm"]
                memory = None if t.memory_limit_mb is None else max(t.memory_limit_mb, COMPILE_MEMORY_MB)
                limits = _limits(memory, t.compile_timeout_s)
                comp = self.spawn(cc, cdir, limits, b"", t.compile_timeout_s, t.max_output_bytes)
                res["compile_time_s"] = comp.wall_s
                if comp.marker.startswith(b"E"):
                    raise CallFailed(comp.marker[1:].decode(errors="replace"))
                if comp.timed_out or comp.status != 0:
                    why = f"\ncompilation timed out after {t.compile_timeout_s} s" if comp.timed_out else ""
                    code, sig = _exit_code(comp.status)
                    res.update(status="compile_error", exit_code=code, signal=sig)
                    res.update(stdout=comp.out.text(), stderr=comp.err.text() + why)
                    return res
            limits = _limits(t.memory_limit_mb, t.run_timeout_s)
            run = self.spawn(argv, cdir, limits, t.stdin, t.run_timeout_s, t.max_output_bytes)
            if run.marker.startswith(b"E"):
                raise CallFailed(run.marker[1:].decode(errors="replace"))
            self._classify(res, run, t)
            res["files"], res["fetch_errors"] = _fetch(cdir, t.fetch_files, self.uid)
        except TaskError as exc:
            res.update(status="internal_error", stderr=f"invalid task: {exc}")
        except (CallFailed, OSError) as exc:
            res.update(status="internal_error", stderr=f"runner: {exc}")
        finally:
            res["clean"] = self._cleanup(cdir)
        return res

    @staticmethod
    def _classify(res: dict[str, Any], run: Proc, t: Task) -> None:
        code, sig = _exit_code(run.status)
        stdout = run.out.text()
        res.update(exit_code=code, signal=sig, stdout=stdout, stderr=run.err.text())
        res.update(stdout_truncated=run.out.truncated, stderr_truncated=run.err.truncated)
        res.update(run_time_s=run.wall_s, cpu_time_s=run.cpu_s, max_rss_kib=run.maxrss_kib)
        killed = sig == signal.SIGKILL
        if run.timed_out or sig == signal.SIGXCPU or (killed and run.cpu_s >= math.ceil(t.run_timeout_s) + 1):
            status = "timeout"
        elif code != 0 and (
            (run.marker[:1] == b"S" and b"M" in run.marker[1:])
            or MEMORY_RE.search(run.err.tail)
            or (killed and t.memory_limit_mb is None)  # only the sandbox's cgroup OOM kills it then
            or (
                killed
                and t.memory_limit_mb is not None
                and run.maxrss_kib * 1024 >= 0.9 * (t.memory_limit_mb << 20)
            )
        ):
            status = "memory_exceeded"
        elif code != 0:
            status = "runtime_error"
        elif run.out.truncated or run.err.truncated:
            status = "output_truncated"
        elif t.expected_stdout is not None and _lines(stdout) != _lines(t.expected_stdout):
            status = "wrong_answer"
        else:
            status = "ok"
        res["status"] = status
        res["judged"] = None if t.expected_stdout is None else status == "ok"

    def close(self) -> None:
        self._kill_all(None)
        self.sock.close()  # EOF: the zygote exits
        os.waitpid(self.zygote_pid, 0)
        self._reap()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="FnCall pool runner (one per pool sandbox)")
    ap.add_argument("--workdir", required=True, help="calls get fresh directories under it")
    ap.add_argument("--preload", default="", help="comma-separated modules to import once")
    ap.add_argument("--uid", type=int, default=65534, help="calls run as this uid (when root)")
    ap.add_argument("--gid", type=int, default=65534)
    scrub_help = "writable dirs: their entries owned by the call uid go after each call"
    ap.add_argument("--scrub", default="/tmp,/var/tmp,/dev/shm,/run/lock,/dev/mqueue", help=scrub_help)
    merge_help = "the pool's hash seed: lay memory out as every runner of the pool does, for KSM"
    ap.add_argument("--mergeable", type=int, default=None, metavar="SEED", help=merge_help)
    args = ap.parse_args(argv)
    if args.mergeable is not None:
        same_layout(args.mergeable)

    def send(obj: dict[str, Any]) -> None:
        sys.stdout.buffer.write(json.dumps(obj).encode() + b"\n")
        sys.stdout.buffer.flush()

    preloaded = []
    for name in filter(None, (n.strip() for n in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:
            send({"ready": False, "error": f"preload {name}: {exc!r}"})
            return 2
        preloaded.append(name)
    mark = mark_mergeable if args.mergeable is not None else None
    try:
        runner = Runner(args.workdir, args.uid, args.gid, [d for d in args.scrub.split(",") if d], mark)
    except OSError as exc:
        send({"ready": False, "error": f"runner: {exc}"})
        return 2
    marked = mark() if mark is not None else 0
    ready = {"ready": True, "preloaded": preloaded, "private_net": runner.private_net, "call_uid": runner.uid}
    send({**ready, "mergeable_bytes": marked, "fixed_layout": _own_layout})
    stdin = sys.stdin.buffer
    while line := stdin.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE:
            while line and not line.endswith(b"\n"):  # skip the rest of the oversized line
                line = stdin.readline(1 << 20)
            send(result("internal_error", f"task line longer than {MAX_LINE} bytes", runner.healthy))
            continue
        try:
            task = parse_task(json.loads(line))
        except ValueError as exc:  # JSON, base64 and TaskError
            send(result("internal_error", f"invalid task: {exc}", runner.healthy))
            continue
        try:
            send(runner.call(task))
        except Exception:  # a runner bug: say so, and let the edge recycle the sandbox
            send(result("internal_error", "runner bug:\n" + traceback.format_exc()))
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
