"""Child processes of the edge, forked by a helper with a small fd table: ``dsec-spawn``.

A fork copies the parent's fd table and the child then closes every inherited fd (close_range
in Python's child, or close-on-exec at execve): per spawn, work proportional to the fds the
edge holds. At 8,000 held sandboxes the edge holds ~16,000 fds and this was ~8 ms of each
create (perf: ``dnotify_flush``/``filp_flush`` under ``close_range`` in the edge's children).
``dsec_spawn.c`` is started once, while the table is small; it receives each request
and the child's fds over a SOCK_SEQPACKET socket and forks with CLONE_PARENT, so the process is
still the edge's child: asyncio's child watcher waits for it, PR_SET_PDEATHSIG in it follows
the edge, and nothing else about the process changes.

:func:`spawn_adopted` is the exception, for launchers that leave processes behind (``crun run
--detach`` leaves the sandbox's init): the child is the spawner's own, and the spawner, a child
subreaper, reaps what it leaves; the host's init no longer adopts every sandbox's init.

:func:`create_subprocess_exec` is a drop-in for :func:`asyncio.create_subprocess_exec` (stdin,
stdout, stderr, env, cwd, pass_fds, start_new_session). It reuses asyncio's own subprocess
transport and only replaces the fork (Popen's ``_execute_child``), so pipes, waiting and
killing behave exactly as asyncio's; those are private names of Python 3.11's asyncio, which is
why they are all in this module. Without a started spawner it is asyncio's own function.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import threading
from asyncio import unix_events
from pathlib import Path
from typing import Any

from dsec.executor.fdwait import fd_ready
from dsec.native.build import Program

SOURCE = Path(__file__).with_name("dsec_spawn.c")
NAME = "dsec-spawn"
PROGRAM = Program(NAME, SOURCE)
_STAGES = {1: "chdir", 2: "exec", 3: "setting up the child's fds"}


class Spawner:
    """One running ``dsec-spawn`` and the socket to it."""

    def __init__(self, helper: Path) -> None:
        self.helper = helper
        self.owner = os.getpid()  # a forked copy of the edge must not use it (CLONE_PARENT)
        self._lock = threading.Lock()  # one request at a time (subprocess may run in threads)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [str(helper), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env={},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours

    def spawn(
        self,
        exe: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        fds: dict[int, int],
        setsid: bool,
    ) -> int:
        """Start ``exe`` with ``argv`` and exactly ``env``; ``fds`` maps fd numbers in the child
        to the edge's fds. The child's PID, the edge's to reap; OSError as Popen raises it."""
        pid, err, stage, _ = self._request(1 if setsid else 0, exe, argv, env, cwd, fds, None)
        if err:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # it exits 127 at once
            raise _spawn_error(err, stage, exe, cwd)
        return pid

    def spawn_adopted(
        self, exe: str, argv: list[str], env: dict[str, str], fds: dict[int, int], setsid: bool
    ) -> Adopted:
        """:meth:`spawn`, but the child is the helper's (see :class:`Adopted`)."""
        status_r, status_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            flags = 2 | (1 if setsid else 0)  # 2: adopt
            pid, err, stage, pidfd = self._request(flags, exe, argv, env, None, fds, status_w)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        if err or pidfd is None:
            os.close(status_r)
            if pidfd is not None:
                os.close(pidfd)
            raise _spawn_error(err or errno.EPROTO, stage, exe, None)
        return Adopted(pid, pidfd, status_r)

    def _request(
        self,
        flags: int,
        exe: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        fds: dict[int, int],
        status_fd: int | None,
    ) -> tuple[int, int, int, int | None]:
        fields = [
            str(flags),
            cwd or "",
            exe,
            str(len(argv)),
            *argv,
            str(len(env)),
            *(f"{k}={v}" for k, v in env.items()),
            str(len(fds)),
            *(str(target) for target in fds),
        ]
        if any("\0" in f for f in fields):
            raise ValueError("embedded null byte")
        body = b"".join(os.fsencode(f) + b"\0" for f in fields)
        sent = [*fds.values(), *([] if status_fd is None else [status_fd])]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))] if sent else []
        with self._lock:
            self._sock.sendmsg([body], rights)
            answer, got, _, _ = socket.recv_fds(self._sock, 64, 1)
        if not answer:
            raise OSError(f"{NAME} exited")
        pid, err, stage = (int(x) for x in answer.split())
        if pid < 0:
            for fd in got:
                os.close(fd)
            raise OSError(err, f"{NAME}: {os.strerror(err)}")
        return pid, err, stage, got[0] if got else None

    def close(self) -> None:
        self._sock.close()  # it exits at EOF
        self._proc.wait()


def _spawn_error(err: int, stage: int, exe: str, cwd: str | None) -> OSError:
    return OSError(err, f"{os.strerror(err)} ({_STAGES.get(stage, 'spawn')})", cwd if stage == 1 else exe)


class Adopted:
    """A child of the spawner's rather than of the edge: what it leaves behind when it exits
    (crun's and runsc's detached sandbox processes) is reparented to the spawner, a child
    subreaper, which reaps it. The spawner reports the child's own exit to :meth:`wait`;
    :attr:`pidfd` stays this process's until then (it cannot be reaped and its PID reused
    unnoticed)."""

    def __init__(self, pid: int, pidfd: int, status_fd: int) -> None:
        self.pid, self.pidfd, self._status = pid, pidfd, status_fd
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Its exit code as Popen gives it (-N: killed by signal N). OSError when the spawner
        died before it could say."""
        if self.returncode is None:
            said = b""
            while not said.endswith(b"\n"):
                await fd_ready(self._status)
                try:
                    chunk = os.read(self._status, 64)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise OSError(errno.ECHILD, f"{NAME} exited before reporting process {self.pid}")
                said += chunk
            self.returncode = os.waitstatus_to_exitcode(int(said))
            self.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        for fd in (self.pidfd, self._status):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pidfd = self._status = -1


_spawner: Spawner | None = None


def build_helper(bin_dir: Path) -> Path:
    """Compile ``dsec-spawn`` (static, once per source version) into ``bin_dir``."""
    return PROGRAM.build(bin_dir)


def start(helper: Path) -> None:
    """Start this process's spawner, unless one runs: early, while few fds are open, and from
    the thread that runs the event loop (children's PR_SET_PDEATHSIG follow the thread that
    forked the spawner). It lives until the process exits."""
    global _spawner
    if _spawner is None or _spawner.owner != os.getpid() or _spawner._proc.poll() is not None:
        if _spawner is None:
            atexit.register(stop)
        _spawner = Spawner(helper)


def stop() -> None:
    global _spawner
    if _spawner is not None and _spawner.owner == os.getpid():
        spawner, _spawner = _spawner, None
        spawner.close()


def _running() -> Spawner | None:
    """This process's spawner, started again if it died (killed by hand, or an OOM kill);
    None when there is none (or this is a fork of the process that started it)."""
    if _spawner is None or _spawner.owner != os.getpid():
        return None
    if _spawner._proc.poll() is not None:
        start(_spawner.helper)
    return _spawner


def spawn_adopted(
    exe: str, argv: list[str], env: dict[str, str], fds: dict[int, int], *, setsid: bool = False
) -> Adopted | None:
    """Start ``exe`` (an absolute path) as the spawner's child: :class:`Adopted`. None when
    no spawner runs."""
    spawner = _running()
    return None if spawner is None else spawner.spawn_adopted(exe, argv, env, fds, setsid)


def spawn_unwatched(
    exe: str, argv: list[str], env: dict[str, str], fds: dict[int, int], *, setsid: bool
) -> int | None:
    """Fork ``exe`` (an absolute path) as the edge's child without asyncio watching it: the
    caller reaps it (:class:`dsec.executor.process.RestingChild`). ``fds`` maps fd numbers
    in the child to the edge's. None when no spawner runs."""
    spawner = _running()
    return None if spawner is None else spawner.spawn(exe, argv, env, None, fds, setsid)


class _SpawnedPopen(subprocess.Popen[bytes]):
    """Popen whose child comes from the spawner; everything after the fork is Popen's."""

    def _execute_child(
        self,
        args: list[str],
        executable: str | None,
        preexec_fn: object,
        close_fds: bool,
        pass_fds: tuple[int, ...],
        cwd: str | None,
        env: dict[str, str] | None,
        startupinfo: object,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *rest: Any,
    ) -> None:
        start_new_session = rest[5]
        spawner = _running()
        assert spawner is not None and preexec_fn is None and not shell
        env = dict(os.environ if env is None else env)
        argv = [os.fsdecode(a) for a in args]
        exe = os.fsdecode(executable or argv[0])
        found = exe if os.path.dirname(exe) else shutil.which(exe, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(2, f"No such file or directory: {exe!r}", exe)
        # Unset stdio is inherited, as from a fork of the edge.
        fds = {0: p2cread if p2cread >= 0 else 0, 1: c2pwrite if c2pwrite >= 0 else 1}
        fds[2] = errwrite if errwrite >= 0 else 2
        fds.update({fd: fd for fd in pass_fds})
        try:
            self.pid = spawner.spawn(
                os.path.abspath(found), argv, env, cwd and os.fsdecode(cwd), fds, start_new_session
            )
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]


class _SpawnedTransport(unix_events._UnixSubprocessTransport):  # type: ignore[name-defined,misc]
    def _start(
        self, args: list[str], shell: bool, stdin: Any, stdout: Any, stderr: Any, bufsize: int, **kw: Any
    ) -> None:
        self._proc = _SpawnedPopen(args, stdin=stdin, stdout=stdout, stderr=stderr, bufsize=bufsize, **kw)


async def create_subprocess_exec(
    program: str | Path,
    *args: str | Path,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    limit: int = 2**16,
    **kwds: Any,
) -> asyncio.subprocess.Process:
    """:func:`asyncio.create_subprocess_exec`, forked by the spawner when one runs."""
    if _running() is None:
        return await asyncio.create_subprocess_exec(
            program, *args, stdin=stdin, stdout=stdout, stderr=stderr, limit=limit, **kwds
        )
    loop = asyncio.get_running_loop()
    protocol = asyncio.subprocess.SubprocessStreamProtocol(limit=limit, loop=loop)
    # As BaseEventLoop.subprocess_exec and _UnixSelectorEventLoop._make_subprocess_transport.
    waiter = loop.create_future()
    with asyncio.get_child_watcher() as watcher:
        argv = [str(a) for a in (program, *args)]
        transport = _SpawnedTransport(
            loop, protocol, argv, False, stdin, stdout, stderr, 0, waiter=waiter, **kwds
        )
        watcher.add_child_handler(transport.get_pid(), loop._child_watcher_callback, transport)  # type: ignore[attr-defined]
        try:
            await waiter
        except BaseException:
            transport.close()
            await transport._wait()
            raise
    return asyncio.subprocess.Process(transport, protocol, loop)
