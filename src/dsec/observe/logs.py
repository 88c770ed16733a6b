"""Structured logs: one JSON object a line, each carrying the ID of the request it belongs to.

Every DSec process logs through the standard :mod:`logging`; :func:`configure` (called once
by ``dsec up``, ``dsec apiserver``, ``dsec edge``) installs one handler on the root logger with
:class:`JsonFormatter` (servers' default: a log shipper reads it without a parser of its own)
or :class:`TextFormatter` (a person at a terminal). A record's ``extra`` fields become keys
of its JSON object; the request ID (:mod:`dsec.observe.request_ids`) is added to every record
written while a request is handled, whichever logger wrote it.

Both servers' apps put :func:`request_middleware` outside their error middleware, so it sees
every answer: it takes the request's ID (or makes one), writes one access line per request
(``dsec.<service>.access``: successes at DEBUG, client errors at INFO, server errors at
WARNING), adds the ID to a DSec error body (``{"error": {..., "request_id": ...}}``), and
:func:`echo_request_id` (the app's ``on_response_prepare``) puts it in the ``X-Request-ID``
header of every answer, streams included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import IO, Any, Literal

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dsec.observe import request_ids
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.http import CLIENT_CLOSED_REQUEST

LogFormat = Literal["json", "text"]
LEVELS = ("debug", "info", "warning", "error")
REQUEST_ID_KEY = web.RequestKey("dsec_request_id", str)
# An error body larger than this is not parsed again to add the ID (none of DSec's is).
_MAX_ERROR_BODY = 64 << 10

# What every LogRecord has: the rest of its __dict__ is what the caller passed as ``extra``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "request_id"}


class RequestIdFilter(logging.Filter):
    """Gives every record the current request's ID (``record.request_id``, None outside one).
    On the handler, not a logger: a logger's filters skip records its children write."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_ids.current()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``,
    ``request_id`` (when in a request), the record's ``extra`` fields, and ``exc`` (the
    traceback) when there is one. A newline in a message stays inside its JSON string."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # ASCII: a lone surrogate from a request (a file name) must not fail the write.
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time logger level [request id] message key=value...``: for a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        )
        rid = getattr(record, "request_id", None)
        head, sep, rest = line.partition("\n")  # keep a traceback below the first line
        head = f"{head} [{rid}]" if rid else head
        return f"{head} {extras}{sep}{rest}" if extras else f"{head}{sep}{rest}"


class _DSecHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure` installs (found again by its class, to be replaced)."""


def configure(level: str = "info", fmt: LogFormat = "json", stream: IO[str] | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) as ``fmt``, from ``level`` up.

    Called again, it replaces the handler it installed before (and leaves others alone)."""
    if level.lower() not in LEVELS:
        raise InvalidRequest(f"log level {level!r}: one of {', '.join(LEVELS)}")
    if fmt not in ("json", "text"):
        raise InvalidRequest(f"log format {fmt!r}: json or text")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DSecHandler)]:
        root.removeHandler(old)
    handler = _DSecHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's own access log is off (protocol.http.listen): the access lines are ours.


def _with_id_in_body(response: web.StreamResponse, rid: str) -> None:
    """Add ``request_id`` to a DSec error body not yet sent (``{"error": {"code", ...}}``)."""
    if not isinstance(response, web.Response) or response.prepared:
        return
    if response.content_type != "application/json":
        return
    body = response.body
    if not isinstance(body, bytes) or len(body) > _MAX_ERROR_BODY:
        return
    try:
        obj = json.loads(body)
    except ValueError:
        return
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and "code" in err and "message" in err:
        err["request_id"] = rid
        response.body = json.dumps(obj).encode()


def request_middleware(service: str) -> Middleware:
    """The middleware of one server (``service``: ``apiserver`` or ``edge``): the request's ID
    in the context while it is handled, one access line when it ends, the ID in an error body."""
    access = logging.getLogger(f"dsec.{service}.access")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request_ids.accept(request.headers.get(request_ids.HEADER))
        request[REQUEST_ID_KEY] = rid
        token = request_ids.REQUEST_ID.set(rid)
        started = time.monotonic()
        status = 500  # a handler that raised past every middleware: aiohttp answers 500
        try:
            response = await handler(request)
            status = response.status
            if status >= 400:
                _with_id_in_body(response, rid)
            return response
        except web.HTTPException as exc:  # a redirect, or an error below our error middleware
            status = exc.status
            raise
        except asyncio.CancelledError:  # its client hung up (or the server shut down): no answer
            status = CLIENT_CLOSED_REQUEST
            raise
        finally:
            level = logging.DEBUG if status < 400 else logging.INFO if status < 500 else logging.WARNING
            if access.isEnabledFor(level):
                # Still percent-encoded (a %0a must not start a forged text line); no query
                # string (it may carry a signed URL's token).
                path = request.rel_url.raw_path[:1024]
                access.log(
                    level,
                    "%s %s %d",
                    request.method,
                    path,
                    status,
                    extra={
                        "method": request.method,
                        "path": path,
                        "status": status,
                        "duration_ms": round((time.monotonic() - started) * 1000, 3),
                    },
                )
            request_ids.REQUEST_ID.reset(token)

    return middleware


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request's ID in the ``X-Request-ID`` header of its answer
    (a stream's too, whose headers leave before the middleware sees it)."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is not None:
        response.headers[request_ids.HEADER] = rid
