"""How the apiserver's link to an edge classifies a node it cannot reach: ``node_lost`` once the
registry says the node is gone (or came back as another epoch), ``edge_unreachable`` while it
still heartbeats. A real HTTP server stands in for the edge; the registry's reads are driven
by hand through ``follow``, as the membership does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from dsec.apiserver.remote_edge import RemoteEdgeLink, never_reached_edge
from dsec.edge.server import PREFIX
from dsec.protocol.errors import InfraFailure, InfraReason
from dsec.protocol.models import ShellRequest
from dsec.rl import fault_of
from tests.support import eventually
from tests.unit.test_cluster import free_port

NODE, EPOCH, SID = "n1", 3, "sb-n1-3-" + "a" * 20
LOST_AFTER = 5.0


class FakeEdge:
    """Answers a shell (``ops/run_shell``) by calling ``on_shell`` (which may hang or drop the connection)."""

    def __init__(self) -> None:
        self.shell_started = asyncio.Event()
        self.on_shell: Callable[[web.Request], Awaitable[web.StreamResponse]] = self._hang

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def shell(self, request: web.Request) -> web.StreamResponse:
        self.shell_started.set()
        return await self.on_shell(request)


async def drop_connection(request: web.Request) -> web.StreamResponse:
    """What an edge killed mid-command looks like from the apiserver: the socket closes."""
    assert request.transport is not None
    request.transport.close()
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.fixture
async def edge() -> AsyncIterator[tuple[FakeEdge, str]]:
    fake = FakeEdge()
    app = web.Application()
    app.router.add_post(PREFIX + "/sandboxes/{id}/ops/run_shell", fake.shell)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _link(url: str, *, last_seen_ago: float) -> RemoteEdgeLink:
    link = RemoteEdgeLink(url, "secret-for-tests", NODE, epoch=EPOCH, connect_timeout=2.0)
    link.view.lost_after_s, link.view.read_interval_s = LOST_AFTER, 0.05
    now = time.time()
    link.follow(url, EPOCH, now - last_seen_ago, now)
    return link


def _read(link: RemoteEdgeLink, *, epoch: int = EPOCH, last_seen_ago: float) -> None:
    now = time.time()
    link.follow(link.url, epoch, now - last_seen_ago, now)


async def _shell(link: RemoteEdgeLink) -> object:
    return await link.run_shell(SID, ShellRequest(command="sleep 1000"))


async def test_a_node_that_refuses_connections_is_unreachable_until_declared_lost() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    link = await _link(url, last_seen_ago=0.0)
    try:
        with pytest.raises(InfraFailure) as live:
            await link.get(SID)
        assert live.value.reason == "edge_unreachable"
        _read(link, last_seen_ago=LOST_AFTER + 1)
        with pytest.raises(InfraFailure) as lost:
            await link.get(SID)
        assert lost.value.reason == InfraReason.node_lost and NODE in lost.value.message
        assert never_reached_edge(lost.value), "a create refused this way may go to another node"
        assert fault_of(lost.value) == "infra"
    finally:
        await link.close()


async def test_a_command_waiting_on_a_node_declared_lost_is_cut(edge: tuple[FakeEdge, str]) -> None:
    fake, url = edge
    link = await _link(url, last_seen_ago=0.0)
    try:
        command = asyncio.create_task(_shell(link))
        await fake.shell_started.wait()
        _read(link, last_seen_ago=1.0)  # a beat missed: not lost yet
        await asyncio.sleep(0)
        assert not command.done()
        _read(link, last_seen_ago=LOST_AFTER + 1)
        with pytest.raises(InfraFailure) as cut:
            await command
        assert cut.value.reason == InfraReason.node_lost
        assert not never_reached_edge(cut.value)  # it ran there: never repeated elsewhere
    finally:
        await link.close()


async def test_a_command_whose_node_came_back_as_another_epoch_is_node_lost(
    edge: tuple[FakeEdge, str],
) -> None:
    fake, url = edge
    link = await _link(url, last_seen_ago=0.0)
    try:
        command = asyncio.create_task(_shell(link))
        await fake.shell_started.wait()
        _read(link, epoch=EPOCH + 1, last_seen_ago=0.0)
        with pytest.raises(InfraFailure) as cut:
            await command
        assert cut.value.reason == InfraReason.node_lost and f"epoch {EPOCH}" not in cut.value.message
    finally:
        await link.close()


async def test_a_broken_connection_waits_for_the_verdict(edge: tuple[FakeEdge, str]) -> None:
    fake, url = edge
    fake.on_shell = drop_connection
    link = await _link(url, last_seen_ago=0.0)
    try:
        # The node stops heartbeating: the broken command answers node_lost once it is declared.
        command = asyncio.create_task(_shell(link))
        await eventually(lambda: fake.shell_started.is_set() and link.view.in_flight == 0, "the break")
        await asyncio.sleep(0)
        assert not command.done(), "answered before the registry had a say"
        _read(link, last_seen_ago=LOST_AFTER + 1)
        with pytest.raises(InfraFailure) as lost:
            await command
        assert lost.value.reason == InfraReason.node_lost

        # The node heartbeats after the break: it lives, only this connection failed.
        _read(link, last_seen_ago=0.0)
        fake.shell_started.clear()
        command = asyncio.create_task(_shell(link))
        await eventually(lambda: fake.shell_started.is_set() and link.view.in_flight == 0, "the break")
        _read(link, last_seen_ago=0.0)  # a beat recorded after the break
        with pytest.raises(InfraFailure) as unreachable:
            await command
        assert unreachable.value.reason == "edge_unreachable"
    finally:
        await link.close()


async def test_a_caller_that_hangs_up_is_not_turned_into_node_lost(edge: tuple[FakeEdge, str]) -> None:
    fake, url = edge
    link = await _link(url, last_seen_ago=0.0)
    try:
        command = asyncio.create_task(_shell(link))
        await fake.shell_started.wait()
        command.cancel()
        _read(link, last_seen_ago=LOST_AFTER + 1)  # lost while the cancellation is on its way
        with pytest.raises(asyncio.CancelledError):
            await command
    finally:
        await link.close()
