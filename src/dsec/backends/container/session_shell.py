"""A session shell in a container sandbox, as the edge holds it: the edge's own child (forked
for it by ``dsec-enter --hold-stdin``, see :func:`dsec.native.enter.spawn_session`),
whose stdout and stderr are pipes the edge reads when it waits for a command's output, and
whose stdin's write end the shell itself keeps at fd 9, opened by the edge through /proc for
each command."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from dsec.executor.fdwait import PipeReader, fd_ready
from dsec.executor.process import RestingChild, kill_tree, watch_child

if TYPE_CHECKING:
    from dsec.backends.container.command_cgroup import CommandCgroup

SESSION_STDIN_FD = 9  # where a session shell keeps the write end of its stdin (dsec_enter.c)


class SessionShell(RestingChild):
    """A session shell started by :func:`spawn_session`, as a :class:`SandboxProcess`: the
    edge's child, which the edge reaps itself; its output pipes read on demand."""

    def __init__(
        self,
        pid: int,
        group: int,
        pipe: int,
        stdout: PipeReader,
        stderr: PipeReader,
        *,
        cgroup: CommandCgroup | None = None,
    ) -> None:
        super().__init__(pid)
        self._group = group  # the process group the helper made, the shell's (the helper's PID)
        self._cgroup = cgroup  # the shell's and all it starts (enter.CommandCgroup)
        self.stdout, self.stderr = stdout, stderr
        self.stdin = HeldStdin(f"/proc/{pid}/fd/{SESSION_STDIN_FD}", pipe)
        self.stdin.ended = lambda: self.returncode is not None
        self.stdin.let_go = self.let_go

    def shell_pid(self) -> int | None:
        """The shell's host PID while it runs (unreaped: the PID names no other process)."""
        return self.pid if self.returncode is None else None

    def kill(self) -> None:
        if self._code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def kill_tree(self) -> None:
        """The shell, what it started and the helper's process group (the shell's); with a
        cgroup of its own, all in it (what left the group or the tree too)."""
        if self._code is None:  # unreaped, so the group (the helper's PID) is still the shell's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._group, signal.SIGKILL)
            kill_tree(self.pid)
        if self._cgroup is not None:
            self._cgroup.kill()

    async def wait(self) -> int:
        code = await super().wait()
        if self._cgroup is not None:
            self._cgroup.remove()  # once what it started ended too; else at the destroy
        return code

    def let_go(self) -> None:
        """The shell ends (killed alone, so what it runs in the background lives on)."""
        self.kill()
        watch_child(self.pid)  # reaped when it ends, not left a zombie


class HeldStdin:
    """A session shell's stdin, whose write end a process of the edge holds (the shell itself,
    or gVisor's ``runsc exec``): opened through ``path`` (/proc/PID/fd/N) per command, safe
    while that PID is unreaped, and checked to be that pipe (inode ``pipe``: a command may have
    replaced the fd). ``ended`` says whether the shell ended; closing calls ``let_go``."""

    def __init__(self, path: str, pipe: int) -> None:
        self._path = path
        self._pipe = pipe
        self._buf = bytearray()
        self.ended: Callable[[], bool] = lambda: False
        self.let_go: Callable[[], None] = lambda: None

    def write(self, data: bytes) -> None:
        self._buf += data

    async def drain(self) -> None:
        data, self._buf = bytes(self._buf), bytearray()
        try:
            if self.ended():
                raise OSError("exited")
            fd = os.open(self._path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise BrokenPipeError(f"session shell gone: {exc}") from exc
        try:
            if os.fstat(fd).st_ino != self._pipe:
                raise BrokenPipeError(f"{self._path} is no longer the session shell's stdin")
            await _write_all(fd, data)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.let_go()


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await fd_ready(fd, write=True)
