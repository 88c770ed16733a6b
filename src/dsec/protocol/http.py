"""What both HTTP servers (apiserver, edge) share: their JSON answer, query parsing, listening."""

from __future__ import annotations

import hmac
import json
import re
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from pydantic import BaseModel

from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, InvalidRequest, Unauthorized
from dsec.protocol.files import decode_name

# As ContainerSpec's labels: a filter that could match no label is a typo, said so at once.
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
MAX_LABEL_FILTERS = 64
MAX_LABEL_VALUE = 256
# SQLite integers are 64-bit: a trajectory cursor past this overflowed in the query (a 500).
MAX_COUNT = (1 << 63) - 1
MAX_FILE_MODE = 0o7777
_OCTAL_RE = re.compile(r"[0-7]{1,6}")
# Entries a trajectory page holds at most: each may carry a command's output.
MAX_TRAJECTORY_PAGE = 10_000


# nginx's word for it: the client closed its connection before the answer was written.
CLIENT_CLOSED_REQUEST = 499


def client_went(request: web.Request, exc: Exception) -> web.Response | None:
    """An answer for ``exc`` when it only means the client hung up mid-answer (a stream it
    stopped reading): that is no server error, and there is nobody left to send a body to."""
    transport = request.transport
    if isinstance(exc, ConnectionResetError) and (transport is None or transport.is_closing()):
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    return None


def respond(model: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> web.Response:
    if isinstance(model, BaseModel):
        text = model.model_dump_json()
    elif isinstance(model, list):
        text = json.dumps([m.model_dump(mode="json") if isinstance(m, BaseModel) else m for m in model])
    else:
        text = json.dumps(model)
    return web.Response(text=text, status=status, content_type="application/json")


def label_filter(request: web.Request) -> dict[str, str]:
    """``?label=k=v&label=...`` as a dict; ``InvalidRequest`` for an item without ``=`` or with
    a key or value no sandbox label can have."""
    items = request.query.getall("label", [])
    if len(items) > MAX_LABEL_FILTERS:
        raise InvalidRequest(f"at most {MAX_LABEL_FILTERS} label filters")
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"label filter {item[:100]!r} must be key=value")
        if not _LABEL_KEY_RE.match(key) or len(value) > MAX_LABEL_VALUE or "\0" in value:
            raise InvalidRequest(
                f"label filter {item[:100]!r}: keys are 1-63 of A-Za-z0-9._/-, values at most"
                f" {MAX_LABEL_VALUE} characters"
            )
        labels[key] = value
    return labels


def count_param(request: web.Request, name: str, default: int, maximum: int = MAX_COUNT) -> int:
    """An integer query parameter from 0 to ``maximum`` (``InvalidRequest`` otherwise)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    # Digits only, and few of them: int() accepts "+1", "1_000", unicode digits, and takes
    # quadratic time on a very long string.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 20:
        raise InvalidRequest(f"query parameter {name!r} must be an integer from 0 to {maximum}")
    value = int(raw)
    if value > maximum:
        raise InvalidRequest(f"query parameter {name!r} must be at most {maximum}")
    return value


def text_param(request: web.Request, name: str, default: str | None = None) -> str:
    """A query parameter that may reach the OS (a path): required unless a ``default`` is given,
    and without NUL (a C string would end there; the edge raised it as a 500). A name that is
    not UTF-8 comes as ``{name}_b64`` (its bytes, :func:`~dsec.protocol.files.path_query`) and
    is returned as a surrogateescape ``str``, which every ``os`` call takes back as those bytes."""
    raw = request.query.get(f"{name}_b64")
    if raw is not None and name not in request.query:
        try:
            return decode_name(raw, name)
        except ValueError as exc:
            raise InvalidRequest(f"query parameter {exc}") from exc
    value = request.query.get(name) or default
    if not value:
        raise InvalidRequest(f"query parameter {name!r} is required")
    if "\0" in value:
        raise InvalidRequest(f"query parameter {name!r} must not contain a NUL character")
    if len(value) > 4096:  # PATH_MAX
        raise InvalidRequest(f"query parameter {name!r} is longer than 4096 characters")
    return value


def flag_param(request: web.Request, name: str, default: bool) -> bool:
    """``true`` or ``false``: anything else is a typo, not a silent ``false``."""
    value = request.query.get(name)
    if value is None:
        return default
    if value not in ("true", "false"):
        raise InvalidRequest(f"query parameter {name!r} must be true or false")
    return value == "true"


def file_mode_param(request: web.Request, default: str = "644") -> int:
    """``?mode=`` in octal, 0 to 7777: a larger one used to be masked silently to its low bits."""
    raw = request.query.get("mode", default)
    if not _OCTAL_RE.fullmatch(raw) or int(raw, 8) > MAX_FILE_MODE:
        raise InvalidRequest(f"mode must be octal from 0 to 7777, e.g. 644 (not {raw[:20]!r})")
    return int(raw, 8)


class _JsonErrorHandler(RequestHandler):
    """What aiohttp answers itself, before any middleware runs (a header past 8190 bytes, a
    malformed request line, a handler that raised past the middlewares), in DSec's error shape
    rather than aiohttp's text: every answer of a DSec server is a wire error a client parses."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if bytes went out
        why = (message or HTTPStatus(status).phrase)[:200]  # the message may quote the request
        err: DSecError = InvalidRequest(why) if status < 500 else InfraFailure(why, reason=InfraReason.http)
        resp = web.json_response(err.to_wire(), status=status)
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds its Server itself; the subclass differs only in the handler it makes.
        server.__class__ = _JsonErrorServer
        return server


async def listen(app: web.Application, host: str, port: int, **runner: Any) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``host:port`` (0: any free port); the runner and the URL it answers on."""
    r = _Runner(app, access_log=None, **runner)
    await r.setup()
    await web.TCPSite(r, host, port).start()
    bound = r.addresses[0][1] if port == 0 else port
    return r, f"http://{host}:{bound}"


def require_cluster_secret(request: web.Request, secret: bytes) -> None:
    """``Unauthorized`` unless the request carries the cluster secret as its bearer token (an
    edge's routes, an apiserver's membership and cluster metrics routes)."""
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        raise Unauthorized("missing cluster secret (Authorization: Bearer ...)")
    # Constant time: the comparison must not tell an attacker how much of a guess was right.
    if not hmac.compare_digest(header[7:].encode(), secret):
        raise Unauthorized("wrong cluster secret")
