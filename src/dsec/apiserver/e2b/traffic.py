"""E2B's sandbox traffic: ``sandbox.get_host(port)`` reached through the apiserver.

E2B's proxy routes a request by its Host, ``PORT-SANDBOXID.DOMAIN`` (what ``get_host`` returns),
or, when the Host cannot carry that (an IP address, ``localhost``), by the headers
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port``. Both are served here, before DSec's own routes and
authentication (traffic carries no API key):

- Host ``PORT-ID.<domain>``, ``<domain>`` the operator's ``--e2b-domain`` (answered to the SDKs
  as the sandbox's ``domain``), with a wildcard DNS record for ``*.<domain>`` pointing at the
  apiservers. Port 49983 is envd's: the request is served by the envd routes for that sandbox
  (a download URL the SDK makes without ``E2B_SANDBOX_URL`` names its sandbox so).
- Headers ``E2b-Sandbox-Id: ID`` and ``E2b-Sandbox-Port: PORT`` on any other Host: no DNS
  needed. Port 49983 (what the SDKs send with ``E2B_SANDBOX_URL``) stays envd's.

The request goes to the sandbox's edge, which connects to the port on the sandbox's loopback
(:mod:`dsec.edge.ports`): HTTP requests one per connection (``Connection: close`` upstream),
an HTTP upgrade (WebSocket) as bytes both ways once the server inside answered 101. What E2B's
proxy answers, DSec answers: a sandbox that does not exist, has ended or is paused (unless it
auto-resumes) is 502 "The sandbox was not found"; a port nothing listens on, 502 "The sandbox is
running but port is not open"; a sandbox created with ``allow_public_traffic=False`` wants its
``trafficAccessToken`` in ``e2b-traffic-access-token`` (403 without it or with a wrong one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from dsec.apiserver.e2b.envd import SANDBOX_HEADER, is_envd_path
from dsec.apiserver.e2b.lifecycle import auto_resumes
from dsec.apiserver.e2b.models import PRIVATE_TRAFFIC_LABEL
from dsec.apiserver.e2b.signed_urls import SignedUrlFinder
from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.ports import PORT_CLOSED, PortStream
from dsec.protocol.errors import (
    Conflict,
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
    SandboxNotFound,
)
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import SandboxState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENVD_PORT = 49983  # E2B's envd port: the SDKs' E2b-Sandbox-Port for envd calls
PORT_HEADER = "E2b-Sandbox-Port"
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"  # E2B's orchestrator proxy reads this one
MAX_RESPONSE_HEAD = 64 << 10  # the server inside's status line and headers
MAX_CHUNK_LINE = 4096  # a chunk-size line of a chunked response
_UPGRADE_BUFFER = 1 << 20  # client bytes held for the sandbox before reading pauses
_ID_SHOWN = 100
# Not forwarded either way: they describe one hop (RFC 9110 7.6.1), or are re-made here.
_HOP = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
              "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length", "Expect",
              TRAFFIC_TOKEN_HEADER)
)  # fmt: skip


def _answer(status: int, message: str, sandbox_id: str = "", **extra: Any) -> web.Response:
    body = {"sandboxId": sandbox_id[:_ID_SHOWN], "message": message, **extra, "code": status}
    return web.json_response(body, status=status)


def _not_found(sandbox_id: str) -> web.Response:
    return _answer(502, "The sandbox was not found", sandbox_id)


class _BadTarget(Exception):
    """A Host or header that names no sandbox port: E2B's proxy answers 400."""


def _port(raw: str) -> int:
    if not raw.isdigit() or len(raw) > 5 or not 1 <= int(raw) <= 65535:
        raise _BadTarget("Invalid sandbox port")
    return int(raw)


class Upstream:
    """The server inside, read through a port stream: its response head, then its body."""

    def __init__(self, stream: PortStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> bool:
        data = await self.stream.read()
        self.buf += data
        return bool(data)

    async def line(self, limit: int) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > limit or not await self._fill():
                raise InfraFailure("the server inside sent a malformed response", reason=InfraReason.upstream)
        out = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return out

    async def head(self) -> tuple[int, str, list[tuple[str, str]]]:
        """The status, reason and headers of the next response (interim 1xx skipped, 101 kept)."""
        while True:
            while (end := self.buf.find(b"\r\n\r\n")) < 0:
                if len(self.buf) > MAX_RESPONSE_HEAD:
                    raise InfraFailure(
                        "the server inside sent a response head over 64 KiB", reason=InfraReason.upstream
                    )
                if not await self._fill():
                    raise InfraFailure("the server inside closed the connection without answering",
                                       reason=InfraReason.upstream)  # fmt: skip
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            del self.buf[: end + 4]
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise InfraFailure("the server inside answered something that is not HTTP/1.x",
                                   reason=InfraReason.upstream)  # fmt: skip
            status = int(parts[1])
            headers = [(k.strip(), v.strip()) for k, sep, v in (h.partition(":") for h in lines[1:]) if sep]
            if not 100 <= status < 200 or status == 101:
                return status, parts[2] if len(parts) > 2 else "", headers

    async def exactly(self, n: int) -> AsyncIterator[bytes]:
        while n > 0:
            if not self.buf and not await self._fill():
                raise InfraFailure("the server inside cut its response short", reason=InfraReason.upstream)
            piece = bytes(self.buf[:n])
            del self.buf[: len(piece)]
            n -= len(piece)
            yield piece

    async def until_eof(self) -> AsyncIterator[bytes]:
        while self.buf or await self._fill():
            piece = bytes(self.buf)
            self.buf.clear()
            yield piece

    async def chunked(self) -> AsyncIterator[bytes]:
        while True:
            size_text = (await self.line(MAX_CHUNK_LINE)).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise InfraFailure(
                    "the server inside sent a malformed chunk", reason=InfraReason.upstream
                ) from None
            if size == 0:
                while await self.line(MAX_RESPONSE_HEAD):  # trailers, dropped
                    pass
                return
            async for piece in self.exactly(size):
                yield piece
            if await self.line(MAX_CHUNK_LINE):
                raise InfraFailure("the server inside sent a malformed chunk", reason=InfraReason.upstream)


class _ClientBytes:
    """What an upgraded client sends, fed by aiohttp's protocol (in a WebSocket parser's place)."""

    def __init__(self, transport: asyncio.Transport | None) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.held = 0
        self.transport = transport

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.queue.put_nowait(bytes(data))
        self.held += len(data)
        if self.held > _UPGRADE_BUFFER and self.transport is not None and self.transport.is_reading():
            self.transport.pause_reading()  # the sandbox reads slower than the client sends
        return False, b""

    def feed_eof(self) -> None:
        self.queue.put_nowait(None)

    async def get(self) -> bytes | None:
        data = await self.queue.get()
        if data:
            self.held -= len(data)
            if (
                self.held <= _UPGRADE_BUFFER // 2
                and self.transport is not None
                and not self.transport.is_closing()
            ):
                self.transport.resume_reading()
        return data


def _request_head(request: web.Request, upgrade: bool) -> bytes:
    lines = [f"{request.method} {request.raw_path} HTTP/1.1"]
    for name, value in request.raw_headers:
        if name.decode("latin-1").lower() not in _HOP:
            lines.append(f"{name.decode('latin-1')}: {value.decode('latin-1')}")
    if upgrade:
        lines += ["Connection: Upgrade", f"Upgrade: {request.headers['Upgrade']}"]
    else:
        lines.append("Connection: close")  # one request per connection: the response ends it
        if request.content_length is not None:
            lines.append(f"Content-Length: {request.content_length}")
        elif request.body_exists:
            lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send_body(request: web.Request, stream: PortStream) -> None:
    chunked = request.content_length is None and request.body_exists
    async for data in request.content.iter_any():
        await stream.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
    if chunked:
        await stream.write(b"0\r\n\r\n")


def _naming(request: web.Request, sandbox_id: str) -> web.Request:
    """The request as envd's routes take it: its sandbox in ``E2b-Sandbox-Id``."""
    headers = CIMultiDict(request.headers)
    headers[SANDBOX_HEADER] = sandbox_id
    return request.clone(headers=headers)


def _is_upgrade(request: web.Request) -> bool:
    tokens = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in tokens and bool(request.headers.get("Upgrade"))


class TrafficRoutes:
    """The middleware that takes sandbox traffic off DSec's routes (see the module's note)."""

    def __init__(
        self, sandboxes: SandboxRoutes, tokens: EnvdTokens, domain: Callable[[], str | None]
    ) -> None:
        self.sandboxes = sandboxes
        self.tokens = tokens
        self.domain = domain  # read per request: the operator's --e2b-domain, None: no Host scheme
        self.signed = SignedUrlFinder(sandboxes, tokens)

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.serve(request, handler)

        self.middleware = middleware  # the apiserver's first after the request ID's (app.py)

    def target(self, request: web.Request) -> tuple[str, int, bool] | None:
        """The sandbox ID and port a request is for, and whether its Host named them."""
        domain = self.domain()
        host = (request.host or "").lower()
        host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if domain and host.endswith("." + domain.lower()):
            label = host[: -len(domain) - 1]
            port, dash, sandbox_id = label.partition("-")
            if not dash or not sandbox_id or "." in label:
                raise _BadTarget("Invalid host")
            return sandbox_id, _port(port), True
        named, port_text = request.headers.get(SANDBOX_HEADER), request.headers.get(PORT_HEADER)
        if named and port_text and port_text != str(ENVD_PORT):
            return named, _port(port_text), False
        return None

    async def serve(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            found = self.target(request)
        except _BadTarget as exc:
            return _answer(400, str(exc))
        if found is None:
            unnamed = SANDBOX_HEADER not in request.headers and "signature" in request.query
            if unnamed and request.path == "/files" and (signed := await self.signed.find(request)):
                return await handler(_naming(request, signed))  # a signed URL made with E2B_SANDBOX_URL
            return await handler(request)
        sandbox_id, port, _ = found
        if port == ENVD_PORT:
            if not is_envd_path(request.path):
                return _answer(404, f"port {ENVD_PORT} serves only envd's routes", sandbox_id)
            return await handler(_naming(request, sandbox_id))  # the Host names the sandbox
        return await self.proxy(request, sandbox_id, port)

    async def _open(self, request: web.Request, sandbox_id: str, port: int) -> PortStream | web.Response:
        try:
            SandboxId.parse(sandbox_id)
        except InvalidRequest:
            return _answer(400, "Invalid sandbox ID", sandbox_id)
        try:
            link = self.sandboxes.link_for(sandbox_id)
            info = await link.get(sandbox_id)
            if info.state not in (SandboxState.running, SandboxState.paused):
                return _not_found(sandbox_id)
            if info.labels.get(PRIVATE_TRAFFIC_LABEL) == "false":
                refused = self._refused(request, sandbox_id)  # before a resume, as E2B's proxy
                if refused is not None:
                    return refused
            if info.state is SandboxState.paused and auto_resumes(info):
                info = await link.resume(sandbox_id)  # E2B's proxy resumes on traffic then
            if info.state is not SandboxState.running:
                return _not_found(sandbox_id)
            return await link.open_port(sandbox_id, port)
        except SandboxNotFound:
            return _not_found(sandbox_id)
        except Conflict as exc:
            if exc.reason != PORT_CLOSED:
                return _answer(exc.status, exc.message, sandbox_id)
            return _answer(502, "The sandbox is running but port is not open", sandbox_id, port=port)
        except InfraFailure as exc:
            return _answer(502, exc.message, sandbox_id)
        except DSecError as exc:
            return _answer(exc.status, exc.message, sandbox_id)

    def _refused(self, request: web.Request, sandbox_id: str) -> web.Response | None:
        """E2B's answers for a sandbox created with ``allow_public_traffic=False``."""
        given = request.headers.get(TRAFFIC_TOKEN_HEADER)
        secured = "Sandbox is secured with traffic access token."
        if not given:
            return _answer(403, f"{secured} Token header '{TRAFFIC_TOKEN_HEADER}' is missing", sandbox_id)
        if not hmac.compare_digest(given.encode(), self.tokens.issue_traffic(sandbox_id).encode()):
            message = f"{secured} Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
            return _answer(403, message, sandbox_id)
        return None

    async def proxy(self, request: web.Request, sandbox_id: str, port: int) -> web.StreamResponse:
        opened = await self._open(request, sandbox_id, port)
        if isinstance(opened, web.Response):
            return opened
        stream = opened
        upgrade = _is_upgrade(request)
        sending: asyncio.Task[None] | None = None
        try:
            await stream.write(_request_head(request, upgrade))
            if not upgrade and request.body_exists:
                sending = asyncio.create_task(_send_body(request, stream))  # the answer may come first
            upstream = Upstream(stream)
            try:
                status, reason, headers = await upstream.head()
            except InfraFailure as exc:
                return _answer(502, exc.message, sandbox_id, port=port)
            if status == 101 and upgrade:
                return await self._relay(request, upstream, reason, headers)
            return await self._respond(request, upstream, status, reason, headers)
        except (ConnectionError, InfraFailure) as exc:  # before any answer went out
            return _answer(502, f"the connection to port {port} broke: {exc}", sandbox_id, port=port)
        finally:
            if sending is not None:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, InfraFailure):
                    await sending
            await stream.close()

    async def _respond(
        self,
        request: web.Request,
        upstream: Upstream,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
    ) -> web.StreamResponse:
        out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in headers if k.lower() not in _HOP)
        resp = web.StreamResponse(status=status, reason=reason or None, headers=out)
        framing = {k.lower(): v for k, v in headers if k.lower() in ("content-length", "transfer-encoding")}
        body: AsyncIterator[bytes] | None
        if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            body = None
        elif "chunked" in framing.get("transfer-encoding", "").lower():
            body = upstream.chunked()
        elif framing.get("content-length", "").strip().isdigit():
            resp.content_length = int(framing["content-length"])
            body = upstream.exactly(resp.content_length)
        else:
            body = upstream.until_eof()
        if request.method == "HEAD" and framing.get("content-length", "").strip().isdigit():
            resp.headers["Content-Length"] = framing["content-length"]
        await resp.prepare(request)
        try:
            if body is not None:
                async for piece in body:
                    await resp.write(piece)
            await resp.write_eof()
        except (ConnectionError, InfraFailure):
            # The client or the server inside went away mid-answer: the status is out, so the
            # only honest signal left is to cut the connection before the body's end.
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _relay(
        self, request: web.Request, upstream: Upstream, reason: str, headers: list[tuple[str, str]]
    ) -> web.StreamResponse:
        """An upgrade the server inside accepted: its 101 to the client, then bytes both ways
        until either side ends (the other is then closed)."""
        out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in headers if k.lower() not in _HOP)
        upgrade_to = next((v for k, v in headers if k.lower() == "upgrade"), request.headers["Upgrade"])
        out["Connection"], out["Upgrade"] = "Upgrade", upgrade_to
        resp = web.StreamResponse(status=101, reason=reason or "Switching Protocols", headers=out)
        resp.force_close()
        await resp.prepare(request)
        client = _ClientBytes(request.transport)
        request.protocol.set_parser(client)  # type: ignore[arg-type]
        stream = upstream.stream

        async def to_sandbox() -> None:
            while data := await client.get():
                await stream.write(data)

        async def to_client() -> None:
            if upstream.buf:
                await resp.write(bytes(upstream.buf))
            while data := await stream.read():
                await resp.write(data)

        tasks = [asyncio.create_task(to_sandbox()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if request.transport is not None:
                request.transport.close()
        return resp
