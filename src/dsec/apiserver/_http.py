"""Small HTTP helpers shared by the apiserver's route modules."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from dsec.iam import IamStore, Principal
from dsec.protocol.errors import Forbidden, TooLarge
from dsec.protocol.http import file_mode_param, label_filter, respond, text_param

__all__ = [
    "IAM_KEY",
    "PRINCIPAL",
    "body_to_file",
    "file_mode_param",
    "label_filter",
    "query_param",
    "read_body",
    "require_admin",
    "respond",
    "stream_bytes",
]

M = TypeVar("M", bound=BaseModel)
_CHUNK = 1 << 20

IAM_KEY = web.AppKey("iam", IamStore)
PRINCIPAL = web.RequestKey("principal", Principal)


async def read_body(request: web.Request, model: type[M]) -> M:
    # Malformed JSON and bad fields both raise ValidationError: a 400 naming the field.
    return model.model_validate_json(await request.read() or b"{}")


def require_admin(request: web.Request) -> None:
    if not request[PRINCIPAL].admin:
        raise Forbidden("this needs an admin API key")


def query_param(request: web.Request, name: str) -> str:
    """A required query parameter; a path or reference, so without NUL (``text_param``)."""
    return text_param(request, name)


async def stream_bytes(
    request: web.Request, chunks: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """Answer with ``chunks`` as an octet stream. The first chunk is awaited before the status
    is sent, so an error the stream raises at once (a missing file) is still a proper 4xx;
    ``chunks`` is closed however this ends (a client gone mid-way stops the reading)."""
    try:
        first = await anext(chunks, b"")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", **(headers or {})})
        await resp.prepare(request)
        if first:
            await resp.write(first)
        async for chunk in chunks:
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        await chunks.aclose()


@contextlib.asynccontextmanager
async def body_to_file(
    request: web.Request, directory: Path, suffix: str, *, max_bytes: int | None = None
) -> AsyncIterator[Path]:
    """The request body streamed into a temporary file in ``directory`` (never whole in
    memory, written off the event loop); the file is removed when the block ends.

    A body longer than ``max_bytes`` is ``TooLarge`` (413), told by its Content-Length before
    anything is read, or as soon as the bytes received pass it (chunked bodies have none)."""
    if max_bytes is not None and (request.content_length or 0) > max_bytes:
        raise TooLarge(f"the upload is {request.content_length} bytes; the cap is {max_bytes}")
    with tempfile.NamedTemporaryFile(dir=directory, suffix=suffix) as tmp:
        received = 0
        async for chunk in request.content.iter_chunked(_CHUNK):
            received += len(chunk)
            if max_bytes is not None and received > max_bytes:
                raise TooLarge(f"the upload is more than {max_bytes} bytes, the cap")
            await asyncio.to_thread(tmp.write, chunk)
        await asyncio.to_thread(tmp.flush)
        yield Path(tmp.name)
