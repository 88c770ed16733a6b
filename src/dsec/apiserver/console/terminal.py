"""The console's terminal: a PTY in the edge's process table, joined to a browser WebSocket.

``GET /console/ws/sandboxes/{id}/terminal?rows=&cols=`` upgrades to a WebSocket. Browsers
cannot set headers on one, so the key comes as a second offered subprotocol
(``key.<api key>``; the answer names only ``dsec-console``); an ``Authorization`` header works
too. The key and the sandbox are checked before the upgrade (401/404 as on ``/v1``), and the
login shell is started before it too, so a sandbox that cannot start one gets a status.

Frames, both ways bounded by ``MAX_MESSAGE``: binary frames are the terminal's bytes (output
from the server; keystrokes from the browser, where ^C is the byte 0x03 that the PTY's line
discipline turns into SIGINT); text frames are JSON control messages: from the browser
``{"t": "resize", "rows", "cols"}`` or ``{"t": "signal", "signal"}``, from the server
``{"t": "start", "pid"}`` first and ``{"t": "end", "exit_code", "error"}`` last. A socket
that closes hangs the program up (SIGHUP), as a closing terminal does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncGenerator
from typing import Annotated, Literal

from aiohttp import WSCloseCode, WSMsgType, web
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from dsec.apiserver._http import PRINCIPAL
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.iam import IamStore
from dsec.protocol.errors import CapacityExhausted, DSecError, InfraFailure, InvalidRequest
from dsec.protocol.processes import ProcessEvent, ProcessStart, PtySize
from dsec.sdk._pty import LOGIN_SHELL

log = logging.getLogger("dsec.apiserver.console")

SUBPROTOCOL = "dsec-console"
KEY_PROTOCOL = "key."
MAX_MESSAGE = 64 << 10  # a paste of 64 KiB in one frame; the edge takes up to 1 MiB of input
MAX_TERMINALS = 256  # open console terminals per apiserver process
_MAX_KEY = 512


class Resize(BaseModel):
    t: Literal["resize"]
    rows: int = Field(ge=1, le=4096)
    cols: int = Field(ge=1, le=4096)


class Signal(BaseModel):
    t: Literal["signal"]
    signal: int = Field(ge=1, le=64)


CONTROL: TypeAdapter[Resize | Signal] = TypeAdapter(Annotated[Resize | Signal, Field(discriminator="t")])


def offered_key(request: web.Request) -> str | None:
    """The API key of an upgrade: its ``Authorization`` header, else a ``key.`` subprotocol."""
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        return header[7:]
    for item in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        item = item.strip()
        if item.startswith(KEY_PROTOCOL):
            key = item[len(KEY_PROTOCOL) :]
            if len(key) > _MAX_KEY:
                raise InvalidRequest(f"an API key is at most {_MAX_KEY} characters")
            return key
    return None


def _size_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    # ASCII digits only: str.isdigit() admits "²", which int() then refuses (a 500, not a 400).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 4 or not 1 <= int(raw) <= 4096:
        raise InvalidRequest(f"query parameter {name!r} must be a whole number from 1 to 4096")
    return int(raw)


class TerminalRoutes:
    def __init__(self, prefix: str, sandboxes: SandboxRoutes, iam: IamStore) -> None:
        self.prefix = prefix
        self.sandboxes = sandboxes
        self.iam = iam
        self.open = 0

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get(self.prefix + "/ws/sandboxes/{id}/terminal", self.terminal)

    async def terminal(self, request: web.Request) -> web.StreamResponse:
        request[PRINCIPAL] = await self.iam.authenticate(offered_key(request))
        link, sid = await self.sandboxes.owned(request)
        size = PtySize(rows=_size_param(request, "rows", 24), cols=_size_param(request, "cols", 80))
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), max_msg_size=MAX_MESSAGE, heartbeat=30)
        if not ws.can_prepare(request).ok:  # before a shell is started for nobody
            raise InvalidRequest("this route is a WebSocket: send an upgrade (Upgrade: websocket)")
        if self.open >= MAX_TERMINALS:
            raise CapacityExhausted(f"this apiserver already holds {MAX_TERMINALS} console terminals")
        self.open += 1
        try:
            events = link.start_process(sid, ProcessStart(argv=LOGIN_SHELL, pty=size))
            try:
                first = await anext(events, None)
                if first is None or first.t != "start":
                    raise InfraFailure(f"a terminal's stream began with {first!r}, not its start")
                await ws.prepare(request)
                await self._join(ws, link, sid, first.pid, events)
                return ws
            finally:
                await events.aclose()
        finally:
            self.open -= 1

    async def _join(
        self,
        ws: web.WebSocketResponse,
        link: EdgeLink,
        sid: str,
        pid: int,
        events: AsyncGenerator[ProcessEvent, None],
    ) -> None:
        await ws.send_str(json.dumps({"t": "start", "pid": pid}))
        output = asyncio.create_task(self._copy_out(ws, events))
        keys = asyncio.create_task(self._copy_in(ws, link, sid, pid))
        try:
            await asyncio.wait({output, keys}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (output, keys):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            ended = output.done() and not output.cancelled() and output.exception() is None
            if not ended:  # the browser went: hang up, as a closing terminal would
                with contextlib.suppress(DSecError):
                    await link.signal_process(sid, pid, signal.SIGHUP)
            await ws.close()

    async def _copy_out(self, ws: web.WebSocketResponse, events: AsyncGenerator[ProcessEvent, None]) -> None:
        async for event in events:
            if event.t == "pty" and event.data:
                await ws.send_bytes(event.data)
            elif event.t == "end":
                code = 128 + event.signal if event.signal else (event.exit_code or 0)
                await ws.send_str(json.dumps({"t": "end", "exit_code": code, "error": event.error}))
                return

    async def _copy_in(self, ws: web.WebSocketResponse, link: EdgeLink, sid: str, pid: int) -> None:
        # One message at a time, in order: a command typed after a resize runs at the new size.
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await link.send_process_input(sid, pid, msg.data)
            elif msg.type == WSMsgType.TEXT:
                try:
                    control = CONTROL.validate_json(msg.data)
                except ValidationError as exc:
                    reason = f"bad control message: {exc.errors()[0]['msg']}"[:120]
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=reason.encode())
                    return
                if isinstance(control, Resize):
                    await link.resize_process(sid, pid, PtySize(rows=control.rows, cols=control.cols))
                else:
                    await link.signal_process(sid, pid, control.signal)
            elif msg.type == WSMsgType.ERROR:  # too large a frame, among others: aiohttp closes it
                log.info("console terminal %s/%d: %s", sid, pid, ws.exception())
                return
