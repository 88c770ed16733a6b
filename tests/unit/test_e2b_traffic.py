"""The E2B traffic proxy's pieces that need no sandbox: reading the server inside's response
(heads, bodies by length, chunked or to the end, bounds) and finding the sandbox a signed file
URL is for (apiserver/e2b/traffic.py, apiserver/e2b/signed_urls.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from dsec.apiserver.e2b import signed_urls
from dsec.apiserver.e2b.signed_urls import SignedUrlFinder, signature
from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.e2b.traffic import MAX_RESPONSE_HEAD, Upstream
from dsec.protocol.errors import InfraFailure
from dsec.protocol.ids import SandboxId


class Script:
    """A port stream that answers with ``pieces``, then end-of-file."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = list(pieces)

    async def read(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""

    async def write(self, data: bytes) -> None:
        pass

    async def write_eof(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def _body(chunks: Any) -> bytes:
    return b"".join([c async for c in chunks])


async def test_a_chunked_response_split_anywhere_is_decoded() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n"
    raw += b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nTrailer: x\r\n\r\n"
    up = Upstream(Script(*(raw[i : i + 3] for i in range(0, len(raw), 3))))
    assert await up.head() == (200, "OK", [("Transfer-Encoding", "chunked"), ("X-A", "1")])
    assert await _body(up.chunked()) == b"hello world"


async def test_bodies_by_length_and_to_the_end() -> None:
    up = Upstream(Script(b"HTTP/1.0 404 Not Found\r\nContent-Length: 3\r\n\r\nab", b"cEXTRA"))
    assert (await up.head())[0] == 404
    assert await _body(up.exactly(3)) == b"abc"
    up = Upstream(Script(b"HTTP/1.0 200 OK\r\n\r\nall", b" of it"))
    await up.head()
    assert await _body(up.until_eof()) == b"all of it"
    up = Upstream(Script(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"))
    await up.head()
    with pytest.raises(InfraFailure, match="cut its response short"):
        await _body(up.exactly(10))


async def test_what_is_not_an_http_answer_is_refused() -> None:
    with pytest.raises(InfraFailure, match="over 64 KiB"):
        await Upstream(Script(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (MAX_RESPONSE_HEAD // 6 + 1))).head()
    with pytest.raises(InfraFailure, match="not HTTP"):
        await Upstream(Script(b"SSH-2.0-OpenSSH\r\n\r\n")).head()
    with pytest.raises(InfraFailure, match="without answering"):
        await Upstream(Script(b"HTTP/1.1 200")).head()
    up = Upstream(Script(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"))
    await up.head()
    with pytest.raises(InfraFailure, match="malformed chunk"):
        await _body(up.chunked())


class Link:
    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    async def sandbox_ids(self) -> list[str]:
        return self.ids


def _request(query: dict[str, str], method: str = "GET") -> Any:
    return SimpleNamespace(query=query, method=method)


async def test_a_signed_url_finds_the_sandbox_whose_token_signed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = EnvdTokens()
    ids = [str(SandboxId("n1", 1, SandboxId.new_tag())) for _ in range(200)]
    finder = SignedUrlFinder(SimpleNamespace(links={"n1": Link(ids)}), tokens)  # type: ignore[arg-type]
    mine = ids[137]
    later = int(time.time()) + 60
    read = signature("/tmp/a", "read", "user", tokens.issue(mine), later)
    query = {"path": "/tmp/a", "username": "user", "signature": read, "signature_expiration": str(later)}
    assert await finder.find(_request(query)) == mine
    assert await finder.find(_request(query, "POST")) is None  # signed for reading, not writing
    write = signature("/tmp/a", "write", None, tokens.issue(mine), None)
    assert await finder.find(_request({"path": "/tmp/a", "signature": write}, "POST")) == mine
    expired = {**query, "signature_expiration": str(int(time.time()) - 1)}
    assert await finder.find(_request(expired)) is None
    assert await finder.find(_request({"path": "/tmp/a", "signature": "v1_" + "A" * 43})) is None

    # Unnamed URLs are unauthenticated work: once the budget is spent, they are refused.
    monkeypatch.setattr(signed_urls, "SEARCH_SHARE", 0.0)
    spent = SignedUrlFinder(SimpleNamespace(links={"n1": Link(ids)}), tokens)  # type: ignore[arg-type]
    assert await spent.find(_request(query)) is None
    assert await finder.find(_request(query)) == mine  # one already found is remembered
