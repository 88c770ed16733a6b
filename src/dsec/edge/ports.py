"""A TCP port inside a sandbox, reached from the edge: the byte stream E2B's ``get_host`` needs.

The edge creates a socket in the sandbox's network namespace (a short-lived thread enters it,
makes the socket, and ends: a socket keeps the namespace it was made in) and connects it to the
port on the sandbox's loopback. Loopback, not an address of the sandbox's link: a server bound to
``127.0.0.1`` inside is reached too, as E2B's envd makes it reachable by forwarding such ports,
and a sandbox without network permissions (no link at all) still serves its ports.

Only sandboxes whose network namespace the host can enter have ports here: runc containers.
gVisor's netstack and (micro)VMs keep their loopback to themselves: refused with a message.

The stream is the one link operation E2B's traffic needs (:meth:`EdgeLink.open_port`): plain
bytes both ways, a half-close, a close. Over the wire between an apiserver and a remote edge it
is a WebSocket (:func:`serve_port` here, :mod:`dsec.apiserver.remote_ports` there): binary
messages carry bytes, the text message ``eof`` a half-close.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import os
import socket
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from aiohttp import WSMsgType, web

from dsec._linux import CLONE_NEWNET
from dsec.backends.base import Networked
from dsec.observe import request_ids
from dsec.protocol.errors import (
    Conflict,
    ConflictReason,
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
)

if TYPE_CHECKING:
    from dsec.edge.edge import Edge

CHUNK = 64 << 10  # bytes read at a time, and the largest message on the wire
PORT_CLOSED = ConflictReason.port_closed  # the reason of the Conflict a closed port raises
EOF_MESSAGE = "eof"  # a half-close, on the wire
OPEN_MESSAGE = "open"  # the edge's first message once the port is connected
_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int
_REFUSED = (errno.ECONNREFUSED, errno.EADDRNOTAVAIL, errno.ENETUNREACH)
log = logging.getLogger(__name__)


class PortStream(Protocol):
    """A connection to a port inside a sandbox."""

    async def read(self) -> bytes:
        """Up to :data:`CHUNK` bytes as they come; ``b""`` once the sandbox's side is done."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None:
        """Nothing more will be sent (the server inside sees end-of-file); reading goes on."""
        ...

    async def close(self) -> None: ...


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port} is not a TCP port (1-65535)")
    return port


def port_param(request: web.Request) -> int:
    raw = request.match_info["port"]
    if not raw.isdigit() or len(raw) > 5:
        raise InvalidRequest(f"bad port {raw[:16]!r}: a TCP port is 1-65535")
    return check_port(int(raw))


class SocketStream:
    """:class:`PortStream` over a connected socket (the edge's own side)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def read(self) -> bytes:
        try:
            return await self._reader.read(CHUNK)
        except ConnectionError:
            return b""

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def write_eof(self) -> None:
        if self._writer.can_write_eof() and not self._writer.is_closing():
            self._writer.write_eof()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # a reset on the way out changes nothing


def _sockets_in(pid: int) -> list[socket.socket]:
    """An IPv4 and an IPv6 socket in the network namespace of ``pid``, made by a thread of its
    own that ends at once: setns(2) moves only the calling thread, and a pooled thread left in
    the sandbox's namespace would take the edge's later work there."""
    made: list[socket.socket] = []
    failed: list[str] = []

    def make() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            failed.append(f"cannot open its network namespace: {exc.strerror}")
            return
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                failed.append(f"cannot enter its network namespace: {os.strerror(ctypes.get_errno())}")
                return
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            made.append(socket.socket(socket.AF_INET6, socket.SOCK_STREAM))
        finally:
            os.close(fd)

    thread = threading.Thread(target=make, name="dsec-port-socket")
    thread.start()
    thread.join()
    if failed or len(made) != 2:
        for s in made:
            s.close()
        raise InfraFailure(
            f"cannot open a port of the sandbox: {failed[0] if failed else '?'}", reason=InfraReason.network
        )
    return made


async def connect_port(edge: Edge, sandbox_id: str, port: int) -> SocketStream:
    """Connect to ``port`` on the sandbox's loopback (resumed first if paused); a port nothing
    listens on is ``Conflict`` with reason :data:`PORT_CLOSED`."""
    check_port(port)
    live = await edge.pausing.use(sandbox_id)
    backend = edge.backend_of(live.record)
    pid = backend.netns_pid(live.record.handle) if isinstance(backend, Networked) else None
    if pid is None:
        raise InvalidRequest(
            f"sandbox {sandbox_id} ({live.record.backend}, runtime {live.record.spec.runtime}) keeps its"
            " network stack to itself: its ports can be reached only in runc container sandboxes"
        )
    v4, v6 = await asyncio.to_thread(_sockets_in, pid)
    loop = asyncio.get_running_loop()
    last: OSError | None = None
    for sock, address in ((v4, "127.0.0.1"), (v6, "::1")):
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (address, port))
        except OSError as exc:
            sock.close()
            last = exc
            continue
        (v6 if sock is v4 else v4).close()
        live.touch()  # traffic is activity: an idle reaper must not take a sandbox being used
        reader, writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        return SocketStream(reader, writer)
    if last is not None and last.errno not in _REFUSED:
        raise InfraFailure(
            f"port {port} of sandbox {sandbox_id}: {last.strerror}", reason=InfraReason.network
        )
    raise Conflict(f"the sandbox {sandbox_id} is running but port {port} is not open", reason=PORT_CLOSED)


async def serve_port(request: web.Request, opening: Awaitable[PortStream]) -> web.WebSocketResponse:
    """The edge server's port route: a WebSocket to an apiserver whose first message is
    :data:`OPEN_MESSAGE`, or a DSec error body (with its ``status``) if ``opening`` failed, a
    closed port as much as an unknown sandbox; then the stream's bytes both ways.

    The error body carries the request's ID (``request_id``), as an HTTP error body does: the
    access line says 101 for the upgrade, so a refused port is logged here too, with the ID."""
    ws = web.WebSocketResponse(max_msg_size=CHUNK * 2)
    await ws.prepare(request)
    try:
        stream = await opening
    except DSecError as exc:
        exc.request_id = exc.request_id or request_ids.current()
        log.info("port of %s not opened: %s", request.match_info.get("id", "?")[:100], exc.message)
        await ws.send_str(json.dumps({**exc.to_wire(), "status": exc.status}))
        await ws.close()
        return ws
    await ws.send_str(OPEN_MESSAGE)

    async def upstream() -> None:
        while data := await stream.read():
            await ws.send_bytes(data)
        await ws.send_str(EOF_MESSAGE)

    sending = asyncio.create_task(upstream())
    try:
        async for msg in ws:
            if msg.type is WSMsgType.BINARY:
                await stream.write(msg.data)
            elif msg.type is WSMsgType.TEXT and msg.data == EOF_MESSAGE:
                await stream.write_eof()
            else:
                break
    except ConnectionError:
        pass  # the server inside went away: closing the WebSocket tells the apiserver
    finally:
        sending.cancel()
        await stream.close()
        await ws.close()
    return ws
