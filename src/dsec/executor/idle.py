"""Whether a session shell is back in its driver loop, as the host's /proc shows it.

A session command runs inside the session shell (``eval``): whatever the driver prints, the
command can print as well, and it can even read its end marker's nonce off the command pipe
(the shell keeps its stdin on a saved fd during ``eval``, and /proc/$$/fd reaches it). What
it does not choose is what the kernel tells the edge about the shell: the system call it is
blocked in, with its arguments, stack pointer and instruction pointer (/proc/PID/syscall,
read by the edge as root). Between commands a bash or dash driver waits in read(2) of one
byte from its command pipe, at one point of its loop: the same line every time (measured
over varied commands: traps, ``set -x``, functions, background jobs, a grown environment),
recorded once before the first command. A command that reads the pipe itself blocks deeper
in the shell's stack (another SP); one that execs a program in the shell's place has other
addresses, unless it is built to map its stack and code at the recorded ones (what that and
other takeovers of a session still achieve is in docs/decisions.md).

Only shells known to wait that way are watched (busybox ash polls before it reads); the
others, and gVisor's (its sentry's processes are not the host's), are ended by the end
marker's secret nonce alone (:mod:`dsec.executor.session`). A microVM's guest agent watches its
shells the same way from the guest's /proc (:class:`ShellWatch`, PROTOCOL.md's WATCH).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import platform
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol, runtime_checkable

from dsec.executor.fdwait import fd_ready

log = logging.getLogger("dsec.executor")

_READ = {"x86_64": "0", "aarch64": "63"}.get(platform.machine())  # read(2)'s number
_SHELLS = frozenset({"bash", "dash"})
# From a no-op command's end to its shell's next wait: moments, but a microVM under TCG on a
# loaded host was seen past 10 s, and a shell not calibrated runs unwatched (markers only). A
# shell that cannot be watched answers at once (None), so only a slow one waits this long.
CALIBRATE_S = 30.0


@runtime_checkable
class HasShellPid(Protocol):
    """A session process that knows its shell's PID on this host (a container's, not runsc's)."""

    def shell_pid(self) -> int | None:
        """The shell's host PID while it runs, None once it is gone; never another process's
        (the shell is an unreaped child of the edge, so its PID is not reused meanwhile)."""
        ...


class ShellWatch(Protocol):
    """Where a session shell waits for its commands, as something outside the shell sees it."""

    async def calibrate(self) -> bool:
        """Record where the shell waits, right after a no-op command; False: not watched."""
        ...

    async def idle(self) -> bool | None:
        """The shell waits where it was recorded (True), does anything else (False), is gone (None)."""
        ...

    async def mark_end(self, token: bytes) -> tuple[bool, bool]:
        """``token`` behind all the shell wrote, on stdout and on stderr: whether each was sent."""
        ...


@runtime_checkable
class HasShellWatch(Protocol):
    """A session process watched by something other than this host's /proc (a guest agent)."""

    def shell_watch(self) -> ShellWatch | None:
        """Its watch, or None where it has none (an older agent)."""
        ...


async def until_waiting(probe: Callable[[], Awaitable[bool | None]]) -> bool:
    """Calibration's wait: ``probe`` until it finds the shell waiting (True), finds it cannot be
    watched or gone (None: False), or :data:`CALIBRATE_S` passed (False)."""
    deadline = asyncio.get_running_loop().time() + CALIBRATE_S
    for delay in backoff():
        found = await probe()
        if found is not False:
            return bool(found)
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(delay)
    return False  # pragma: no cover - backoff() never ends


def backoff() -> Iterator[float]:
    """Delays between looks at a shell that is not waiting yet: a few loop turns (it is
    usually microseconds from its read), then 1 ms doubling to 50 ms (a command that printed
    a marker and runs on: at most 20 looks a second, each one small read)."""
    return itertools.chain(itertools.repeat(0.0, 32), (min(0.001 * 2**i, 0.05) for i in itertools.count()))


class ShellView:
    """The /proc view of one session shell: where it waits for commands, and its output pipes."""

    def __init__(self, pid_of: Callable[[], int | None]) -> None:
        self._pid_of = pid_of
        self._pipes: tuple[str, ...] = ()  # what fds 0-2 were at spawn: pipe:[inode]
        self._waiting: tuple[str, ...] = ()  # its /proc/PID/syscall line waiting for a command
        self._pid: int | None = None  # as :meth:`idle` last found it

    @classmethod
    def of(cls, proc: HasShellPid) -> ShellView | None:
        """A view of ``proc``'s shell, to :meth:`calibrate`; None where it cannot be watched
        (a shell that waits otherwise, another architecture, a shell already gone)."""
        pid = proc.shell_pid()
        if _READ is None:
            return None
        if pid is None:
            log.warning("a session shell ended before it could be watched")
            return None
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            pipes = tuple(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in range(3))
        except OSError as exc:
            # Unexpected: its commands now end at the end marker's nonce alone.
            log.warning("session shell %d cannot be watched: %s", pid, exc)
            return None
        if exe not in _SHELLS or not all(p.startswith("pipe:") for p in pipes):
            return None
        view = cls(proc.shell_pid)
        view._pipes = pipes
        return view

    async def calibrate(self) -> bool:
        """Record where the shell waits for its next command, before any caller's command ran
        in it (after a no-op: it is moments from there). False if it never got there within
        :data:`CALIBRATE_S`: then it is not watched."""
        pid = self._pid_of()
        if pid is None:
            return False

        async def waiting() -> bool | None:
            line = _blocked(pid)
            if line is not None and line[0] == _READ and self._fd_is(pid, line[1], 0):
                self._waiting = line
                return True
            return None if self._pid_of() is None else False

        if await until_waiting(waiting):
            return True
        log.warning("session shell %d never waited for a command: no idle checks", pid)
        return False

    async def idle(self) -> bool | None:
        """True if the shell waits for its next command exactly where its driver loop does;
        False if it does anything else; None if it is gone (nothing more can come from it)."""
        pid = self._pid = self._pid_of()
        if pid is None:
            return None
        line = _blocked(pid)
        return line is not None and line == self._waiting and self._fd_is(pid, line[1], 0)

    async def mark_end(self, token: bytes) -> tuple[bool, bool]:
        """Write ``token`` (at most PIPE_BUF: one atomic write) into the shell's stdout and
        stderr pipes, behind everything the shell wrote, once :meth:`idle` found it waiting.
        For each: False if its fd is no longer the pipe the edge reads (``exec >file``)."""
        pid = self._pid
        return (
            pid is not None and await _send(pid, 1, self._pipes[1], token),
            pid is not None and await _send(pid, 2, self._pipes[2], token),
        )

    def _fd_is(self, pid: int, fd: str, which: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/fd/{int(fd, 16)}") == self._pipes[which]
        except (OSError, ValueError):
            return False


def _blocked(pid: int) -> tuple[str, ...] | None:
    """The call ``pid`` is blocked in: number, fd, buffer, count, stack and instruction
    pointers (the other three arguments are whatever the registers held); None if running."""
    try:
        fd = os.open(f"/proc/{pid}/syscall", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fields = os.read(fd, 256).decode().split()
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(fields) != 9:  # "running", or "-1 SP PC": stopped outside any call
        return None
    return (*fields[:4], *fields[7:])


async def _send(pid: int, fd: int, pipe: str, data: bytes) -> bool:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != pipe:
            return False
        out = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        while True:
            try:
                os.write(out, data)
                return True
            except BlockingIOError:
                await fd_ready(out, write=True)  # full: the edge's readers are emptying it
    finally:
        os.close(out)


class ShellExit:
    """A session shell's end, seen through a pidfd held while one of its commands runs (an
    idle shell holds none): its pipes may outlive it, held by a background job it started."""

    def __init__(self, pidfd: int, changed: asyncio.Event) -> None:
        self._fd = pidfd
        self._task = asyncio.ensure_future(fd_ready(pidfd))  # readable once it exited
        self._task.add_done_callback(lambda _: changed.set())

    @staticmethod
    @contextlib.asynccontextmanager
    async def watch(proc: object, changed: asyncio.Event) -> AsyncIterator[Callable[[], bool]]:
        """Whether the shell has exited, for a shell with a PID on this host (always False for
        the others: their output streams end with them, or their agent says)."""
        # One check: a runtime Protocol's isinstance reads its members each time (~10 us).
        knows_pid, pid = (True, proc.shell_pid()) if isinstance(proc, HasShellPid) else (False, None)
        if pid is None:
            gone = knows_pid  # such a shell has no PID once it ended
            yield lambda: gone
            return
        try:
            # Unreaped (the edge's child), so the PID is still the shell's, dead or alive.
            watch = ShellExit(os.pidfd_open(pid), changed)
        except ProcessLookupError:
            yield lambda: True
            return
        try:
            yield watch._task.done
        finally:
            await watch.close()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task  # its reader off the loop before the fd closes
        os.close(self._fd)
