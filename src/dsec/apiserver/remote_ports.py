"""A port inside a sandbox on a remote edge: the client side of the edge's port WebSocket.

The edge (:func:`dsec.edge.ports.serve_port`) answers the upgrade, then says whether the port
opened: ``open``, or a DSec error body carried in the first message (so a closed port is the
same ``Conflict`` it is on a local link, not a failed handshake). Then binary messages are the
bytes, the text message ``eof`` a half-close, a close the end.
"""

from __future__ import annotations

import json

import aiohttp

from dsec.edge.ports import CHUNK, EOF_MESSAGE, OPEN_MESSAGE, PortStream
from dsec.observe import request_ids
from dsec.protocol.errors import InfraFailure, InfraReason, error_from_wire


class WebSocketStream:
    """:class:`~dsec.edge.ports.PortStream` over the WebSocket to the edge."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._eof = False

    async def read(self) -> bytes:
        if self._eof:
            return b""
        msg = await self._ws.receive()
        if msg.type is aiohttp.WSMsgType.BINARY:
            return bytes(msg.data)
        self._eof = True  # "eof", a close, or an error: nothing more comes from the sandbox
        return b""

    async def write(self, data: bytes) -> None:
        if self._ws.closed:
            raise ConnectionResetError("the port's connection is closed")
        await self._ws.send_bytes(data)

    async def write_eof(self) -> None:
        if not self._ws.closed:
            await self._ws.send_str(EOF_MESSAGE)

    async def close(self) -> None:
        await self._ws.close()


async def open_remote_port(
    session: aiohttp.ClientSession,
    url: str,
    node: str,
    connect_timeout: float,
    *,
    peer: str | None = None,
    reason: InfraReason = InfraReason.edge_unreachable,
) -> PortStream:
    """Open the edge's port route at ``url`` (node ``node``); DSec errors raised as themselves.
    ``peer`` and ``reason``: what serves it and how it is unreachable, when not an edge (an
    overflow cluster's public port route speaks the same protocol).

    The request's ID (:mod:`dsec.observe.request_ids`) goes with the upgrade, so the edge logs
    the caller's; an error the edge sends back carries it as ``request_id``."""
    who = peer or f"edge {node!r}"
    rid = request_ids.outgoing()
    timeout = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=connect_timeout)
    try:
        ws = await session.ws_connect(
            url,
            timeout=timeout,
            max_msg_size=CHUNK * 2,
            autoping=True,
            heartbeat=None,
            headers={request_ids.HEADER: rid},
        )
    except aiohttp.WSServerHandshakeError as exc:
        raise InfraFailure(
            f"{who} refused to open a port (HTTP {exc.status}): {exc.message}",
            reason=InfraReason.protocol,
        ) from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise InfraFailure(f"{who} is unreachable: {exc}", reason=reason) from exc
    try:
        first = await ws.receive()
    except (aiohttp.ClientError, OSError) as exc:
        await ws.close()
        raise InfraFailure(f"{who} dropped a port it was opening: {exc}", reason=reason) from exc
    if first.type is aiohttp.WSMsgType.TEXT and first.data == OPEN_MESSAGE:
        return WebSocketStream(ws)
    await ws.close()
    if first.type is aiohttp.WSMsgType.TEXT:
        try:
            body = json.loads(first.data)
            status = int(body.pop("status"))
        except (ValueError, KeyError, TypeError, AttributeError):
            body, status = first.data, 500
        err = error_from_wire(status, body)
        err.request_id = err.request_id or rid
        raise err
    raise InfraFailure(f"{who} closed a port it was opening", reason=InfraReason.protocol)
