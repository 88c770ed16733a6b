"""What ``dsec_egress_name_checks_total`` reads: HAProxy's ``show stat`` on the name check's admin
socket (a socket of the test's here; tests/e2e/test_egress_domains.py drives the real HAProxy),
and that a proxy which is gone or does not answer leaves the figure out instead of failing a
scrape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from dsec.netpolicy.sniproxy import MAX_SOCKET_PATH, SniProxy, admin_socket_path, parse_stats
from dsec.observe.egress_metrics import name_checks

# HAProxy 2.6's answer to `show stat -1 3 -1` (the name check's config on loopback) after 3
# refused TLS connects (another name, none, not TLS) and 1 granted, then 2 granted and 1
# refused HTTP requests on one connection; cut after its 11th column (dreq).
SHOW_STAT = """\
# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq
tls,FRONTEND,,,0,1,9985,4,1569,360,3
web,FRONTEND,,,0,1,9985,1,133,1566,1
to_original_tcp,BACKEND,0,0,0,1,999,1,517,360,0
to_original_http,BACKEND,0,0,0,1,999,2,88,1374,0

"""


def test_each_kind_s_verdicts_come_from_its_frontend_and_backend() -> None:
    assert parse_stats(SHOW_STAT) == {
        ("tls", "refused"): 3,
        ("tls", "granted"): 1,
        ("http", "refused"): 1,
        ("http", "granted"): 2,
    }


def test_an_answer_that_is_not_the_stats_table_gives_nothing() -> None:
    assert parse_stats("") == {}
    assert parse_stats("Unknown command: 'show stat -1 3 -1'\n") == {}
    assert parse_stats("# pxname,svname\ntls,FRONTEND\n") == {}  # no such columns
    assert parse_stats("# pxname,svname,dreq\ntls,FRONTEND,many\n") == {}


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving_admin_socket(proxy: SniProxy, handler: Handler) -> AsyncIterator[None]:
    proxy.dir.mkdir(parents=True)
    server = await asyncio.start_unix_server(handler, str(proxy.sock))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


async def test_the_proxy_s_counts_are_read_from_its_admin_socket(tmp_path: Path) -> None:
    asked: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.readline())
        writer.write(SHOW_STAT.encode())
        await writer.drain()
        writer.close()  # as HAProxy does after one command

    proxy = SniProxy(tmp_path, "127.0.0.1")
    async with serving_admin_socket(proxy, answer):
        counts = await proxy.counts()
    assert asked == [b"show stat -1 3 -1\n"]
    assert counts[("tls", "refused")] == 3 and counts[("http", "refused")] == 1


async def test_a_proxy_gone_or_silent_is_no_figure(tmp_path: Path) -> None:
    proxy = SniProxy(tmp_path, "127.0.0.1")
    assert await proxy.counts() == {}  # no socket at all
    release = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # an HAProxy that accepts and never answers
        writer.close()

    async with serving_admin_socket(proxy, hang):
        assert await proxy.counts(timeout=0.05) == {}
        release.set()


class _Egress:
    def __init__(self, counts: dict[tuple[str, str], int]) -> None:
        self.counts = counts

    def name_checks(self) -> dict[tuple[str, str], int]:
        return self.counts


class _Family(Collector):
    def __init__(self, egress: _Egress) -> None:
        self.egress = egress

    def collect(self):  # type: ignore[no-untyped-def]
        return name_checks(self.egress)  # type: ignore[arg-type]


def test_the_family_has_every_kind_and_verdict_or_is_absent() -> None:
    registry = CollectorRegistry()
    egress = _Egress({("tls", "refused"): 3, ("http", "granted"): 2})
    registry.register(_Family(egress))

    def sample(kind: str, verdict: str) -> float | None:
        labels = {"kind": kind, "verdict": verdict}
        return registry.get_sample_value("dsec_egress_name_checks_total", labels)

    assert [sample(k, v) for k in ("tls", "http") for v in ("granted", "refused")] == [0, 3, 2, 0]
    egress.counts = {}  # no proxy, or it did not answer
    assert sample("tls", "refused") is None


def test_the_admin_socket_stays_short_enough_for_haproxy_to_bind(tmp_path: Path) -> None:
    near = tmp_path / "n"
    assert admin_socket_path(near) == near / "admin.sock"  # a short data directory keeps it inside
    deep = [tmp_path / ("x" * 60) / node / "edge" for node in ("edge1", "edge2")]
    far = [admin_socket_path(d) for d in deep]
    # A data directory deep under a test's temporary directory: haproxy refused to start there.
    assert all(len(str(p)) <= MAX_SOCKET_PATH for p in far)
    assert far[0] != far[1] and far[0] == admin_socket_path(deep[0])  # one per node, stable across restarts
