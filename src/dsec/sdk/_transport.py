"""The one HTTP seam of the SDK: every request goes through :class:`Transport`.

Errors come back typed: the server's ``{"error": {"code": ...}}`` body becomes the same
``DSecError`` subclass here; a connection failure becomes ``InfraFailure(reason="unreachable")``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
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


class Transport:
    def __init__(self, url: str, api_key: str, *, timeout: float) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
