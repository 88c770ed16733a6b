"""E2B's secrets API (``/secrets``), as E2B's API server answers it
(packages/api/internal/handlers/secrets.go): metadata out, values in and never out.

``POST /secrets`` {name, value, metadata?} -> 201; ``GET /secrets?limit=&nextToken=`` -> 200,
oldest first, ``X-Next-Token`` while more remain; ``GET /secrets/{secretID}`` -> 200;
``POST /secrets/{secretID}`` {value, metadata?} -> 200, a new version (an omitted metadata keeps
the secret's, a present one, even ``{}``, replaces it); ``DELETE /secrets/{secretID}`` -> 204.
``{secretID}`` is the secret's ID (``sec_...``) or its name. A secret is in the project of the
key that made it and is seen by keys of that project and of the projects above it, as volumes
are; to any other key it is "Secret not found", as one that does not exist. Every answer is
``Cache-Control: no-store`` (E2B's ``NoStoreSecrets``). Storage and bounds: secret_store.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL
from dsec.apiserver.e2b.secret_store import (
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY_BYTES,
    MAX_METADATA_VALUE_BYTES,
    MAX_NAME_BYTES,
    MAX_VALUE_BYTES,
    SecretRecord,
    SecretStore,
    invalid,
    normalize_name,
    parse_selector,
)

PREFIX = "/secrets"
Changed = Callable[[str, str, bool], Awaitable[None]]
MAX_BODY_BYTES = 512 << 10  # a 64 KiB value all escapes (\u0001: 6 bytes a byte) and its metadata
MAX_LIST_LIMIT = 100  # E2B's paginationLimit: minimum 1, default and maximum 100
_SPEC_NAME_RE = re.compile(rf"[a-zA-Z0-9_-]{{1,{MAX_NAME_BYTES}}}")  # NewSecret.name's pattern
_LIMIT_RE = re.compile(r"[0-9]{1,9}")
_TOKEN_RE = re.compile(r"sec_[0-9a-z]{26}")


def is_secrets_path(path: str) -> bool:
    """E2B's ``isSecretsPath``: ``/secrets`` and below, matched or not."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def _answer(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers={"Cache-Control": "no-store", **(headers or {})})


async def _body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, read no further than :data:`MAX_BODY_BYTES`."""
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise invalid(f"the body is larger than {MAX_BODY_BYTES >> 10} KiB")
    buf = bytearray()
    while len(buf) <= MAX_BODY_BYTES:
        chunk = await request.content.read(MAX_BODY_BYTES + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    if len(buf) > MAX_BODY_BYTES:
        raise invalid(f"the body is larger than {MAX_BODY_BYTES >> 10} KiB")
    try:
        body = json.loads(bytes(buf))
    except (ValueError, RecursionError):
        raise invalid("the body is not JSON") from None
    if not isinstance(body, dict):
        raise invalid("the body is not a JSON object")
    return body


def _text(raw: object, what: str, max_bytes: int) -> str:
    if not isinstance(raw, str):
        raise invalid(f"{what} must be a string")
    if "\0" in raw:
        raise invalid(f"{what} holds a NUL character")
    try:
        size = len(raw.encode())
    except UnicodeEncodeError:
        raise invalid(f"{what} is not valid Unicode (a lone surrogate)") from None
    if size > max_bytes:
        raise invalid(f"{what} is longer than {max_bytes} bytes (UTF-8)")
    return raw


def _value(body: dict[str, Any]) -> str:
    if "value" not in body:
        raise invalid("value is required")
    return _text(body["value"], "value", MAX_VALUE_BYTES)


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    """``metadata`` as E2B's ``SecretMetadata`` bounds it; None when the body has none."""
    if "metadata" not in body:
        return None
    raw = body["metadata"]
    if not isinstance(raw, dict):
        raise invalid("metadata must be an object of strings")
    if len(raw) > MAX_METADATA_ENTRIES:
        raise invalid(f"metadata holds at most {MAX_METADATA_ENTRIES} entries")
    total = 0
    for key, value in raw.items():
        _text(key, "a metadata key", MAX_METADATA_KEY_BYTES)
        _text(value, "a metadata value", MAX_METADATA_VALUE_BYTES)
        total += len(key.encode()) + len(value.encode())
    if total > MAX_METADATA_BYTES:
        raise invalid(f"metadata is larger than {MAX_METADATA_BYTES} bytes (keys and values)")
    return dict(raw)


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit")
    if raw is None or raw == "":
        return MAX_LIST_LIMIT
    if not _LIMIT_RE.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise invalid(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}")
    return int(raw)


class SecretRoutes:
    """``changed(project, name, deleted)`` hears of every update and delete (running sandboxes
    follow: :mod:`.secret_refill`)."""

    def __init__(self, store: SecretStore, changed: Changed | None = None) -> None:
        self.store = store
        self.changed = changed

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post(PREFIX, self.create)
        r.add_get(PREFIX, self.list_secrets)
        r.add_get(PREFIX + "/{secretID}", self.get)
        r.add_post(PREFIX + "/{secretID}", self.update)
        r.add_delete(PREFIX + "/{secretID}", self.delete)

    @staticmethod
    def _selector(request: web.Request) -> tuple[str, str]:
        return parse_selector(request.match_info["secretID"])

    async def create(self, request: web.Request) -> web.Response:
        project = request[PRINCIPAL].project
        body = await _body(request)
        raw_name = body.get("name")
        if not isinstance(raw_name, str) or not _SPEC_NAME_RE.fullmatch(raw_name):
            raise invalid(f"name must be 1-{MAX_NAME_BYTES} of A-Z, a-z, 0-9, '_', '-'")
        name = normalize_name(raw_name)
        if name is None:
            raise invalid("the sec_ prefix is reserved for secret IDs")
        value, metadata = _value(body), _metadata(body)
        rec = await self.store.create(project, name, value, metadata or {})
        return _answer(rec.wire(), 201)

    async def list_secrets(self, request: web.Request) -> web.Response:
        limit = _limit(request)
        token = request.query.get("nextToken") or None
        if token is not None and not _TOKEN_RE.fullmatch(token):
            raise invalid("nextToken is not one this API gave")
        records: list[SecretRecord] = await self.store.list(request[PRINCIPAL].project)
        if token is not None:
            records = [r for r in records if r.id > token]
        page = records[:limit]
        more = {"X-Next-Token": page[-1].id} if len(records) > limit else {}
        return _answer([r.wire() for r in page], headers=more)

    async def get(self, request: web.Request) -> web.Response:
        rec = await self.store.get(request[PRINCIPAL].project, self._selector(request))
        return _answer(rec.wire())

    async def update(self, request: web.Request) -> web.Response:
        selector = self._selector(request)  # E2B: the selector before the body
        body = await _body(request)
        value, metadata = _value(body), _metadata(body)
        rec = await self.store.update(request[PRINCIPAL].project, selector, value, metadata)
        if self.changed is not None:
            await self.changed(rec.project, rec.name, False)
        return _answer(rec.wire())

    async def delete(self, request: web.Request) -> web.Response:
        project, selector = request[PRINCIPAL].project, self._selector(request)
        rec = await self.store.get(project, selector)
        await self.store.delete(project, selector)
        if self.changed is not None:
            await self.changed(rec.project, rec.name, True)
        return web.Response(status=204, headers={"Cache-Control": "no-store"})


__all__ = ["MAX_BODY_BYTES", "MAX_LIST_LIMIT", "SecretRoutes", "is_secrets_path"]
