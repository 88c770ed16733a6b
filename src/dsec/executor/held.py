"""Processes the edge keeps past the request that started them: its per-sandbox process table.

A :class:`HeldProcess` owns the edge's side of one process: its stdin pipe and output pipes,
or the master of its pseudo-terminal. Output goes to whoever is attached, each attachment
with a bounded queue of its own; the pump reading the process waits for room in every queue
(backpressure: a slow reader slows the process down, output never piles up in the edge), and
with nobody attached output is read and dropped. Attaching never replays earlier output.

The process ends with one ``end`` event to every attachment: its exit code, or ``-N`` and
``signal=N`` for a death by signal N, and ``error`` when the edge ended it (``"timeout"``,
``"sandbox stopped"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal as signals
import struct
import termios
import time
from collections.abc import AsyncGenerator, Callable
from typing import Literal

from dsec.backends.base import Spawned
from dsec.executor.fdwait import fd_ready
from dsec.executor.process import ByteStream, descendants, kill_process_tree
from dsec.executor.watch import WatchBudget
from dsec.protocol.errors import (
    Conflict,
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
    ProcessNotFound,
    SandboxNotFound,
)
from dsec.protocol.processes import ProcessEvent, ProcessInfo, PtySize

OUT_CHUNK = 1 << 16
QUEUE_DEPTH = 16  # events per attachment: at most 1 MiB of output waits for one reader
# After the process exited, its output is read to EOF; a pipe that a leftover background
# process keeps open, silent this long, ends the wait (its output is no longer the process's).
DRAIN_IDLE_S = 1.0
MAX_PROCESSES = 256  # held per sandbox: each holds up to 3 fds of the edge (or a host PTY)
KILL_WAIT_S = 5.0
# Linux's ioctls (asm-generic/ioctls.h), absent from Python's termios: open a master's slave
# (4.13), and hang a terminal up as its caller's vhangup(2) would (CAP_SYS_ADMIN).
_TIOCGPTPEER = 0x5441
_TIOCVHANGUP = 0x5437
EOF_CHAR = b"\x04"  # what "close stdin" types on a terminal (its VEOF, ^D by default)


class Attachment:
    """One reader of a process's events."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ProcessEvent] = asyncio.Queue(maxsize=QUEUE_DEPTH)
        self.closed = False

    async def put(self, event: ProcessEvent) -> None:
        if not self.closed:
            await self.queue.put(event)

    def close(self) -> None:
        self.closed = True
        while not self.queue.empty():  # frees a pump waiting for room in this queue
            self.queue.get_nowait()


class HeldProcess:
    def __init__(
        self,
        spawned: Spawned,
        *,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        tag: str | None,
        master: int | None,
        timeout: float | None,
        stdin: bool,
        on_end: Callable[[HeldProcess, ProcessEvent], None],
    ) -> None:
        self.spawned = spawned
        self.proc = spawned.proc
        self.pid = spawned.pid
        self.argv, self.env, self.cwd, self.tag = argv, env, cwd, tag
        self.master = master
        self.timeout = timeout
        self.started = time.monotonic()
        self.error: str | None = None
        self.attachments: list[Attachment] = []
        self.no_stdin = not stdin and master is None
        self.stdin_closed = False
        self._on_end = on_end
        self._blocked = 0  # pumps waiting for room in a queue (not idle: a reader is slow)
        self._last_output = time.monotonic()
        self._write_lock = asyncio.Lock()
        self._driver: asyncio.Task[None] | None = None
        self.ended = asyncio.Event()

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            pid=self.pid,
            argv=self.argv,
            env=self.env,
            cwd=self.cwd,
            tag=self.tag,
            pty=self.master is not None,
        )

    def start(self) -> Attachment:
        """Run it, with its starter attached before any output can be read."""
        first = self.attach()
        self._driver = asyncio.create_task(self._drive())
        return first

    def attach(self) -> Attachment:
        if self.ended.is_set():
            raise ProcessNotFound(f"process {self.pid} has ended")
        att = Attachment()
        self.attachments.append(att)
        return att

    def detach(self, att: Attachment) -> None:
        att.close()
        with contextlib.suppress(ValueError):
            self.attachments.remove(att)

    async def follow(self, att: Attachment) -> AsyncGenerator[ProcessEvent, None]:
        """``start``, what it writes from now on, then ``end``; closing this only detaches."""
        try:
            yield ProcessEvent(t="start", pid=self.pid)
            while True:
                event = await att.queue.get()
                yield event
                if event.t == "end":
                    return
        finally:
            self.detach(att)

    # -- output -------------------------------------------------------------------------------

    async def _publish(self, kind: Literal["out", "err", "pty"], data: bytes) -> None:
        self._last_output = time.monotonic()
        event = ProcessEvent(t=kind, pid=self.pid, data=data)
        self._blocked += 1
        try:
            for att in list(self.attachments):
                await att.put(event)
        finally:
            self._blocked -= 1

    async def _pump_pipe(self, stream: ByteStream | None, kind: Literal["out", "err"]) -> None:
        if stream is None:
            return
        while chunk := await stream.read(OUT_CHUNK):
            await self._publish(kind, chunk)

    async def _pump_master(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, OUT_CHUNK)
            except BlockingIOError:
                await fd_ready(fd)
                continue
            except OSError as exc:
                if exc.errno == errno.EIO:  # every holder of the slave closed it
                    return
                raise
            if not chunk:
                return
            await self._publish("pty", chunk)

    async def _drive(self) -> None:
        if self.master is not None:
            pumps = [asyncio.create_task(self._pump_master(self.master))]
        else:
            pumps = [
                asyncio.create_task(self._pump_pipe(self.proc.stdout, "out")),
                asyncio.create_task(self._pump_pipe(self.proc.stderr, "err")),
            ]
        try:
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), self.timeout)
            except TimeoutError:
                self.error = self.error or "timeout"
                kill_process_tree(self.proc)
                await self.proc.wait()
            while True:
                _, pending = await asyncio.wait(pumps, timeout=DRAIN_IDLE_S / 4)
                if not pending:
                    break
                if not self._blocked and time.monotonic() - self._last_output > DRAIN_IDLE_S:
                    break
        finally:
            # Also when cancelled (the edge is closing): the process keeps running, unread.
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if self.master is not None and self.master >= 0:
                os.close(self.master)
                self.master = -1  # still "a pty" for info(); no longer usable
        code = self.proc.returncode
        assert code is not None
        self.ended.set()
        end = ProcessEvent(
            t="end", pid=self.pid, exit_code=code, signal=-code if code < 0 else None, error=self.error
        )
        self._on_end(self, end)
        for att in list(self.attachments):
            await att.put(end)

    # -- control ------------------------------------------------------------------------------

    def _live(self) -> None:
        if self.ended.is_set() or self.proc.returncode is not None:
            raise ProcessNotFound(f"process {self.pid} has ended")

    async def write(self, data: bytes) -> None:
        self._live()
        async with self._write_lock:
            if self.master is not None:
                await _write_all(self.master, data)
                return
            stdin = self.proc.stdin
            if stdin is None or self.no_stdin:
                raise InvalidRequest(f"process {self.pid} was started without stdin (stdin=false)")
            if self.stdin_closed:
                raise Conflict(f"the stdin of process {self.pid} was closed")
            try:
                stdin.write(data)
                await stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise Conflict(f"process {self.pid} no longer reads its stdin") from exc

    async def close_stdin(self) -> None:
        """EOF on its stdin; on a terminal, the terminal's end-of-file character."""
        self._live()
        if self.master is not None:
            await self.write(EOF_CHAR)
            return
        if self.proc.stdin is None or self.no_stdin:
            raise InvalidRequest(f"process {self.pid} was started without stdin (stdin=false)")
        async with self._write_lock:
            if not self.stdin_closed:
                self.stdin_closed = True
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.proc.stdin.close()

    def signal(self, sig: int) -> None:
        """``sig`` to the process and every descendant (as a timeout's kill reaches them). On
        a terminal, SIGHUP also hangs the terminal up, as the closing terminal it stands for."""
        self._live()
        try:
            sig = signals.Signals(sig)
        except ValueError:
            if not signals.SIGRTMIN <= sig <= signals.SIGRTMAX:
                raise InvalidRequest(f"unknown signal {sig}") from None
        if sig == signals.SIGHUP and self.master is not None and self.master >= 0:
            with contextlib.suppress(OSError):  # a terminal already gone: the signal still goes
                hang_up(self.master)
        host = self.spawned.host_pid
        if host is None:
            send: Callable[..., None] | None = getattr(self.proc, "send_signal", None)
            if send is None:
                raise ProcessNotFound(f"process {self.pid} has ended")
            send(sig, tree=True)  # a guest agent's process (microVM): signalled in the guest
            return
        for victim in [host, *descendants(host)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, sig)

    def resize(self, size: PtySize) -> None:
        self._live()
        if self.master is None:
            raise InvalidRequest(f"process {self.pid} has no terminal to resize (started without pty)")
        set_size(self.master, size)

    async def kill(self, reason: str) -> None:
        """Kill its tree (``reason`` goes into its ``end``) and wait for the end, bounded."""
        if self.proc.returncode is None:
            self.error = self.error or reason
            kill_process_tree(self.proc)
        if self._driver is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._driver), KILL_WAIT_S)

    def forget(self) -> None:
        """The edge is closing: stop reading; the process keeps running without its pipes."""
        if self._driver is not None:
            self._driver.cancel()


def hang_up(master: int) -> None:
    """Hang up the terminal whose master is ``master``, as a closing terminal does: the kernel
    sends SIGHUP to its session, and every read of it ends. A SIGHUP alone is not enough: an
    interactive bash that takes one while it sets up defers it, then blocks reading its
    terminal for good (a closed console's login shell stayed behind, about 1 close in 50)."""
    slave = fcntl.ioctl(master, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(slave, _TIOCVHANGUP)
    finally:
        os.close(slave)


def set_size(master: int, size: PtySize) -> None:
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await fd_ready(fd, write=True)
        except OSError as exc:
            if exc.errno == errno.EIO:
                raise Conflict("the terminal was closed") from exc
            raise


class ProcessTable:
    """The held processes of one sandbox, by the PID the sandbox sees."""

    def __init__(self) -> None:
        self.procs: dict[int, HeldProcess] = {}
        self.budget = WatchBudget()
        self.closers: set[Callable[[DSecError], None]] = set()  # what ends its directory watches

    def get(self, pid: int) -> HeldProcess:
        held = self.procs.get(pid)
        if held is None or held.ended.is_set():
            raise ProcessNotFound(
                f"no running process {pid} in this sandbox (ended, or not started by the API)"
            )
        return held

    def check_room(self) -> None:
        if len(self.procs) >= MAX_PROCESSES:
            raise Conflict(f"this sandbox already holds {MAX_PROCESSES} processes: end some first")

    async def kill_all(self, reason: str) -> None:
        for close in list(self.closers):
            close(SandboxNotFound(f"the sandbox stopped ({reason})"))
        await asyncio.gather(*(held.kill(reason) for held in list(self.procs.values())))

    def forget_all(self) -> None:
        for close in list(self.closers):
            close(InfraFailure("the edge is shutting down", reason=InfraReason.edge_shutdown))
        for held in self.procs.values():
            held.forget()
