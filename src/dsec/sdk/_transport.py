"""The one HTTP seam of the SDK: every request goes through :class:`Transport`, the SDK's
:class:`~dsec.protocol.wire_client.WireClient` (the same client the apiserver uses to reach edges).

A sandbox operation (:mod:`dsec.protocol.ops`) goes through one method, :meth:`Transport.call`:
the op as JSON to ``POST /v1/sandboxes/{id}/ops/{kind}``, its answer parsed as the op names it::

    info = await transport.call(sandbox_id, Pause())  # -> SandboxInfo

Errors come back typed: the server's ``{"error": {"code": ...}}`` body becomes the same
``DSecError`` subclass here; a connection failure becomes
``InfraFailure(reason="edge_unreachable")``, the reason the apiserver gives for an edge it
cannot reach (one :class:`~dsec.protocol.errors.InfraReason` for "the server could not be reached").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import aiohttp
from pydantic import ValidationError

from dsec.protocol.errors import DSecError, InfraFailure, InfraReason
from dsec.protocol.ops import Call
from dsec.protocol.wire_client import WireClient, ndjson_lines, unreachable

R = TypeVar("R")
_CHUNK = 1 << 20
_JSON = {"Content-Type": "application/json"}


async def file_chunks(path: Path) -> AsyncIterator[bytes]:
    """A local file as a request body (``data=``): a stream of chunks, read off the event loop."""
    fh = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(fh.read, _CHUNK):
            yield chunk
    finally:
        fh.close()


async def _closed_with_its_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await session.close()


def _close_with_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Tie ``session`` to the running loop's end, for clients nobody closes (the paper's
    Listing 1, a script's ``DSec()``): an async generator started on a loop is registered
    with it, and ``asyncio.run()`` (the sync portal's loop likewise) closes every one still
    open before it closes the loop; one dropped earlier is closed on its loop when collected.
    Closing it closes the session, so aiohttp has nothing left to warn about."""
    closer = _closed_with_its_loop(session)
    # Run it to its first yield without awaiting: asend() is where the loop's hooks see it.
    with contextlib.suppress(StopIteration):
        closer.asend(None).send(None)
    return closer


class Transport(WireClient):
    """The SDK's client of the apiserver: :class:`~dsec.protocol.wire_client.WireClient` with
    the API key on every request, a session closed with its event loop, and network failures
    raised at once as ``InfraFailure(reason="edge_unreachable")``."""

    def __init__(self, url: str, api_key: str, *, timeout: float) -> None:
        super().__init__(
            url,
            {"Authorization": f"Bearer {api_key}"},
            session_timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )
        self._timeout = timeout
        self._closer: AsyncGenerator[None, None] | None = None

    def session(self) -> aiohttp.ClientSession:
        fresh = not self.has_session
        session = super().session()
        if fresh:
            self._closer = _close_with_loop(session)
        return session

    async def close(self) -> None:
        closer, self._closer = self._closer, None
        await super().close()
        if closer is not None:
            await closer.aclose()

    @asynccontextmanager
    async def _send(
        self, method: str, path: str, timeout: aiohttp.ClientTimeout, **kw: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        try:
            async with self.send(method, path, timeout=timeout, **kw) as resp:
                yield resp
        except DSecError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise unreachable(f"{method} {path}", exc) from exc

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | list[tuple[str, str]] | None = None,
        data: Any = None,
        timeout: float | None = None,
    ) -> Any:
        limit = aiohttp.ClientTimeout(total=timeout or self._timeout)
        async with self._send(method, path, limit, json_body=json_body, params=params, data=data) as resp:
            return await resp.json()

    async def call(self, sandbox_id: str, op: Call[R], *, timeout: float | None = None) -> R:
        """Run ``op`` on sandbox ``sandbox_id``; its answer, of the type the op names."""
        limit = aiohttp.ClientTimeout(total=timeout or self._timeout)
        path = f"/v1/sandboxes/{sandbox_id}/ops/{op.kind}"
        async with self._send("POST", path, limit, data=op.model_dump_json(), headers=_JSON) as resp:
            raw = await resp.read()
        try:
            return cast(R, op.adapter.validate_json(raw))
        except ValidationError as exc:
            # Version skew between this SDK and the server: not the caller's mistake.
            raise InfraFailure(
                f"the server sent a malformed answer to {op.kind}: {exc}", reason=InfraReason.protocol
            ) from exc

    async def stream(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield the response body in chunks as they arrive."""
        limit = aiohttp.ClientTimeout(total=timeout, sock_read=None)
        async with self._send(method, path, limit, json_body=json_body, params=params) as resp:
            async for chunk in resp.content.iter_chunked(1 << 20):
                yield chunk

    async def lines(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        data: Any = None,
        timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield the lines of a newline-delimited response as they arrive."""
        limit = aiohttp.ClientTimeout(total=timeout)
        async with self._send(method, path, limit, json_body=json_body, params=params, data=data) as resp:
            async for line in ndjson_lines(resp):
                yield line
