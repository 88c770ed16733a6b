"""Small HTTP helpers shared by the apiserver's route modules."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from dsec.iam import IamStore, Principal
from dsec.protocol.errors import Forbidden, InvalidRequest

M = TypeVar("M", bound=BaseModel)

IAM_KEY = web.AppKey("iam", IamStore)
PRINCIPAL = web.RequestKey("principal", Principal)


def respond(model: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> web.Response:
    if isinstance(model, BaseModel):
        text = model.model_dump_json()
    elif isinstance(model, list):
        text = json.dumps([m.model_dump(mode="json") if isinstance(m, BaseModel) else m for m in model])
    else:
        text = json.dumps(model)
    return web.Response(text=text, status=status, content_type="application/json")


async def read_body(request: web.Request, model: type[M]) -> M:
    # Malformed JSON and bad fields both raise ValidationError: a 400 naming the field.
    return model.model_validate_json(await request.read() or b"{}")


def label_filter(request: web.Request) -> dict[str, str]:
    labels = {}
    for item in request.query.getall("label", []):
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"label filter {item!r} must be key=value")
        labels[key] = value
    return labels


def require_admin(request: web.Request) -> None:
    if not request[PRINCIPAL].admin:
        raise Forbidden("this needs an admin API key")


def query_param(request: web.Request, name: str) -> str:
    value = request.query.get(name)
    if not value:
        raise InvalidRequest(f"query parameter {name!r} is required")
    return value
