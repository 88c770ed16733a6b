"""What both HTTP servers (apiserver, edge) share: their JSON answer, query parsing, listening."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from dsec.protocol.errors import InvalidRequest


def respond(model: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> web.Response:
    if isinstance(model, BaseModel):
        text = model.model_dump_json()
    elif isinstance(model, list):
        text = json.dumps([m.model_dump(mode="json") if isinstance(m, BaseModel) else m for m in model])
    else:
        text = json.dumps(model)
    return web.Response(text=text, status=status, content_type="application/json")


def label_filter(request: web.Request) -> dict[str, str]:
    """``?label=k=v&label=...`` as a dict (``InvalidRequest`` for an item without ``=``)."""
    labels: dict[str, str] = {}
    for item in request.query.getall("label", []):
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"label filter {item!r} must be key=value")
        labels[key] = value
    return labels


def count_param(request: web.Request, name: str, default: int) -> int:
    """A non-negative integer query parameter (``InvalidRequest`` otherwise)."""
    try:
        value = int(request.query.get(name, default))
    except ValueError as exc:
        raise InvalidRequest(f"query parameter {name!r} must be an integer") from exc
    if value < 0:
        raise InvalidRequest(f"query parameter {name!r} must not be negative")
    return value


async def listen(app: web.Application, host: str, port: int, **runner: Any) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``host:port`` (0: any free port); the runner and the URL it answers on."""
    r = web.AppRunner(app, access_log=None, **runner)
    await r.setup()
    await web.TCPSite(r, host, port).start()
    bound = r.addresses[0][1] if port == 0 else port
    return r, f"http://{host}:{bound}"
