"""The HTTP link (what a cluster's apiservers use) passes the link conformance suite against a
real edge server on 127.0.0.1, plus what only a wire adds: secrets, node identity, epochs
learned from answers, and streams that break off."""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from dsec.apiserver.remote_edge import RemoteEdgeLink, never_reached_edge
from dsec.edge.edge import Edge
from dsec.edge.link import EdgeLink, LocalEdgeLink
from dsec.edge.server import EPOCH_HEADER, NODE_HEADER, SECRET_ENV, EdgeServer, read_cluster_secret
from dsec.protocol.errors import InfraFailure, InvalidRequest, SandboxNotFound, Unauthorized, error_from_wire
from dsec.protocol.models import ContainerSpec
from dsec.protocol.ops import Exec, Stream

from .conftest import CT_NODE, NODE, EdgeEnv
from .link_conformance import LinkConformance, drain, read_all, spec

SECRET = secrets.token_urlsafe(32)
E = TypeVar("E")


@pytest.fixture
async def server(edge_env: EdgeEnv) -> AsyncIterator[EdgeServer]:
    srv = EdgeServer(edge_env.edge, SECRET)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.close()


class Links:
    """Remote links made by a test; all closed at its end."""

    def __init__(self) -> None:
        self.made: list[RemoteEdgeLink] = []

    def __call__(self, url: str, secret: str, node: str = NODE) -> RemoteEdgeLink:
        link = RemoteEdgeLink(url, secret, node, connect_timeout=2.0)
        self.made.append(link)
        return link


@pytest.fixture
async def links() -> AsyncIterator[Links]:
    made = Links()
    yield made
    for link in made.made:
        await link.close()


@pytest.fixture
def link(server: EdgeServer, links: Links) -> RemoteEdgeLink:
    return links(server.url, SECRET)


@pytest.fixture
def links_with_secret(server: EdgeServer, links: Links) -> Callable[[str | None], Awaitable[EdgeLink]]:
    async def make(secret: str | None) -> EdgeLink:
        bad = links(server.url, secret or "")
        if secret is None:
            bad._wire.headers.pop("Authorization")  # no header at all, not an empty bearer token
        return bad

    return make


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens here once the socket is closed


@pytest.fixture
def unreachable_link(links: Links) -> RemoteEdgeLink:
    return links(f"http://127.0.0.1:{closed_port()}", SECRET)


@pytest.fixture
async def ct_link(ct_edge: Edge, links: Links) -> AsyncIterator[RemoteEdgeLink]:
    srv = EdgeServer(ct_edge, SECRET)
    await srv.start("127.0.0.1", 0)
    yield links(srv.url, SECRET, node=CT_NODE)
    await srv.close()


class TestRemoteEdgeLink(LinkConformance):
    pass


# -- what only the wire adds ------------------------------------------------------------------


async def raw(
    url: str, method: str, path: str, headers: dict[str, str] | None = None
) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as http, http.request(method, url + path, headers=headers) as resp:
        await resp.read()
        return resp


async def test_refusals_are_wire_errors_that_reveal_nothing(server: EdgeServer) -> None:
    for headers in (None, {"Authorization": "Bearer " + "x" * 32}, {"Authorization": SECRET}):
        resp = await raw(server.url, "GET", "/edge/v1/stats", headers)
        assert resp.status == 401
        assert isinstance(error_from_wire(resp.status, json.loads(await resp.text())), Unauthorized)
        assert NODE_HEADER not in resp.headers and EPOCH_HEADER not in resp.headers
    ok = {"Authorization": f"Bearer {SECRET}"}
    resp = await raw(server.url, "GET", "/edge/v1/nowhere", ok)
    assert resp.status == 404
    assert isinstance(error_from_wire(404, json.loads(await resp.text())), InvalidRequest)
    resp = await raw(server.url, "GET", "/edge/v1/stats", ok)
    assert resp.headers[NODE_HEADER] == NODE


async def test_the_epoch_is_learned_from_any_answer(link: RemoteEdgeLink, edge_env: EdgeEnv) -> None:
    assert link.epoch is None  # not contacted yet: the apiserver defers to the edge's own check
    with pytest.raises(SandboxNotFound):
        await link.get(f"sb-{NODE}-{edge_env.edge.epoch}-" + "a" * 20)  # even an error answer
    assert link.epoch == edge_env.edge.epoch


async def test_an_address_that_is_another_node_is_refused(server: EdgeServer, links: Links) -> None:
    wrong = links(server.url, SECRET, node="edge-b")
    with pytest.raises(InfraFailure) as info:
        await wrong.stats()
    assert info.value.reason == "edge_misconfigured" and "edge-b" in info.value.message
    with pytest.raises(InfraFailure, match="edge_misconfigured"):
        await wrong.create(spec())


async def test_a_server_that_is_not_an_edge_is_a_protocol_failure(links: Links) -> None:
    from aiohttp import web

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"node": NODE})  # no edge headers: some other service

    app = web.Application()
    app.router.add_get("/edge/v1/stats", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        other = links(f"http://127.0.0.1:{runner.addresses[0][1]}", SECRET)
        with pytest.raises(InfraFailure) as info:
            await other.stats()
        assert info.value.reason == "protocol"
    finally:
        await runner.cleanup()


class BreakingLink(LocalEdgeLink):
    """An edge whose streams fail after they started: what a disk error or a bug looks like."""

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        async for chunk in super().read_stream(sandbox_id, path):
            yield chunk
            raise OSError("the disk went away")

    async def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        async for event in super().stream(sandbox_id, op):
            yield event
            if isinstance(op, Exec):
                raise SandboxNotFound("the sandbox vanished mid-command")


async def test_streams_that_break_off_are_errors_not_short_results(edge_env: EdgeEnv, links: Links) -> None:
    srv = EdgeServer(BreakingLink(edge_env.edge), SECRET)
    url = await srv.start()
    try:
        link = links(url, SECRET)
        info = await link.create(spec())
        await link.write_stream(info.id, "/two.bin", _chunks(b"a" * (1 << 20), b"b" * (1 << 20)))
        with pytest.raises(InfraFailure) as broke:
            await read_all(link, info.id, "/two.bin")
        assert broke.value.reason == "edge_unreachable"
        with pytest.raises(SandboxNotFound, match="mid-command"):  # the stream's last line
            await drain(link.exec_stream(info.id, ["sh", "-c", "echo one; sleep 0.2; echo two"]))
        await link.stop(info.id)
    finally:
        await srv.close()


async def test_an_edge_that_goes_away_mid_exec_is_unreachable(edge_env: EdgeEnv, links: Links) -> None:
    srv = EdgeServer(edge_env.edge, SECRET, shutdown_timeout=0.5)
    link = links(await srv.start(), SECRET)
    info = await link.create(ContainerSpec(image=spec().image))
    events = link.exec_stream(info.id, ["sh", "-c", "echo started; sleep 60"])
    assert (await anext(events)).t == "out"
    await srv.close()
    with pytest.raises(InfraFailure) as gone:
        await anext(events)
    assert gone.value.reason == "edge_unreachable" and NODE in gone.value.message
    assert not never_reached_edge(gone.value)  # it ran: repeating it elsewhere is not safe
    await edge_env.edge.stop(info.id)


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_the_cluster_secret_is_read_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert read_cluster_secret(path) == SECRET
    monkeypatch.setenv(SECRET_ENV, "e" * 20)
    assert read_cluster_secret() == "e" * 20
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(InvalidRequest, match=SECRET_ENV):
        read_cluster_secret()
    path.write_text("short")
    with pytest.raises(InvalidRequest, match="at least 16"):
        read_cluster_secret(path)
    with pytest.raises(InvalidRequest, match="cannot read"):
        read_cluster_secret(tmp_path / "missing")


async def test_a_create_that_never_reached_the_edge_is_safe_to_place_elsewhere(
    unreachable_link: RemoteEdgeLink,
) -> None:
    with pytest.raises(InfraFailure) as refused:
        await unreachable_link.create(spec())
    assert never_reached_edge(refused.value)
    assert not never_reached_edge(InfraFailure("x", reason="edge_unreachable"))
    assert not never_reached_edge(SandboxNotFound("x"))
