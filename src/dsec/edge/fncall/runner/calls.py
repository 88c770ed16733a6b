"""The runner's side of a call: set it up, run its processes through the zygote, judge it, and
prove the sandbox clean after it.

Two zygotes: a lean one, a fresh interpreter exec'd at start, and a warm one forked after the
preloads (when there are any). Exec'd programs (compilers, C, C++, bash) and Python programs
whose imports are all of the standard library and none preloaded (``imports.needs_preloads``)
fork from the lean one: a fork of a small heap, and an exit with little to unmap. The rest
fork from the warm one.

After a call, when neither the runner nor a zygote has a child of the call left (every
process of a call descends from its first one, and orphans come to the runner, the
subreaper), none is alive and none can start: proven without a fork (``_none_left``).
Otherwise kill(-1, SIGKILL) from a helper running as the call uid (the kernel signals every
process of the uid while holding the task list lock, so a fork bomb cannot outrun it), reap,
repeat until /proc shows no process of the uid (``_kill_all``); then fetch files, remove the
call dir and the uid's entries in the scrub dirs, and verify all of that: the result's
``clean``. Not root: calls run as the runner's own uid, which only the process group kill
can clean after, so every result says ``clean: false``.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import layout
from .capture import Proc, Stream, pump
from .cleanup import all_root, children, remove, remove_sysv_ipc, sysv_ipc_of
from .files import CallFiles, fetch
from .imports import needs_preloads
from .judge import classify, exit_code
from .libc import CLONE_NEWIPC, CLONE_NEWNET, PR_SET_CHILD_SUBREAPER, libc
from .process import COMPILE_MEMORY_MB, ENV, rlimits
from .wire import RUN_ARGV, SOURCE, Task, TaskError, result
from .zygote import BOOT, zygote

KILL_ROUNDS = 50
_ZYGOTE_START_S = 30.0  # an interpreter's start, on a node busy starting a pool
# Where this package is imported from (the zip the runner runs as): the lean zygote's path.
_PACKAGE_ROOT = __file__
for _ in range(__package__.count(".") + 2):
    _PACKAGE_ROOT = os.path.dirname(_PACKAGE_ROOT)


class CallFailed(RuntimeError):
    """The runner could not carry the call out (not the code's fault)."""


class ZygoteLost(CallFailed):
    """The zygote died or stopped answering: no further call can run here."""


@dataclass
class _Zygote:
    pid: int
    sock: socket.socket  # requests out, reports in


class Runner:
    """Carries out calls one at a time, each in processes of the call uid forked by a zygote.

    Made before the preloads (its lean zygote has none); :meth:`fork_warm` after them.
    ``mark``: marks the runner's memory mergeable for KSM, before each zygote is forked (each
    inherits what is marked then)."""

    def __init__(
        self, workdir: str, uid: int, gid: int, scrub: list[str], mark: Callable[[], int] | None = None
    ) -> None:
        self.root = os.geteuid() == 0
        self.uid, self.gid = (uid, gid) if self.root else (os.getuid(), os.getgid())
        self.scrub, self.calls, self.proven_dead = scrub, 0, False
        if self.root and not os.path.isdir("/dev/shm"):
            # POSIX semaphores and shared memory (multiprocessing's SemLock) live there; the
            # sandbox's /dev is a small tmpfs of its own, and --scrub empties it after each call.
            os.makedirs("/dev/shm", exist_ok=True)
            os.chmod("/dev/shm", 0o1777)
        os.makedirs(workdir, exist_ok=True)
        os.chmod(workdir, 0o711)  # calls may pass through to their dir, not list or write here
        self.workdir = os.path.realpath(workdir)
        self.files = CallFiles(self.workdir, self.root, self.uid, self.gid)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        unshare = lambda: libc.unshare(CLONE_NEWNET | CLONE_NEWIPC)  # noqa: E731
        self.private_net = self.root and self._try_in_child(unshare)
        self.own_pid = os.getpid()
        self.zygote_dead = False  # one of them
        self.mark = mark
        self.lean = self.warm = self._exec_zygote()
        self.preloaded: list[str] = []
        if self.root and not self._try_in_child(self._kill_as_call_uid):
            raise OSError(f"cannot become uid {uid} / gid {gid} (setgroups, setgid, setuid)")
        if not self._cleanup(None) and self.root:  # also clears what an earlier runner left behind
            raise OSError(f"cannot start clean: processes of uid {uid} survive, or {workdir} stays non-empty")

    def _fork_zygote(self, others: list[_Zygote]) -> _Zygote:
        """The warm zygote: a fork of this runner, preloads and all."""
        if self.mark is not None:
            self.mark()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            for sock in (ours, *(z.sock for z in others)):
                sock.close()
            zygote(theirs, self.private_net, self.root)
        theirs.close()
        return _Zygote(pid, ours)

    def _exec_zygote(self) -> _Zygote:
        """The lean zygote: a fresh interpreter holding what a call process needs and nothing
        of this runner (zygote.py says why). OSError when it does not start."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        flags = (self.private_net, self.root, layout.own_layout, self.mark is not None)
        argv = [sys.executable, "-c", BOOT, _PACKAGE_ROOT, __package__, str(theirs.fileno())]
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                os.set_inheritable(theirs.fileno(), True)
                os.execv(sys.executable, argv + [str(int(f)) for f in flags])
            finally:
                os._exit(127)
        theirs.close()
        z = _Zygote(pid, ours)
        try:
            self._recv(z, _ZYGOTE_START_S)
        except CallFailed as exc:
            ours.close()
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise OSError(f"the lean zygote did not start: {exc}") from None
        self.zygote_dead = False
        return z

    def fork_warm(self, preloaded: list[str]) -> None:
        """After the preloads: the zygote of the calls that may use them. Without preloads the
        lean zygote serves every call."""
        self.preloaded = preloaded
        if preloaded:
            self.warm = self._fork_zygote([self.lean])

    @property
    def zygotes(self) -> list[_Zygote]:
        return [self.lean] if self.warm is self.lean else [self.lean, self.warm]

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

    def _recv(self, z: _Zygote, timeout: float) -> dict[str, Any]:
        if not select.select([z.sock], [], [], timeout)[0]:
            self.zygote_dead = True
            raise ZygoteLost("the zygote stopped answering")
        msg = z.sock.recv(1 << 16)
        if not msg:
            self.zygote_dead = True
            raise ZygoteLost("the zygote died")
        reply: dict[str, Any] = marshal.loads(msg)
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
        warm: bool = False,
    ) -> Proc:
        """Run one process of the call (argv None: main.py in this Python, forked from the
        ``warm`` zygote or the lean one); kill its leftovers."""
        if self.zygote_dead:
            raise ZygoteLost("the zygote is gone")
        z = self.warm if warm else self.lean
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
            socket.send_fds(z.sock, [marshal.dumps(req)], [mem, out_w, err_w, st_w])
        finally:
            for fd in (mem, out_w, err_w, st_w):
                os.close(fd)
        proc = Proc(out=Stream(out_r, cap), err=Stream(err_r, cap))
        streams = [proc.out, proc.err]
        try:
            pid = int(self._recv(z, 10.0)["pid"])
            if not pump(streams, start + timeout, z.sock):
                proc.timed_out = True
                for kill in (os.kill, os.killpg):  # not reaped yet: the pid is still this call's
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                pump(streams, time.monotonic() + 10.0, z.sock)
            report = self._recv(z, 0.0)
            proc.wall_s = time.monotonic() - start
            proc.status, proc.maxrss_kib, proc.cpu_s = report["status"], report["maxrss"], report["cpu"]
            # Background processes would hold the pipes open: kill them, unless none is left.
            self.proven_dead = self._none_left() or self._kill_all(pid)
            pump(streams, time.monotonic() + 2.0)
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
        child of its zygote. So when the runner (any of its threads: numpy's BLAS pool may adopt
        the orphan) has no child but the zygotes, and each zygote none but its spare (all uids 0,
        which no call can gain), zombies included, none of the call's processes exists and none
        can start again. Anything else, or a thread of the runner changing meanwhile, falls
        back to ``_kill_all``'s proof."""
        if not self.root:
            return False
        try:
            tasks = os.listdir(f"/proc/{self.own_pid}/task")
            for z in self.zygotes:
                spares = children(z.pid, os.listdir(f"/proc/{z.pid}/task"))
                if len(spares) > 1 or not all(all_root(pid) for pid in spares):
                    return False
            if sorted(children(self.own_pid, tasks)) != sorted(str(z.pid) for z in self.zygotes):
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
            self.zygote_dead = self.zygote_dead or any(pid == z.pid for z in self.zygotes)

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
            remove(cdir)
        absolute_undone = self.files.close_absolute()
        for entry in os.listdir(self.workdir):
            remove(os.path.join(self.workdir, entry))
        scrubbed = True
        for d in self.scrub if self.root else []:
            try:
                with os.scandir(d) as it:
                    mine = [e.path for e in it if e.stat(follow_symlinks=False).st_uid == self.uid]
            except OSError:
                continue
            for path in mine:
                remove(path)
                scrubbed = scrubbed and not os.path.lexists(path)
        # Without a private IPC namespace per call (a sandbox without CAP_SYS_ADMIN: every pool
        # sandbox), System V objects outlive the call, readable by the next one (same uid).
        ipc_gone = not self.root or self.private_net or self._drop_sysv_ipc()
        clean = procs_gone and scrubbed and absolute_undone and ipc_gone and not self.zygote_dead
        return clean and not os.listdir(self.workdir)

    def _drop_sysv_ipc(self) -> bool:
        """Remove the call uid's System V objects (no process of the call is alive, so a segment
        goes at once); True when none is left. A read of three /proc files when there is none."""
        if objects := sysv_ipc_of(self.uid):
            self._try_in_child(lambda: self._as_call_uid() or remove_sysv_ipc(objects))
        return not sysv_ipc_of(self.uid)

    def _as_call_uid(self) -> int:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)
        return 0

    def call(self, t: Task) -> dict[str, Any]:
        """One call, start to end: its FnResult, ``clean`` from the cleanup after it."""
        res = result("internal_error")
        self.calls += 1
        # os.urandom, not the secrets module: that imports random, whose hook reseeds it in
        # every forked child (os.register_at_fork), and each call process is one: on this PVM
        # host a bare fork and exit of the zygote went from 110 to 64 page faults, 1.0 to 0.7 ms
        # CPU (docs/decisions.md). A call that imports random still gets a fresh seed then.
        cdir = os.path.join(self.workdir, f"call-{self.calls}-{os.urandom(8).hex()}")
        try:
            self.files.prepare(cdir, t)
            self.files.open_absolute(t)
            argv = RUN_ARGV[t.language]
            if t.language in ("c", "cpp"):
                cc = ["gcc", "-std=c17"] if t.language == "c" else ["g++", "-std=c++17"]
                cc += ["-O2", "-o", "main", SOURCE[t.language], "-lm"]
                memory = None if t.memory_limit_mb is None else max(t.memory_limit_mb, COMPILE_MEMORY_MB)
                limits = rlimits(memory, t.compile_timeout_s)
                comp = self.spawn(cc, cdir, limits, b"", t.compile_timeout_s, t.max_output_bytes)
                res["compile_time_s"] = comp.wall_s
                if comp.marker.startswith(b"E"):
                    raise CallFailed(comp.marker[1:].decode(errors="replace"))
                if comp.timed_out or comp.status != 0:
                    why = f"\ncompilation timed out after {t.compile_timeout_s} s" if comp.timed_out else ""
                    code, sig = exit_code(comp.status)
                    res.update(status="compile_error", exit_code=code, signal=sig)
                    res.update(stdout=comp.out.text(), stderr=comp.err.text() + why)
                    return res
            limits = rlimits(t.memory_limit_mb, t.run_timeout_s)
            warm = argv is None and needs_preloads(t.code, self.preloaded)
            run = self.spawn(argv, cdir, limits, t.stdin, t.run_timeout_s, t.max_output_bytes, warm)
            if run.marker.startswith(b"E"):
                raise CallFailed(run.marker[1:].decode(errors="replace"))
            classify(res, run, t)
            res["files"], res["fetch_errors"] = fetch(cdir, t.fetch_files, self.uid)
        except TaskError as exc:
            res.update(status="internal_error", stderr=f"invalid task: {exc}")
        except (CallFailed, OSError) as exc:
            res.update(status="internal_error", stderr=f"runner: {exc}")
        finally:
            res["clean"] = self._cleanup(cdir)
        return res

    def close(self) -> None:
        self._kill_all(None)
        for z in self.zygotes:
            z.sock.close()  # EOF: the zygote exits
        for z in self.zygotes:
            os.waitpid(z.pid, 0)
        self._reap()
