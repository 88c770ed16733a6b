"""The one HTTP seam of the SDK: every request goes through :class:`Transport`.

Errors come back typed: the server's ``{"error": {"code": ...}}`` body becomes the same
``DSecError`` subclass here; a connection failure becomes ``InfraFailure(reason="unreachable")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from dsec.protocol.errors import DSecError, InfraFailure, error_from_wire

_CHUNK = 1 << 20


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


class Transport:
    def __init__(self, url: str, api_key: str, *, timeout: float) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._closer: AsyncGenerator[None, None] | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._closer = _close_with_loop(self._session)
        return self._session

    async def close(self) -> None:
        session, closer = self._session, self._closer
        self._session = self._closer = None
        if session is not None:
            await session.close()
        if closer is not None:
            await closer.aclose()

    async def _raise_for(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        text = await resp.text()
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        raise error_from_wire(resp.status, body)

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
        try:
            async with self.session().request(
                method,
                self.url + path,
                json=json_body,
                params=params,
                data=data,
                timeout=aiohttp.ClientTimeout(total=timeout or self._timeout),
            ) as resp:
                await self._raise_for(resp)
                return await resp.json()
        except DSecError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InfraFailure(f"{method} {path}: {type(exc).__name__}: {exc}", reason="unreachable") from exc

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
        try:
            async with self.session().request(
                method,
                self.url + path,
                json=json_body,
                params=params,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_read=None),
            ) as resp:
                await self._raise_for(resp)
                async for chunk in resp.content.iter_chunked(1 << 20):
                    yield chunk
        except DSecError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InfraFailure(f"{method} {path}: {type(exc).__name__}: {exc}", reason="unreachable") from exc

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
        try:
            async with self.session().request(
                method,
                self.url + path,
                json=json_body,
                params=params,
                data=data,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                await self._raise_for(resp)
                async for line in resp.content:
                    if line.strip():
                        yield line
        except DSecError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InfraFailure(f"{method} {path}: {type(exc).__name__}: {exc}", reason="unreachable") from exc
