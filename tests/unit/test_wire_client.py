"""The one wire client (:mod:`dsec.protocol.wire_client`) against a loopback aiohttp server:
errors by code, NDJSON streams, the response hook, and retrying only what never left."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import BaseModel

from dsec.protocol.errors import (
    Conflict,
    ConflictReason,
    InfraFailure,
    InfraReason,
    SandboxNotFound,
)
from dsec.protocol.wire_client import WireClient, ndjson, never_sent, unreachable


class Event(BaseModel):
    n: int


async def _conflict(_: web.Request) -> web.Response:
    return web.json_response(
        Conflict("port 80 closed", reason=ConflictReason.port_closed).to_wire(), status=409
    )


async def _not_found(_: web.Request) -> web.Response:
    return web.json_response(SandboxNotFound("no such sandbox").to_wire(), status=404)


async def _not_dsec(_: web.Request) -> web.Response:
    return web.Response(text="<html>bad gateway</html>", status=502)


async def _events(_: web.Request) -> web.Response:
    return web.Response(text='{"n": 1}\n\n{"n": 2}\n')


async def _failed_mid_stream(_: web.Request) -> web.Response:
    fail = InfraFailure("the edge failed mid-stream", reason=InfraReason.edge).to_wire()
    return web.Response(text='{"n": 1}\n' + json.dumps(fail) + "\n")


async def _malformed(_: web.Request) -> web.Response:
    return web.Response(text='{"n": 1}\nnot json\n')


async def _echo_headers(request: web.Request) -> web.Response:
    return web.json_response({"auth": request.headers.get("Authorization")}, headers={"X-Node": "n1"})


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/conflict", _conflict)
    app.router.add_get("/missing", _not_found)
    app.router.add_get("/not-dsec", _not_dsec)
    app.router.add_get("/events", _events)
    app.router.add_get("/failed", _failed_mid_stream)
    app.router.add_get("/malformed", _malformed)
    app.router.add_get("/headers", _echo_headers)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _get(client: WireClient, path: str) -> Any:
    async with client.send("GET", path) as resp:
        return await resp.json()


async def test_errors_come_back_as_their_class_by_code(server: str) -> None:
    client = WireClient(server, {})
    try:
        with pytest.raises(Conflict) as conflict:
            await _get(client, "/conflict")
        assert conflict.value.reason is ConflictReason.port_closed
        with pytest.raises(SandboxNotFound):
            await _get(client, "/missing")
        with pytest.raises(InfraFailure) as other:
            await _get(client, "/not-dsec")
        assert other.value.reason is InfraReason.protocol and "502" in other.value.message
    finally:
        await client.close()


async def test_headers_go_out_and_every_response_meets_the_hook(server: str) -> None:
    seen: list[tuple[int, str | None]] = []
    client = WireClient(
        server,
        {"Authorization": "Bearer k"},
        on_response=lambda r: seen.append((r.status, r.headers.get("X-Node"))),
    )
    try:
        assert await _get(client, "/headers") == {"auth": "Bearer k"}
        with pytest.raises(SandboxNotFound):
            await _get(client, "/missing")
    finally:
        await client.close()
    assert seen == [(200, "n1"), (404, None)]  # the hook runs before the status is checked


async def _events_of(client: WireClient, path: str) -> list[int]:
    async with client.send("GET", path) as resp:
        return [e.n async for e in ndjson(resp, Event, peer="the test server")]


async def test_ndjson_streams_parse_and_raise_what_the_server_sent(server: str) -> None:
    client = WireClient(server, {})
    try:
        assert await _events_of(client, "/events") == [1, 2]  # the blank line is skipped
        with pytest.raises(InfraFailure) as failed:
            await _events_of(client, "/failed")
        assert failed.value.reason is InfraReason.edge
        with pytest.raises(InfraFailure) as malformed:
            await _events_of(client, "/malformed")
        assert malformed.value.reason is InfraReason.protocol
        assert "the test server sent a malformed stream line" in malformed.value.message
    finally:
        await client.close()


class _RefusingFirst(WireClient):
    """A session whose first ``tries`` connections are refused before anything is sent."""

    def __init__(self, url: str, tries: int) -> None:
        super().__init__(url, {})
        self.refusals = tries
        self.attempts = 0

    def session(self) -> aiohttp.ClientSession:
        real = super().session()
        client = self

        class _Session:
            async def request(self, *args: Any, **kw: Any) -> aiohttp.ClientResponse:
                client.attempts += 1
                if client.refusals > 0:
                    client.refusals -= 1
                    key: Any = None
                    raise aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))
                return await real.request(*args, **kw)

        return _Session()  # type: ignore[return-value]


async def test_only_a_request_that_never_left_is_retried_and_only_when_asked(server: str) -> None:
    once = _RefusingFirst(server, tries=1)
    try:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await _get(once, "/headers")  # the default: nothing is retried
        assert once.attempts == 1 and never_sent(refused.value)
    finally:
        await once.close()
    twice = _RefusingFirst(server, tries=2)
    try:
        async with twice.send("GET", "/headers", retry_unsent=2) as resp:
            assert (await resp.json()) == {"auth": None}
        assert twice.attempts == 3
    finally:
        await twice.close()


async def test_a_refused_connection_is_unreachable_and_never_sent() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        client = WireClient(f"http://127.0.0.1:{sock.getsockname()[1]}", {})
        try:
            with pytest.raises(aiohttp.ClientError) as refused:
                await _get(client, "/x")
        finally:
            await client.close()
    assert never_sent(refused.value) and not never_sent(aiohttp.ServerDisconnectedError())
    err = unreachable("GET /x", refused.value, "edge 'n1' at http://h")
    assert err.reason is InfraReason.edge_unreachable
    assert err.message.startswith("edge 'n1' at http://h is unreachable (GET /x): ClientConnectorError")
