"""``EdgeLink.metrics`` (the samples E2B's ``get_metrics`` reads) over the in-process link and
over the wire, against real container sandboxes (the session's ``ct_edge``)."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.edge.edge import Edge
from dsec.edge.link import EdgeLink, LocalEdgeLink
from dsec.edge.server import EdgeServer
from dsec.protocol.errors import SandboxNotFound
from dsec.protocol.models import ContainerSpec, ShellRequest

from .conftest import BUSYBOX, CT_NODE

SECRET = secrets.token_urlsafe(32)


@pytest.fixture
async def server(ct_edge: Edge) -> AsyncIterator[EdgeServer]:
    srv = EdgeServer(ct_edge, SECRET)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.close()


@pytest.fixture(params=["local", "remote"])
async def link(request: pytest.FixtureRequest, ct_edge: Edge, server: EdgeServer) -> AsyncIterator[EdgeLink]:
    made: LocalEdgeLink | RemoteEdgeLink
    if request.param == "local":
        made = LocalEdgeLink(ct_edge)
    else:
        made = RemoteEdgeLink(server.url, SECRET, CT_NODE, connect_timeout=2.0)
    yield made
    await made.close()


async def test_samples_cross_the_link_and_the_range_holds(link: EdgeLink, ct_edge: Edge) -> None:
    info = await link.create(ContainerSpec(image=BUSYBOX, memory_limit_mb=256, cpu_cores_limit=1.5))
    try:
        await ct_edge.metrics.tick()  # one kept sample, not waiting for the sampler's period
        burn = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
        assert (await link.run_shell(info.id, ShellRequest(command=burn, timeout=300))).exit_code == 0
        got = await link.metrics(info.id)
        # The kept sample and one read now (and any the sampler's own period added meanwhile).
        assert len(got) >= 2 and all(a.ts < b.ts for a, b in itertools.pairwise(got))
        for s in got:
            assert (s.cpu_count, s.mem_total, s.disk_total) == (2, 256 << 20, 0)
        assert max(s.cpu_used_pct for s in got[1:]) > 0, "the shell's loop ran after the kept sample"
        assert await link.metrics(info.id, start=time.time() + 3600) == []
        assert await link.metrics(info.id, end=got[0].ts) == got[:1]
        with pytest.raises(SandboxNotFound):
            await link.metrics(f"sb-{CT_NODE}-{ct_edge.epoch}-{'a' * 20}")
    finally:
        await link.stop(info.id)
    await ct_edge.metrics.tick()
    assert info.id not in ct_edge.metrics._series, "a stopped sandbox's ring is dropped"


async def test_a_bad_time_is_a_400_on_the_wire(server: EdgeServer, ct_edge: Edge) -> None:
    url = f"{server.url}/edge/v1/sandboxes/sb-{CT_NODE}-{ct_edge.epoch}-{'a' * 20}/ops/metrics"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {SECRET}"}) as http:
        for bad in ("-1", "1e9", "99999999999", "now"):
            async with http.post(url, json={"start": bad}) as r:
                assert r.status == 400, bad
