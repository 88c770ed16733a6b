"""The proxy's side towards the registries: one HTTP client for the node, names resolved by
the edge's own upstream resolver (:class:`~dsec.netpolicy.upstream.Upstream`, cached), bodies
bounded, and index documents (PyPI project pages, npm packuments) reused for a while and
fetched once for all who ask at the same time."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from dsec.netpolicy.upstream import Upstream

MAX_DOCS = 512  # index documents kept parsed in memory
USER_AGENT = "dsec-registry-proxy"


class UpstreamError(Exception):
    """The registry answered with an error (``status``) or not at all (``status`` 502)."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class _Resolver(AbstractResolver):
    """aiohttp's name lookups through the edge's resolver (the node's upstream servers)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        answer = await self.upstream.resolve(host.lower().rstrip("."))
        if not answer.addresses:
            raise OSError(f"{host} does not resolve upstream (rcode {answer.rcode})")
        return [
            ResolveResult(
                hostname=host, host=a, port=port, family=socket.AF_INET, proto=0, flags=socket.AI_NUMERICHOST
            )
            for a in answer.addresses
        ]

    async def close(self) -> None:
        return None


class Fetcher:
    def __init__(
        self,
        upstream: Upstream,
        *,
        max_file: int,
        max_doc: int,
        doc_ttl_s: float,
        ca_file: Path | None = None,
    ) -> None:
        self.upstream = upstream
        # Verified always: the system's authorities, and the operator's own if named.
        self._tls = ssl.create_default_context()
        if ca_file is not None:
            self._tls.load_verify_locations(cafile=str(ca_file))
        self.max_file, self.max_doc, self.doc_ttl_s = max_file, max_doc, doc_ttl_s
        self._session: aiohttp.ClientSession | None = None
        self._docs: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Any]] = {}
        self.doc_fetches = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=_Resolver(self.upstream), limit=64, ssl=self._tls),
                timeout=aiohttp.ClientTimeout(total=900, sock_connect=15, sock_read=120),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def document(self, url: str, accept: str) -> Any:
        """The parsed JSON at ``url``: from memory if fetched less than the TTL ago, else
        fetched (once for every concurrent asker)."""
        hit = self._docs.get(url)
        if hit is not None and time.monotonic() - hit[0] < self.doc_ttl_s:
            self._docs.move_to_end(url)
            return hit[1]
        pending = self._inflight.get(url)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inflight[url] = future
        try:
            doc = await self._get_json(url, accept)
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()
            else:
                future.cancel()
            raise
        finally:
            del self._inflight[url]
        future.set_result(doc)
        self._docs[url] = (time.monotonic(), doc)
        while len(self._docs) > MAX_DOCS:
            self._docs.popitem(last=False)
        return doc

    async def _get_json(self, url: str, accept: str) -> Any:
        self.doc_fetches += 1
        try:
            async with self._client().get(url, headers={"Accept": accept}) as resp:
                if resp.status != 200:
                    raise UpstreamError(
                        resp.status if resp.status in (404, 410) else 502, f"upstream {resp.status}"
                    )
                body = await _read_bounded(resp, self.max_doc)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _unreachable(exc) from exc
        try:
            return json.loads(body)
        except ValueError as exc:
            raise UpstreamError(502, "upstream sent no JSON") from exc

    async def file(self, url: str, destination: Path) -> int:
        """Write the body at ``url`` to ``destination``; its size."""
        size = 0
        try:
            async with self._client().get(url) as resp:
                if resp.status != 200:
                    raise UpstreamError(
                        resp.status if resp.status in (404, 410) else 502, f"upstream {resp.status}"
                    )
                if (resp.content_length or 0) > self.max_file:
                    raise UpstreamError(502, f"upstream file larger than {self.max_file} bytes")
                with destination.open("wb") as out:
                    async for chunk in resp.content.iter_chunked(1 << 20):
                        size += len(chunk)
                        if size > self.max_file:
                            raise UpstreamError(502, f"upstream file larger than {self.max_file} bytes")
                        out.write(chunk)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _unreachable(exc) from exc
        return size


def _unreachable(exc: BaseException) -> UpstreamError:
    """What the sandbox's client is told (a 502 with this text): a certificate the proxy does
    not trust is named as such, not as a network failure."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        why = getattr(exc.certificate_error, "verify_message", None) or exc.certificate_error
        return UpstreamError(
            502, f"upstream {exc.host}:{exc.port} presented a TLS certificate the proxy does not trust: {why}"
        )
    if isinstance(exc, aiohttp.ClientSSLError):
        return UpstreamError(502, f"upstream TLS failed: {exc}")
    return UpstreamError(502, f"upstream unreachable: {exc}")


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if (resp.content_length or 0) > limit:
        raise UpstreamError(502, f"upstream document larger than {limit} bytes")
    parts, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise UpstreamError(502, f"upstream document larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
