"""Processes the edge started inside a sandbox: capped output, timeouts, killing whole trees.

The edge holds every pipe. Output past the cap is read and dropped (never buffered, never
written to disk), so ``yes`` costs CPU until its timeout but no memory or disk.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Literal, Protocol

from dsec.protocol.models import CommandResult, ExecEvent

DEFAULT_MAX_OUTPUT = 1 << 20
CHUNK = 1 << 16


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (depth first), read from /proc/<pid>/task/*/children."""
    out: list[int] = []
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{current}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in children:
                out.append(int(child))
                stack.append(int(child))
    return out


class ProcessStdin(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class ByteStream(Protocol):
    """A process's output as the edge reads it: :class:`asyncio.StreamReader`, or a session
    shell's :class:`dsec.executor.fdwait.PipeReader`. b"" at its end."""

    async def read(self, n: int = -1) -> bytes: ...


class SandboxProcess(Protocol):
    """A process in a sandbox as the edge drives it: :class:`asyncio.subprocess.Process` for a
    container, :class:`dsec.backends.microvm.channel.VmProcess` for a microVM. A process that
    is not on this host has a ``kill_tree`` method of its own (see :func:`kill_process_tree`)."""

    @property
    def stdin(self) -> ProcessStdin | None: ...

    @property
    def stdout(self) -> ByteStream | None: ...

    @property
    def stderr(self) -> ByteStream | None: ...

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


def kill_process_tree(proc: SandboxProcess) -> None:
    """SIGKILL ``proc`` with its group and descendants, wherever it runs."""
    own: Callable[[], None] | None = getattr(proc, "kill_tree", None)
    if own is not None:
        own()
    else:
        kill_tree(proc.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant, even those that left the group."""
    victims = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for victim in [pid, *victims]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


class CappedBuffer:
    """Keeps the first ``cap`` bytes written and remembers whether anything was dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> bytes:
        """Store what fits; return the part that was kept (for streaming it on)."""
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk
        return chunk

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


async def run_streaming(
    proc: SandboxProcess,
    *,
    stdin: bytes | None,
    timeout: float | None,
    max_output: int,
    oom_kills: Callable[[], int],
) -> AsyncGenerator[ExecEvent, None]:
    """Drive a spawned process to its end, yielding output events and then one ``exit`` event.

    The exit event's result carries no output: the events before it were the output.
    """
    started = time.monotonic()
    oom_before = oom_kills()
    out, err = CappedBuffer(max_output), CappedBuffer(max_output)
    queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue(maxsize=64)

    async def pump(stream: ByteStream | None, buf: CappedBuffer, kind: Literal["out", "err"]) -> None:
        assert stream is not None
        # 32 KiB reads keep each NDJSON event line (base64) well under HTTP line limits.
        while chunk := await stream.read(CHUNK // 2):
            kept = buf.add(chunk)
            if kept:
                await queue.put(ExecEvent(t=kind, d=base64.b64encode(kept).decode()))

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    async def drive() -> None:
        try:
            await asyncio.gather(feed(), pump(proc.stdout, out, "out"), pump(proc.stderr, err, "err"))
            await proc.wait()
        finally:
            await queue.put(None)

    task = asyncio.create_task(drive())
    deadline = None if timeout is None else started + timeout
    timed_out = False
    try:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                timed_out = True
                kill_process_tree(proc)
                # Drain what the dying tree still wrote; the pipes close once it is gone.
                while (event := await queue.get()) is not None:
                    yield event
                break
            if event is None:
                break
            yield event
    finally:
        if not task.done():
            kill_process_tree(proc)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    code = await proc.wait()
    yield ExecEvent(
        t="exit",
        result=CommandResult(
            exit_code=None if timed_out else shell_exit_code(code),
            timed_out=timed_out,
            oom_killed=oom_kills() > oom_before,
            truncated=out.truncated or err.truncated,
            duration_s=time.monotonic() - started,
        ),
    )


def watch_children_with_pidfds() -> None:
    """Have asyncio wait for child processes through pidfds rather than a thread each.

    Python 3.11's default watcher parks one thread per live child in waitpid(); a node holding
    thousands of session shells then has thousands of threads, and every later fork (each
    create) copies their stacks' mappings: create went from 38 ms to 90 ms at 1,500 sessions.
    With pidfds it stays at 43 ms (bench/density.py), at one file descriptor per child.
    """
    if not isinstance(asyncio.get_child_watcher(), _PidfdWatcher):
        asyncio.set_child_watcher(_PidfdWatcher())


def _watcher() -> _PidfdWatcher | None:
    watcher = asyncio.get_child_watcher()
    return watcher if isinstance(watcher, _PidfdWatcher) else None


class RestingChild:
    """A child the edge did not start through asyncio (a session shell, forked for the edge by
    its helper), watched without a pidfd until someone awaits it (:meth:`wait`) or asks for its
    exit code (:attr:`returncode`, one waitid): session shells idle for hours by the thousand,
    and a pidfd each was a quarter of the fds an edge spent per held session."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None
        self._ended: asyncio.Future[int] | None = None  # made by the first wait(), few ever do
        watcher = asyncio.get_child_watcher()
        if isinstance(watcher, _PidfdWatcher):
            watcher.add_resting(pid, self._exited)
        else:
            watcher.add_child_handler(pid, self._exited)

    def _exited(self, pid: int, code: int) -> None:
        self._code = code
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(code)

    @property
    def returncode(self) -> int | None:
        """Its exit code as asyncio reports it once reaped (found now if it ended meanwhile:
        OOM, a kill from the sandbox), else None."""
        if self._code is None:
            poll_child(self.pid)
        return self._code

    async def wait(self) -> int:
        if self._code is not None:
            return self._code
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        watch_child(self.pid)
        return await asyncio.shield(self._ended)


def poll_child(pid: int) -> int | None:
    """Reap the lazily watched child ``pid`` if it has ended (one waitid, no fd): its exit code
    as asyncio reports it, else None (still running, or not lazily watched)."""
    watcher = _watcher()
    return None if watcher is None else watcher.poll(pid)


def watch_child(pid: int) -> None:
    """Watch a lazily watched child through a pidfd again (before awaiting its end)."""
    watcher = _watcher()
    if watcher is not None:
        watcher.wake(pid)


_Handler = tuple[asyncio.AbstractEventLoop, Callable[..., object], tuple[object, ...]]


class _PidfdWatcher(asyncio.AbstractChildWatcher):
    """Python 3.12's pidfd watcher for 3.11: each child is watched on the loop that started it
    (3.11's own binds to one loop, and the tests run several). A child can also rest, with no
    pidfd: then its end is noticed when someone asks (:func:`poll_child`, :func:`watch_child`)."""

    def __init__(self) -> None:
        self._active: dict[int, tuple[int, _Handler]] = {}
        self._resting: dict[int, _Handler] = {}

    def add_child_handler(self, pid: int, callback: Callable[..., object], *args: object) -> None:
        self._watch(pid, (asyncio.get_running_loop(), callback, args))

    def _watch(self, pid: int, handler: _Handler) -> None:
        pidfd = os.pidfd_open(pid)
        self._active[pid] = (pidfd, handler)
        handler[0].add_reader(pidfd, self._reap, pid)

    def add_resting(self, pid: int, callback: Callable[..., object]) -> None:
        self._resting[pid] = (asyncio.get_running_loop(), callback, ())

    def wake(self, pid: int) -> None:
        handler = self._resting.pop(pid, None)
        if handler is not None:
            self._watch(pid, handler)

    def poll(self, pid: int) -> int | None:
        handler = self._resting.get(pid)
        if handler is None:
            return None
        with contextlib.suppress(ChildProcessError):  # gone already: _finish says so
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
        del self._resting[pid]
        return self._finish(pid, handler)

    def _reap(self, pid: int) -> None:
        pidfd, handler = self._active.pop(pid)
        handler[0].remove_reader(pidfd)
        os.close(pidfd)
        self._finish(pid, handler)

    @staticmethod
    def _finish(pid: int, handler: _Handler) -> int:
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = 255  # reaped by someone else: the status is lost (as asyncio reports it)
        _, callback, args = handler
        callback(pid, code, *args)
        return code

    def remove_child_handler(self, pid: int) -> bool:
        return True  # the reader goes when the child exits

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        pass

    def close(self) -> None:
        pass

    def is_active(self) -> bool:
        return True

    def __enter__(self) -> _PidfdWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def shell_exit_code(code: int) -> int:
    # asyncio reports death by signal N as -N; shells and crun report 128+N. Use the shell's.
    return 128 - code if code < 0 else code
