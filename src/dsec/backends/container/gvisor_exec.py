"""Processes in gVisor sandboxes: ``runsc exec`` for each, since nothing inside is a host process.

:func:`spawn` starts a command and returns once it runs (its PID inside comes back through a
FIFO given as runsc's internal PID file: no polling). :class:`GVisorProcess` is it as the edge
drives it: stdio and host PID are those of its ``runsc exec``, the exit code is the command's,
and signals go to the process inside through ``runsc kill`` (killing ``runsc exec`` would leave
it running). :func:`spawn_session` starts a session shell at 2 of the edge's fds, as crun's
(``enter.spawn_session``), rather than the 4 of a plain spawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from dsec.backends.base import User
from dsec.backends.container import oci
from dsec.backends.container.gvisor import ENV, GVisor, run_quietly
from dsec.backends.container.session_shell import SESSION_STDIN_FD, HeldStdin
from dsec.executor.fdwait import PipeReader, fd_ready
from dsec.executor.process import ByteStream, ProcessStdin, RestingChild, watch_child
from dsec.native import spawner
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

EXEC_NOT_STARTED = 127  # runsc could not start the command (missing program, bad cwd): a shell's 127
_SPEC_FD = 3  # the process spec, in a session's runsc exec
_background: set[asyncio.Task[None]] = set()


async def spawn(
    gv: GVisor,
    sandbox_id: str,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    stdin: int = asyncio.subprocess.PIPE,
    raise_signal: bool = False,
    tty: int | None = None,
) -> GVisorProcess:
    """``argv`` in the sandbox through ``runsc exec``, which relays its stdio (the pipes the
    edge holds) and its exit code; returns once the command runs (or failed to start: then it
    has exited with 127 and runsc's message on its stderr).

    ``tty``: the slave of a host pseudo-terminal, the command's stdio. runsc hands it to the
    sentry as the command's terminal (size, modes and input are the host's line discipline),
    and, holding it as its own controlling terminal (``setsid --ctty``), passes on what that
    terminal signals (^C, SIGWINCH) to the foreground process group inside."""
    async with _exec_files(gv, argv, env, cwd, user, terminal=tty is not None) as (spec_fd, fifo, pid_r):
        # A session of its own either way: the edge's process group tests and kills see runsc.
        proc = await asyncio.create_subprocess_exec(
            *(["setsid", "--ctty"] if tty is not None else []),
            *_exec_argv(gv, f"/proc/self/fd/{spec_fd}", fifo, sandbox_id),
            stdin=stdin if tty is None else tty,
            stdout=asyncio.subprocess.PIPE if tty is None else tty,
            stderr=asyncio.subprocess.PIPE if tty is None else tty,
            env=ENV,
            pass_fds=(spec_fd,),
            start_new_session=tty is None,  # setsid(1) makes it, then takes the terminal
        )
        inner = await _pid_or_exit(pid_r, proc.wait())
    return GVisorProcess(gv, sandbox_id, proc, inner, raise_signal=raise_signal)


async def spawn_session(
    gv: GVisor, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str, user: User
) -> GVisorProcess:
    """A session shell at 2 of the edge's fds, as crun's: its stdout and stderr pipes. ``runsc
    exec`` itself holds the write end of the shell's stdin (at fd 9, which it never hands
    inside), and the edge opens it through /proc per command; the spawner forks runsc as the
    edge's child, reaped with no pidfd while the shell idles. runsc exec dies with the edge
    (``setpriv --pdeathsig``), and with it the only write end of the shell's stdin: the shell
    reads EOF and ends. Without a spawner (no node prepared), a plain :func:`spawn`."""
    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    ours = {stdin_r, stdin_w, out_r, out_w, err_r, err_w}  # closed at the end unless handed on
    try:
        pipe = os.fstat(stdin_w).st_ino
        async with _exec_files(gv, argv, env, cwd, user) as (spec_fd, fifo, pid_r):
            exec_argv = _exec_argv(gv, f"/proc/self/fd/{_SPEC_FD}", fifo, sandbox_id)
            argv_ = [
                shutil.which("setpriv", path=ENV["PATH"]) or "setpriv",
                "--pdeathsig",
                "KILL",
                *exec_argv,
            ]
            fds = {0: stdin_r, 1: out_w, 2: err_w, _SPEC_FD: spec_fd, SESSION_STDIN_FD: stdin_w}
            pid = spawner.spawn_unwatched(argv_[0], argv_, ENV, fds, setsid=True)
            if pid is None:
                return await spawn(gv, sandbox_id, argv, env=env, cwd=cwd, user=user)
            for fd in (stdin_r, stdin_w, out_w, err_w):  # runsc exec has its own copies
                os.close(fd)
                ours.discard(fd)
            inner = await _pid_or_exit(pid_r, _exit_of(pid))
        held = HeldStdin(f"/proc/{pid}/fd/{SESSION_STDIN_FD}", pipe)
        ours -= {out_r, err_r}  # the readers own them now (read on demand, as crun sessions')
        runsc_exec = _RestingExec(pid, held, PipeReader(out_r), PipeReader(err_r))
        proc = GVisorProcess(gv, sandbox_id, runsc_exec, inner, raise_signal=False)
        held.let_go = proc.let_go
        return proc
    finally:
        for fd in ours:
            os.close(fd)


@contextlib.asynccontextmanager
async def _exec_files(
    gv: GVisor, argv: list[str], env: dict[str, str], cwd: str, user: User, *, terminal: bool = False
) -> AsyncIterator[tuple[int, Path, int]]:
    """What a ``runsc exec`` needs: the process spec in a memfd (the command and its
    environment stay off command lines), and a FIFO for its internal PID file with our
    non-blocking read end (runsc's write of it says the command started)."""
    if gv.runsc is None:
        raise InfraFailure("runsc is not installed", reason=InfraReason.runtime)
    process = json.dumps(_process_spec(argv, env, cwd, user, terminal=terminal)).encode()
    gv.scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=gv.scratch))
    spec_fd = os.memfd_create("dsec-gvisor-process", os.MFD_CLOEXEC)
    try:
        os.write(spec_fd, process)
        fifo = tmp / "pid"
        os.mkfifo(fifo, 0o600)
        pid_r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            yield spec_fd, fifo, pid_r
        finally:
            os.close(pid_r)
    finally:
        os.close(spec_fd)
        shutil.rmtree(tmp, ignore_errors=True)


def _exec_argv(gv: GVisor, spec: str, pid_file: Path, sandbox_id: str) -> list[str]:
    return [*gv.base_argv(), "exec", "--process", spec, "--internal-pid-file", str(pid_file), sandbox_id]


async def signal_inside(gv: GVisor, sandbox_id: str, pid: int, sig: int, *, tree: bool) -> None:
    """``sig`` to ``pid`` (a PID inside) and, with ``tree``, to every descendant, through runsc
    (the host cannot signal what lives in the sentry). A SIGKILL of a tree repeats until no
    descendant is left (a process may fork meanwhile)."""
    for _ in range(5 if tree and sig == signal.SIGKILL else 1):
        victims = [pid, *(await _descendants(gv, sandbox_id, pid) if tree else [])]
        await asyncio.gather(
            *(
                run_quietly([*gv.base_argv(), "kill", "--pid", str(v), sandbox_id, str(int(sig))])
                for v in victims
            )
        )
        if not tree or len(victims) == 1:
            return


async def _descendants(gv: GVisor, sandbox_id: str, pid: int) -> list[int]:
    proc = await asyncio.create_subprocess_exec(
        *gv.base_argv(),
        "ps",
        sandbox_id,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=ENV,
    )
    out, _ = await proc.communicate()
    children: dict[int, list[int]] = {}
    for line in out.decode(errors="replace").splitlines()[1:]:
        fields = line.split()  # UID PID PPID ... CMD: the command, last, cannot shift these
        if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
            children.setdefault(int(fields[2]), []).append(int(fields[1]))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _process_spec(
    argv: list[str], env: dict[str, str], cwd: str, user: User, *, terminal: bool = False
) -> dict[str, Any]:
    if not argv:
        raise InvalidRequest("an empty command")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidRequest(f"bad environment variable {key!r}")
    if any("\0" in a for a in argv):
        raise InvalidRequest("a NUL byte in the command")
    caps = list(oci.CAPABILITIES)
    # As an exec of a non-root user: the bounding set only, nothing effective.
    capabilities = (
        {"bounding": caps, "effective": caps, "permitted": caps} if user.uid == 0 else {"bounding": caps}
    )
    return {
        "args": argv,
        "env": [f"{k}={v}" for k, v in env.items()],
        "cwd": cwd,
        "user": {"uid": user.uid, "gid": user.gid},
        "terminal": terminal,
        "noNewPrivileges": True,
        "capabilities": capabilities,
    }


async def _pid_or_exit(fd: int, exit_: Awaitable[Any]) -> int | None:
    """The PID runsc writes into the FIFO ``fd``, or None when runsc exits (``exit_``) without
    (the command never started)."""
    loop = asyncio.get_running_loop()
    reported: asyncio.Future[bytes] = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        try:
            while chunk := os.read(fd, 64):
                chunks.append(chunk)
        except BlockingIOError:
            return
        except OSError:
            pass
        if not reported.done():
            reported.set_result(b"".join(chunks))

    loop.add_reader(fd, readable)
    exited: asyncio.Future[Any] = asyncio.ensure_future(exit_)
    try:
        await asyncio.wait([reported, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
        if not exited.done():
            exited.cancel()
    text = reported.result().strip() if reported.done() else b""
    return int(text) if text.isdigit() else None


async def _exit_of(pid: int) -> None:
    """Until the child ``pid`` exits, through a pidfd of our own (not reaped: its watcher will)."""
    pidfd = os.pidfd_open(pid)
    try:
        await fd_ready(pidfd)
    finally:
        os.close(pidfd)


class _RestingExec(RestingChild):
    """A session's ``runsc exec``: the edge's child by the spawner, reaped by the edge itself
    with no pidfd while the shell idles."""

    def __init__(self, pid: int, stdin: HeldStdin, stdout: PipeReader, stderr: PipeReader) -> None:
        super().__init__(pid)
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        stdin.ended = lambda: self.returncode is not None


class GVisorProcess:
    """A process in a gVisor sandbox as the edge drives it (:class:`SandboxProcess`): stdio,
    ``pid`` and the process group are those of its ``runsc exec`` on the host, the exit code
    is the command's; killing and signalling go to the process inside, through runsc."""

    def __init__(
        self,
        gvisor: GVisor,
        sandbox_id: str,
        proc: asyncio.subprocess.Process | _RestingExec,
        inner_pid: int | None,
        *,
        raise_signal: bool,
    ) -> None:
        self._gvisor = gvisor
        self._sandbox_id = sandbox_id
        self._proc = proc
        self.inner_pid = inner_pid
        self._raise_signal = raise_signal

    @property
    def stdin(self) -> ProcessStdin | None:
        return self._proc.stdin

    @property
    def stdout(self) -> ByteStream | None:
        return self._proc.stdout

    @property
    def stderr(self) -> ByteStream | None:
        return self._proc.stderr

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        code = self._proc.returncode
        if code is None:
            return None
        if self.inner_pid is None and code == 128:
            return EXEC_NOT_STARTED
        # runsc reports a death by signal N as 128+N (it cannot die of it itself); a held
        # process reports -N (an `exit 130` reads as SIGINT: runsc does not tell them apart).
        if self._raise_signal and 128 < code <= 128 + 64:
            return 128 - code
        return code

    async def wait(self) -> int:
        await self._proc.wait()
        code = self.returncode
        assert code is not None
        return code

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        assert isinstance(self._proc, asyncio.subprocess.Process)
        out, err = await self._proc.communicate(input)
        return out, err

    def send_signal(self, sig: int, *, tree: bool = False) -> None:
        if self.inner_pid is None or self._proc.returncode is not None:
            return
        task = asyncio.get_running_loop().create_task(
            signal_inside(self._gvisor, self._sandbox_id, self.inner_pid, sig, tree=tree)
        )
        _background.add(task)
        task.add_done_callback(_background.discard)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_tree(self) -> None:
        """SIGKILL the process and its descendants inside; runsc exec then ends by itself."""
        self.send_signal(signal.SIGKILL, tree=True)

    def let_go(self) -> None:
        """The session ends: its shell is killed alone (what it runs in the background lives
        on), and its runsc exec, which then ends, is reaped."""
        self.kill()
        watch_child(self.pid)
