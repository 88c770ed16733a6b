"""The audit log: one JSON line per admin action (keys, projects, quotas, layer tags, nodes).

Each line says who (the key's ID and project, whether it is an admin key), what (``action``),
on what (``target``: the query parameters and named body fields that say it, never a key's
secret), how it ended (``outcome``: ``ok``, ``refused`` for a 401/403, ``failed`` with the
error's ``code`` otherwise) and the request's ID. Lines go to a file the operator names
(``<data dir>/audit.log`` for ``dsec up``, ``dsec apiserver --audit-log``), opened append-only
and flushed to disk (``fsync``) per line, and to the ``dsec.audit`` logger. Nothing on the API
turns it off: the file is the operator's configuration, not a project's.

A route is audited with one decorator, outside its own checks, so a refused attempt is written
too::

    @audited("project.create", body=("parent", "name", "quota"))
    async def create(self, request: web.Request) -> web.Response: ...

A route whose action is decided inside it (a node's registration, not its every heartbeat)
calls :func:`record` itself.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import ValidationError

from dsec.apiserver._http import PRINCIPAL
from dsec.observe import request_ids
from dsec.protocol.errors import DSecError, Forbidden, Unauthorized

log = logging.getLogger("dsec.audit")
S = TypeVar("S")
Route = Callable[[S, web.Request], Awaitable[web.StreamResponse]]
_MAX_VALUE = 256  # characters of one target value kept: a path or a name, not a payload
_MAX_BODY = 64 << 10  # a body larger than this (an upload) is not read for the target


class AuditLog:
    """Appends audit lines to ``path`` (``None``: to the ``dsec.audit`` logger only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()  # one line at a time, and none after close
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_APPEND: every write lands at the end, even with two apiservers on one file.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def write(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` as one line and fsync it (blocking: call it off the event loop)."""
        # ASCII: a lone surrogate a client smuggled into a name is escaped, not an encode error.
        line = json.dumps(entry, default=str) + "\n"
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line.encode())
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


AUDIT_KEY = web.AppKey("dsec_audit", AuditLog)


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_MAX_VALUE]
    if isinstance(value, bool | int | float) or value is None:
        return value
    return json.dumps(value, default=str)[:_MAX_VALUE]


def _who(request: web.Request) -> dict[str, Any]:
    principal = request.get(PRINCIPAL)
    if principal is None:
        return {"key_id": None, "project": None, "admin": False}
    return {"key_id": principal.key_id, "project": principal.project, "admin": principal.admin}


def outcome_of(exc: BaseException | None) -> dict[str, Any]:
    """``outcome`` (and ``error``, the code) of an action that raised ``exc`` (None: it did not)."""
    if exc is None:
        return {"outcome": "ok"}
    if isinstance(exc, Unauthorized | Forbidden):
        return {"outcome": "refused", "error": exc.code}
    if isinstance(exc, DSecError):
        return {"outcome": "failed", "error": exc.code}
    if isinstance(exc, ValidationError):
        return {"outcome": "failed", "error": "invalid_request"}
    if isinstance(exc, web.HTTPException):
        return {"outcome": "failed", "error": f"http_{exc.status}"}
    return {"outcome": "failed", "error": type(exc).__name__}


async def record(
    request: web.Request,
    action: str,
    target: dict[str, Any],
    exc: BaseException | None = None,
    who: dict[str, Any] | None = None,
) -> None:
    """Write one audit line for ``action`` on ``target`` as ``request`` ended (``exc``: how it
    failed). ``who``: the actor, when it is not the request's key (a node)."""
    entry = {
        "ts": time.time(),
        "who": who or _who(request),
        "action": action,
        "target": {k: _bounded(v) for k, v in target.items()},
        **outcome_of(exc),
        "request_id": request_ids.current(),
    }
    log.info("audit %s %s", action, entry["outcome"], extra={"audit": entry})
    audit = request.app.get(AUDIT_KEY)
    if audit is None:
        return
    try:
        await asyncio.to_thread(audit.write, entry)
    except (OSError, ValueError):
        # The action already happened: it stands, and the operator is told loudly.
        log.exception("cannot write the audit log %s", audit.path)


async def _target(request: web.Request, query: Iterable[str], body: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: request.query[k] for k in query if k in request.query}
    out.update({k: v for k, v in request.match_info.items()})
    body = tuple(body)
    if body and request.body_exists and (request.content_length or 0) <= _MAX_BODY:
        try:
            # aiohttp keeps the body it read for the route: this reads it again from memory.
            obj = json.loads(await request.read() or b"{}")
        except (ValueError, web.HTTPException, ConnectionError):
            obj = None
        if isinstance(obj, dict):
            out.update({k: obj[k] for k in body if k in obj})
    return out


def audited(
    action: str, *, query: Iterable[str] = (), body: Iterable[str] = ()
) -> Callable[[Route[S]], Route[S]]:
    """Audit a route method: ``action`` on the target named by the ``query`` parameters and the
    JSON ``body`` fields listed (and the route's path parameters), whatever the outcome."""
    query, body = tuple(query), tuple(body)

    def wrap(route: Route[S]) -> Route[S]:
        @functools.wraps(route)
        async def audited_route(self: S, request: web.Request) -> web.StreamResponse:
            try:
                response = await route(self, request)
            except Exception as exc:  # not a cancellation: nothing may be awaited after one
                await record(request, action, await _target(request, query, body), exc)
                raise
            await record(request, action, await _target(request, query, body))
            return response

        return audited_route

    return wrap
