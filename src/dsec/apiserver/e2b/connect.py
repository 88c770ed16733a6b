"""The Connect protocol (connectrpc.com/docs/protocol), JSON codec only, over aiohttp.

E2B's SDKs call envd with Connect's JSON codec: unary calls are a plain JSON body answered
with a JSON body (an error is a non-200 status with ``{"code", "message"}``); server streams
send one enveloped request and get enveloped messages back (a 5-byte header: flags, then the
big-endian length), the last one flagged end-of-stream and carrying the error, if any, with
the HTTP status still 200. Client streams are the mirror image. Binary protobuf is refused
with 415: every SDK version we serve sends JSON, and a hand-written protobuf codec would be
code to keep right for no caller.

Field names follow protobuf's JSON mapping: readers accept both ``lowerCamel`` and the
``snake_case`` proto name (:func:`field`); writers emit ``lowerCamel`` and leave out default
values, as protobuf does, since older SDK parsers drop unknown fields but not wrong types.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from aiohttp import web

from dsec.protocol.errors import (
    CapacityExhausted,
    CommandTimeout,
    Conflict,
    DSecError,
    FileNotFound,
    Forbidden,
    InvalidRequest,
    QuotaExceeded,
    SandboxNotFound,
    Unauthorized,
)

T = TypeVar("T")
END_STREAM = 0x02
_COMPRESSED = 0x01
_HEADER = struct.Struct(">BI")
MAX_MESSAGE = 16 << 20
KEEPALIVE_HEADER = "Keepalive-Ping-Interval"
TIMEOUT_HEADER = "Connect-Timeout-Ms"
_MAX_TIMEOUT_MS = 86_400_000

# Connect's codes and the HTTP status each is sent with on unary calls (the protocol's table).
_HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        assert code in _HTTP_STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self.code]


def from_dsec(exc: DSecError) -> ConnectError:
    """The Connect code an SDK maps to the same exception a DSec client would raise."""
    code = "internal"
    if isinstance(exc, (SandboxNotFound, FileNotFound)) or exc.status == 404:
        code = "not_found"
    elif isinstance(exc, InvalidRequest):
        code = "invalid_argument"
    elif isinstance(exc, Unauthorized):
        code = "unauthenticated"
    elif isinstance(exc, Forbidden):
        code = "permission_denied"
    elif isinstance(exc, Conflict):
        code = "already_exists"
    elif isinstance(exc, QuotaExceeded):
        code = "resource_exhausted"
    elif isinstance(exc, CapacityExhausted):
        code = "unavailable"
    elif isinstance(exc, CommandTimeout):
        code = "deadline_exceeded"
    return ConnectError(code, str(exc))


def field(msg: dict[str, Any], camel: str, default: Any = None) -> Any:
    """``msg[camel]``, or its snake_case proto name (a JSON parser must accept both)."""
    if camel in msg:
        return msg[camel]
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return msg.get(snake, default)


def _check_json(request: web.Request, streaming: bool) -> None:
    ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
    wanted = "application/connect+json" if streaming else "application/json"
    if ctype != wanted:
        raise ConnectError(
            "unimplemented", f"content type {ctype!r} is not served: use {wanted} (JSON codec)"
        )
    encoding = request.headers.get(
        "Connect-Content-Encoding" if streaming else "Content-Encoding", "identity"
    )
    if encoding not in ("identity", ""):
        raise ConnectError("unimplemented", f"compression {encoding!r} is not served")


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"request is not valid JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "request must be a JSON object")
    return msg


async def read_unary(request: web.Request) -> dict[str, Any]:
    _check_json(request, streaming=False)
    if request.content_length is not None and request.content_length > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"request larger than {MAX_MESSAGE} bytes")
    return _decode(await request.read())


async def _read_envelope(content: Any) -> tuple[int, bytes] | None:
    try:
        header = await content.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectError("invalid_argument", "truncated envelope header") from exc
    flags, length = _HEADER.unpack(header)
    if length > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"message larger than {MAX_MESSAGE} bytes")
    if flags & _COMPRESSED:
        raise ConnectError("unimplemented", "compressed messages are not served")
    try:
        return flags, await content.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ConnectError("invalid_argument", "truncated envelope") from exc


async def read_stream_request(request: web.Request) -> dict[str, Any]:
    """The single request message of a server-streaming call."""
    _check_json(request, streaming=True)
    envelope = await _read_envelope(request.content)
    return _decode(envelope[1]) if envelope else {}


async def read_client_stream(request: web.Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a client-streaming call, as they arrive."""
    _check_json(request, streaming=True)
    while (envelope := await _read_envelope(request.content)) is not None:
        flags, data = envelope
        if flags & END_STREAM:
            return
        yield _decode(data)


def unary_response(msg: dict[str, Any]) -> web.Response:
    return web.Response(body=json.dumps(msg).encode(), content_type="application/json")


def unary_error(exc: ConnectError) -> web.Response:
    return web.json_response(exc.to_wire(), status=exc.http_status)


def _envelope(flags: int, msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(data)) + data


def timeout_s(request: web.Request) -> float | None:
    """The call's deadline from ``Connect-Timeout-Ms`` (None: none)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    # At most a day (as a command's timeout): a huge integer overflowed the float division.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12 or int(raw) > _MAX_TIMEOUT_MS:
        raise ConnectError("invalid_argument", f"{TIMEOUT_HEADER} must be an integer of ms up to a day")
    ms = int(raw)
    return ms / 1000 if ms > 0 else None


class ServerStream:
    """The response side of a server-streaming call: ``send`` messages, then ``end``."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "application/connect+json", "Connect-Content-Encoding": "identity"}
        )
        self._ended = False
        self._lock = asyncio.Lock()  # keepalives come from another task

    async def send(self, msg: dict[str, Any]) -> None:
        async with self._lock:
            if not self.response.prepared:
                await self.response.prepare(self.request)
            await self.response.write(_envelope(0, msg))

    async def end(self, error: ConnectError | None = None) -> web.StreamResponse:
        async with self._lock:
            if not self._ended:
                self._ended = True
                if not self.response.prepared:
                    await self.response.prepare(self.request)
                await self.response.write(_envelope(END_STREAM, {"error": error.to_wire()} if error else {}))
                await self.response.write_eof()
        return self.response

    def keepalive_s(self) -> float | None:
        """The client's wish (``Keepalive-Ping-Interval``, seconds) for keepalive events."""
        raw = self.request.headers.get(KEEPALIVE_HEADER)
        try:
            wish = float(raw) if raw else None
        except ValueError:
            return None
        # "inf", "nan" and 1e400 parse: a keepalive between 1 s and an hour is what makes sense.
        return None if wish is None or not math.isfinite(wish) else min(max(1.0, wish), 3600.0)


async def pump(
    stream: ServerStream,
    events: AsyncGenerator[T, None],
    wrap: Callable[[T], dict[str, Any]],
    keepalive: dict[str, Any],
) -> web.StreamResponse:
    """Send each of ``events`` as a message, and ``keepalive`` whenever it has been quiet for the
    client's keepalive interval; an error (before or after the first event) ends the stream
    with its Connect code. Closing ``events`` at the end detaches from whatever produces them."""
    interval = stream.keepalive_s()
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                await stream.send(keepalive)
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return await stream.end()
            await stream.send(wrap(item))
    except SandboxNotFound as exc:
        if not stream.response.prepared:
            raise  # before the stream: E2B's proxy answers for the missing sandbox (a 502)
        return await stream.end(from_dsec(exc))
    except DSecError as exc:
        return await stream.end(from_dsec(exc))
    except ConnectError as exc:
        return await stream.end(exc)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, DSecError):
                await pending
        await events.aclose()
