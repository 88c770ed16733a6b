"""The host end of the guest agent protocol (``guest/PROTOCOL.md``) over QEMU's unix socket
(the virtio-serial port's host end) or over AF_VSOCK (:mod:`dsec.backends.microvm.vsock`).

One :class:`AgentChannel` per microVM multiplexes every process and file operation over that
one byte stream. A process is a :class:`VmProcess`: the same shape as an asyncio subprocess
(stdin writer, stdout/stderr stream readers, ``wait``, ``kill``), so the edge's sessions and
exec streams drive a process in a VM exactly as one in a container.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import secrets
import signal
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Coroutine
from pathlib import Path
from typing import Any

from dsec.backends.microvm import shell_watch
from dsec.backends.microvm.shell_watch import GuestShellView
from dsec.backends.microvm.vsock import VsockAddr
from dsec.protocol.errors import InfraFailure, InfraReason

_HEADER = struct.Struct("<IBI")  # len (of what follows it), type, chan
_MAX_PAYLOAD = 1 << 20
STAT = struct.Struct("<IIIQq")  # mode, uid, gid, size, mtime_ns

# Frame types (PROTOCOL.md)
# guest -> host
READY, STARTED, STDOUT, STDERR, FRES, DATA, EXIT, OOM = range(0x80, 0x88)
PONG, WATCHED, ERROR = 0x88, 0x89, 0x8F
# host -> guest
SPAWN, STDIN, KILL, FOP, WDATA, COMMIT, ABORT, PING, WATCH = range(1, 10)
OP_STAT, OP_LIST, OP_MKDIR, OP_REMOVE, OP_READ, OP_WRITE, OP_RENAME = 1, 2, 3, 4, 5, 6, 7

Handler = Callable[[int, bytes], None]
# Where the agent is: the unix socket of QEMU's virtio-serial chardev, or a guest's vsock port.
AgentAddr = Path | VsockAddr


def cstr(text: str) -> bytes:
    # A file name that is not UTF-8 is a surrogateescape str here: sent as its own bytes.
    data = os.fsencode(text)
    if b"\0" in data:
        raise ValueError("a string sent to the guest agent cannot contain NUL")
    return data + b"\0"


class AgentError(OSError):
    """An operation the agent answered with an errno."""


class AgentChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: str) -> None:
        self._reader, self._writer = reader, writer
        self.version = version
        self._send_lock = asyncio.Lock()
        self._handlers: dict[int, Handler] = {}
        # Channel numbers of an earlier connection may still be live in the agent (processes
        # it started keep running across an edge restart or a pause): start somewhere else.
        self._chans = itertools.count(secrets.randbelow(1 << 30) + 1)
        self._closed = False
        self._suspended = False
        # The guest kernel's OOM kill count, as the agent last reported it (it reports after
        # every connect and before forwarding anything an OOM kill caused).
        self.oom_kills = 0
        self._pump = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def connect(
        cls, path: AgentAddr, timeout: float, *, booting: bool = True, forget: bool = False
    ) -> AgentChannel:
        """Connect to the agent's socket. ``booting``: wait for the READY it sends when it
        starts; else (an edge reconnecting to a running VM) ask with a PING and wait for the
        PONG, skipping what the agent still had queued for the previous connection.
        ``forget``: the previous connection's processes lose their stdin (see PROTOCOL.md)."""
        reader, writer, version = await _open(path, timeout, booting, forget)
        return cls(reader, writer, version)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def suspended(self) -> bool:
        return self._suspended

    async def suspend(self) -> None:
        """Drop the connection but keep every channel: the VM is about to be saved to a file,
        and its processes (a session's shell) carry on in it after :meth:`resume`."""
        self._suspended = True
        await self._stop_pump()
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def resume(self, path: AgentAddr, timeout: float = 30.0) -> None:
        """Reconnect to the (restored) VM; the channels of :meth:`suspend` resume."""
        self._reader, self._writer, _ = await _open(path, timeout, booting=False)
        self._suspended = False
        self._pump = asyncio.ensure_future(self._read_loop())

    async def close(self) -> None:
        self._closed = True
        await self._stop_pump()
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._fail_all()

    async def _stop_pump(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._pump

    def _fail_all(self) -> None:
        for handler in list(self._handlers.values()):
            handler(-1, b"")  # -1: the channel is gone
        self._handlers.clear()

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, chan, payload = await _read_frame(self._reader)
                if kind == OOM and chan == 0 and len(payload) >= 8:
                    (self.oom_kills,) = struct.unpack_from("<Q", payload)
                    continue
                handler = self._handlers.get(chan)
                if handler is not None:
                    handler(kind, payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if not self._suspended:
                self._closed = True
                self._fail_all()

    async def send(self, kind: int, chan: int, payload: bytes = b"") -> None:
        if self._closed or self._suspended:
            raise InfraFailure("the microVM's agent channel is closed", reason=InfraReason.runtime)
        async with self._send_lock:
            for i in range(0, max(len(payload), 1), _MAX_PAYLOAD):
                part = payload[i : i + _MAX_PAYLOAD]
                self._writer.write(_HEADER.pack(len(part) + 5, kind, chan) + part)
            await self._writer.drain()

    def open_chan(self, handler: Handler) -> int:
        chan = next(self._chans)
        self._handlers[chan] = handler
        return chan

    def close_chan(self, chan: int) -> None:
        self._handlers.pop(chan, None)

    # -- processes --------------------------------------------------------------------------

    async def spawn(self, argv: list[str], *, env: dict[str, str], cwd: str, uid: int, gid: int) -> VmProcess:
        proc = VmProcess(self)
        proc.chan = self.open_chan(proc.on_frame)
        envs = [f"{k}={v}" for k, v in env.items()]
        payload = struct.pack("<IIII", uid, gid, len(argv), len(envs))
        payload += cstr(cwd) + b"".join(cstr(a) for a in argv) + b"".join(cstr(e) for e in envs)
        await self.send(SPAWN, proc.chan, payload)
        await proc.started()
        return proc

    # -- files ------------------------------------------------------------------------------

    async def fop(self, op: int, args: bytes) -> bytes:
        """One file operation; returns the FRES payload after the errno (AgentError if set)."""
        answer: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

        def on_frame(kind: int, payload: bytes) -> None:
            if not answer.done():
                answer.set_result((kind, payload))

        chan = self.open_chan(on_frame)
        try:
            await self.send(FOP, chan, bytes([op]) + args)
            kind, payload = await answer
        finally:
            self.close_chan(chan)
        return _fres(kind, payload)

    async def read(self, path: str) -> AsyncGenerator[bytes, None]:
        """A file's content in chunks; AgentError (e.g. ENOENT) before the first chunk."""
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        chan = self.open_chan(lambda kind, payload: queue.put_nowait((kind, payload)))
        try:
            await self.send(FOP, chan, bytes([OP_READ]) + cstr(path))
            _fres(*await queue.get())
            while True:
                kind, payload = await queue.get()
                if kind == ERROR and len(payload) >= 4:  # the read failed after it started
                    (err,) = struct.unpack_from("<i", payload)
                    raise AgentError(err, os.strerror(err))
                if kind != DATA:
                    _fres(kind, payload)  # the channel went away mid-file
                    raise InfraFailure(
                        f"reading {path} from the microVM broke off", reason=InfraReason.runtime
                    )
                if not payload:
                    return
                yield payload
        finally:
            self.close_chan(chan)

    async def write(self, path: str, chunks: AsyncIterable[bytes], *, mode: int, uid: int, gid: int) -> None:
        """Write ``path`` from ``chunks`` atomically (a temp file renamed on success)."""
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        chan = self.open_chan(lambda kind, payload: queue.put_nowait((kind, payload)))
        try:
            await self.send(FOP, chan, bytes([OP_WRITE]) + struct.pack("<III", mode, uid, gid) + cstr(path))
            _fres(*await queue.get())
            try:
                async for chunk in chunks:
                    if chunk:
                        await self.send(WDATA, chan, chunk)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.send(ABORT, chan)
                    _fres(*await queue.get())
                raise
            await self.send(COMMIT, chan)
            _fres(*await queue.get())
        finally:
            self.close_chan(chan)


async def _open(
    path: AgentAddr, timeout: float, booting: bool, forget: bool = False
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    async with asyncio.timeout(timeout):
        while True:
            try:
                if isinstance(path, VsockAddr):
                    reader, writer = await _open_vsock(path)
                else:
                    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 22)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.005)  # QEMU creates the socket as it starts
            except OSError as exc:
                if not isinstance(path, VsockAddr) or exc.errno not in _VSOCK_NOT_YET:
                    raise
                await asyncio.sleep(0.02)  # the guest's agent is not listening yet
        want, nonce = READY, b""
        if not booting:
            want, nonce = PONG, (b"forget:" if forget else b"") + os.urandom(8)
            writer.write(_HEADER.pack(len(nonce) + 5, PING, 0) + nonce)
            await writer.drain()
        while True:
            kind, _chan, payload = await _read_frame(reader)
            if kind != want:
                continue
            if booting:  # READY: the version, NUL-terminated
                return reader, writer, payload.rstrip(b"\0").decode(errors="replace")
            # PONG: the nonce echoed; an agent since version 2 adds NUL and its version.
            if payload == nonce or payload.startswith(nonce + b"\0"):
                return reader, writer, payload[len(nonce) + 1 :].rstrip(b"\0").decode(errors="replace")


# What connecting to a guest's vsock port says while the guest boots: no such CID yet (QEMU
# has not set the device up), reset (the guest's transport answers, nothing listens), timed out
# (the guest's transport is not loaded yet: nobody answers).
_VSOCK_NOT_YET = {errno.ENODEV, errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH}


async def _open_vsock(addr: VsockAddr) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream over AF_VSOCK to ``addr``. asyncio's ``sock_connect`` resolves only inet
    addresses, so a (cid, port) pair goes to the kernel as it is."""
    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (addr.cid, addr.port))
        return await asyncio.open_connection(sock=sock, limit=1 << 22)
    except BaseException:
        sock.close()
        raise


def _fres(kind: int, payload: bytes) -> bytes:
    if kind == -1:
        raise InfraFailure("the microVM's agent went away", reason=InfraReason.runtime)
    if kind != FRES or len(payload) < 4:
        raise InfraFailure(
            f"the microVM's agent sent frame {kind:#x} instead of a result", reason=InfraReason.protocol
        )
    (err,) = struct.unpack_from("<i", payload)
    if err:
        raise AgentError(err, os.strerror(err))
    return payload[4:]


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    header = await reader.readexactly(_HEADER.size)
    length, kind, chan = _HEADER.unpack(header)
    if length < 5 or length > _MAX_PAYLOAD + 5:
        raise InfraFailure(
            f"malformed frame from the microVM's agent (length {length})", reason=InfraReason.protocol
        )
    payload = await reader.readexactly(length - 5)
    return kind, chan, payload


class _Stdin:
    """The writer end of a VM process's stdin, shaped like asyncio's StreamWriter."""

    def __init__(self, proc: VmProcess) -> None:
        self._proc = proc
        self._pending = bytearray()
        self._closing = False

    def write(self, data: bytes) -> None:
        if self._closing:
            raise BrokenPipeError(errno.EPIPE, "stdin is closed")
        self._pending += data

    async def drain(self) -> None:
        if self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            await self._proc.channel.send(STDIN, self._proc.chan, data)

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._proc.background(self._close())

    async def _close(self) -> None:
        await self.drain()
        await self._proc.channel.send(STDIN, self._proc.chan, b"")  # empty: EOF


class VmProcess:
    """A process inside a microVM, driven like :class:`asyncio.subprocess.Process`."""

    def __init__(self, channel: AgentChannel) -> None:
        self.channel = channel
        self.chan = 0
        self.pid = 0
        self.returncode: int | None = None
        self.stdin = _Stdin(self)
        self.stdout = asyncio.StreamReader(limit=1 << 22)
        self.stderr = asyncio.StreamReader(limit=1 << 22)
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._exited = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._watched: asyncio.Future[bytes] | None = None  # a WATCH's answer, while one waits

    @classmethod
    def ended(cls, channel: AgentChannel, code: int, message: str) -> VmProcess:
        """A process that never ran (its exec or chdir failed), as a shell reports one: the
        message on stderr and ``code`` (127 not found, 126 cannot run); stdin is closed."""
        proc = cls(channel)
        proc.stdin._closing = True  # nothing to send it to: writes fail as on a closed pipe
        proc.stderr.feed_data(message.encode(errors="replace") + b"\n")
        proc.returncode = code
        proc._started.set_result(None)
        proc._end()
        return proc

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def started(self) -> None:
        await self._started

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == STARTED:
            (self.pid,) = struct.unpack_from("<i", payload)
            if not self._started.done():
                self._started.set_result(None)
        elif kind == STDOUT:
            self.stdout.feed_data(payload)
        elif kind == STDERR:
            self.stderr.feed_data(payload)
        elif kind == WATCHED:
            if self._watched is not None and not self._watched.done():
                # CALIBRATE and CHECK answer one byte, MARK two: padded, every answer has two.
                self._watched.set_result(payload + b"\0")
        elif kind == EXIT:
            (status,) = struct.unpack_from("<i", payload)
            # As asyncio reports it: the exit code, or minus the signal that killed it.
            self.returncode = os.waitstatus_to_exitcode(status)
            self._end()
        elif kind == ERROR:
            (err,) = struct.unpack_from("<i", payload)
            message = payload[4:].rstrip(b"\0").decode(errors="replace")
            if not self._started.done():
                self._started.set_exception(AgentError(err, message or os.strerror(err)))
            self.returncode = 127
            self._end()
        elif kind == -1:  # the channel died: the VM is gone or restarting
            if not self._started.done():
                self._started.set_exception(
                    InfraFailure("the microVM's agent went away", reason=InfraReason.runtime)
                )
            if self.returncode is None:
                self.returncode = -signal.SIGKILL
            self._end()

    def _end(self) -> None:
        self.stdout.feed_eof()
        self.stderr.feed_eof()
        self._exited.set()
        if self._watched is not None and not self._watched.done():
            self._watched.set_result(bytes([shell_watch.UNWATCHED, 0]))
        self.channel.close_chan(self.chan)

    def shell_watch(self) -> GuestShellView | None:
        """The agent's watch of this process as a session shell; None from an agent before
        WATCH (a microVM an older edge started, readopted)."""
        number = self.channel.version.rpartition(" ")[2]
        return GuestShellView(self._watch) if number.isdigit() and int(number) >= 2 else None

    async def _watch(self, request: bytes) -> bytes:
        """One WATCH round trip: the WATCHED payload (UNWATCHED once the process is gone)."""
        gone = bytes([shell_watch.UNWATCHED, 0])
        if self.returncode is not None or self.channel.closed:
            return gone
        self._watched = asyncio.get_running_loop().create_future()
        try:
            await self.channel.send(WATCH, self.chan, request)
            return await self._watched
        except InfraFailure:  # the channel closed meanwhile: the shell is out of reach
            return gone
        finally:
            self._watched = None

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int, *, tree: bool = False) -> None:
        if self.returncode is None and not self.channel.closed:
            self.background(self.channel.send(KILL, self.chan, struct.pack("<iI", sig, 1 if tree else 0)))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_tree(self) -> None:
        """SIGKILL the process, its group and every descendant (in the guest)."""
        self.send_signal(signal.SIGKILL, tree=True)
