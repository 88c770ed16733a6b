"""Overflow between two real clusters on one machine: a home cluster (one apiserver on the
PostgreSQL IAM, one small edge in its own network namespace) and an overflow cluster (one
apiserver on an SQLite IAM, one edge in another namespace), every part a separate OS process
running real container sandboxes. The home edge admits two sandboxes (its CPU limits are capped
at 2.5 cores); the third create finds no node at home and goes to the other cluster, and every
later request reaches it through the home apiserver by its ID. Then the overflow apiserver is
SIGKILLed: its sandboxes answer a classified error, and local creates go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from pydantic import BaseModel

from dsec import CapacityExhausted, Conflict, DSecClient, DSecContainerRunArgs, DSecError, InfraFailure
from dsec.apiserver.overflow_link import HOME_PROJECT_LABEL
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraReason, error_from_wire
from dsec.protocol.ids import SandboxId
from dsec.protocol.processes import ProcessEvent, WatchEvent
from tests.conftest import DATA_DIR
from tests.support import DSEC, eventually

from .harness import (
    CLIENT_TIMEOUT_S,
    EDGE_PORT,
    HEARTBEAT_S,
    WATCH_INTERVAL_S,
    force_cleanup,
    free_port,
    prepare_overflow_iam,
    seed_shared_store,
)
from .netns import Netns
from .procs import Proc

M = TypeVar("M", bound=BaseModel)
HOME_EDGE, AWAY_EDGE = "edge1", "edge2"  # names tests/cluster's leak checks look for


class TwoClusters:
    """Home: apiserver + ``edge1``; away (the overflow target "west"): apiserver + ``edge2``."""

    def __init__(self, tmp: Path, spaces: list[Netns], pg_dsn: str, home_key: str) -> None:
        self.tmp = tmp
        self.spaces = {HOME_EDGE: spaces[0], AWAY_EDGE: spaces[1]}
        self.pg_dsn = pg_dsn
        self.home_key = home_key
        self.away_key = ""  # an admin key of the away cluster (the teardown's)
        self.secret_file = tmp / "cluster-secret"  # each cluster may have its own; one is enough
        self.secret_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.secret_file.chmod(0o600)
        self.ports = {"home": free_port(), "away": free_port()}
        self.apis: dict[str, Proc] = {}
        self.edges: dict[str, Proc] = {}
        self.started: list[Proc] = []
        (tmp / "logs").mkdir()

    def url(self, side: str) -> str:
        return f"http://127.0.0.1:{self.ports[side]}"

    def client(self, side: str = "home", key: str | None = None) -> DSecClient:
        key = key or (self.home_key if side == "home" else self.away_key)
        return DSecClient(self.url(side), key, timeout=CLIENT_TIMEOUT_S)

    def _start(self, name: str, argv: list[str]) -> Proc:
        n = sum(1 for p in self.started if p.name == name)
        proc = Proc(name, argv, self.tmp / "logs" / f"{name}.{n}.log")
        self.started.append(proc)
        return proc

    def start_api(self, side: str) -> Proc:
        iam = self.pg_dsn if side == "home" else str(self.tmp / "away-iam.sqlite")
        argv = [
            DSEC, "apiserver",
            "--iam", iam,
            "--shared-layers", str(self.tmp / f"{side}-layers"),
            "--host", "0.0.0.0",
            "--port", str(self.ports[side]),
            "--secret-file", str(self.secret_file),
            "--scratch", str(self.tmp / f"{side}-scratch"),
            "--watch-interval", str(WATCH_INTERVAL_S),
        ]  # fmt: skip
        if side == "home":
            argv += ["--overflow", str(self.tmp / "overflow.json")]
        self.apis[side] = proc = self._start(f"api-{side}", argv)
        return proc

    def start_edge(self, node: str) -> Proc:
        side = "home" if node == HOME_EDGE else "away"
        ns = self.spaces[node]
        data = self.tmp / "edges" / node
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            DSEC, "edge",
            "--node", node,
            "--data-dir", str(data),
            "--host", ns.ns_ip,
            "--port", str(EDGE_PORT),
            "--shared-layers", str(self.tmp / f"{side}-layers"),
            "--secret-file", str(self.secret_file),
            "--heartbeat", str(HEARTBEAT_S),
            "--fncall-pool-size", "1" if node == AWAY_EDGE else "0",  # function calls overflow too
            "--swap", "host",
            "--no-microvm",
            "--no-vm",
            "--apiserver", f"http://{ns.host_ip}:{self.ports[side]}",
        ]  # fmt: skip
        if node == HOME_EDGE:  # a small node: the CPU limits of two 1-core sandboxes, not three
            argv += ["--admission", f"cpu={2.5 / (os.cpu_count() or 1):.6f}"]
        self.edges[node] = proc = self._start(node, ns.enter(argv))
        return proc

    async def prepare(self, base_layer: str) -> None:
        """Both clusters' stores hold the base layer; the away cluster gets project root/burst,
        whose key the home apiserver overflows with."""
        for side in ("home", "away"):
            seed_shared_store(self.tmp / f"{side}-layers", base_layer)
        with LayerStore(DATA_DIR / "layers") as store:  # the away edge keeps a FnCall pool
            ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
        seed_shared_store(self.tmp / "away-layers", TOOLCHAIN_REF)
        away_store = LayerStore.over(SharedMountBlobStore(self.tmp / "away-layers"))
        away_store.mark_public(base_layer)  # the burst project's key may use it
        # The home registry forgets earlier tests' nodes: their edge2, at the address the away
        # cluster's edge2 now has, would join the home cluster.
        self.away_key = await prepare_overflow_iam(self.tmp, self.pg_dsn, self.url("away"), "overflow test")

    async def start(self) -> None:
        procs = [self.start_api("home"), self.start_api("away")]
        procs += [self.start_edge(HOME_EDGE), self.start_edge(AWAY_EDGE)]
        for proc in procs:
            await proc.wait_up()
        for side, node in (("home", HOME_EDGE), ("away", AWAY_EDGE)):
            await self.wait_serving(side, node)

    async def wait_serving(self, side: str, node: str) -> None:
        async with self.client(side) as client:

            async def healthy() -> bool:
                return node in {n["node"] for n in await client.nodes() if n.get("healthy")}

            await eventually(healthy, f"the {side} apiserver to see {node} healthy", 30)

    async def close(self) -> list[str]:
        problems: list[str] = []
        if "away" in self.apis and not self.apis["away"].alive():
            await self.start_api("away").wait_up()  # its sandboxes are stopped through it
        for side in ("home", "away"):
            try:
                async with self.client(side) as client:
                    for sb in await client.list():
                        await sb.stop()
            except (DSecError, OSError) as exc:
                problems.append(f"stopping the {side} cluster's sandboxes failed: {exc!r}")
        codes = await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in self.edges.values()))
        problems += [
            f"edge {n} did not exit cleanly: {c}" for n, c in zip(self.edges, codes, strict=True) if c != 0
        ]
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in self.apis.values()))
        for node in self.edges:
            problems += force_cleanup(self.tmp / "edges" / node)
        return problems

    def reports(self) -> str:
        return "\n".join(p.report() for p in self.started)


@pytest.fixture
async def two(
    base_layer: str, cluster_pg: object, namespaces: list[Netns], admin_key: str, tmp_path: Path
) -> AsyncIterator[TwoClusters]:
    c = TwoClusters(tmp_path, namespaces, cluster_pg.dsn, admin_key)  # type: ignore[attr-defined]
    try:
        await c.prepare(base_layer)
        await c.start()
        yield c
    finally:
        problems = await c.close()
        print(c.reports())
        assert problems == [], "\n".join(problems)


@pytest.mark.slow
async def test_creates_overflow_to_another_cluster_and_are_served_through_home(
    two: TwoClusters, base_layer: str
) -> None:
    args = DSecContainerRunArgs(container_image=base_layer, cpu_cores_limit=1, labels={"job": "burst"})
    async with two.client() as home, two.client("away") as away:
        local = [await home.run_container(args) for _ in range(2)]
        assert {SandboxId.parse(s.id).node for s in local} == {HOME_EDGE}
        over = await home.run_container(args)  # no node at home can take a third
        sid = SandboxId.parse(over.id)
        assert (sid.cluster, sid.node) == ("west", f"west--{AWAY_EDGE}"), over.id
        # exec and files through the home apiserver, on the other cluster's node
        result = await over.exec(["sh", "-c", "cat; hostname"], stdin="through home\n")
        assert result.exit_code == 0 and result.stdout.startswith("through home\n"), result
        await over.write_file("/tmp/over.txt", "written from home")
        assert await over.read_file("/tmp/over.txt") == b"written from home"
        there = await away.get(str(sid.within_cluster()))  # the away cluster's own view
        assert there.info.project == "root/burst"
        assert (await there.read_file("/tmp/over.txt")) == b"written from home"
        # list spans both clusters
        assert {s.id for s in await home.list({"job": "burst"})} == {s.id for s in [*local, over]}
        await over.stop()
        assert await away.list() == []

        second = await home.run_container(args)
        assert SandboxId.parse(second.id).cluster == "west"
        two.apis["away"].kill()  # SIGKILL: the overflow cluster's apiserver is gone
        with pytest.raises(InfraFailure) as err:
            await second.run_shell("echo unreachable")
        assert err.value.reason == InfraReason.overflow_unreachable, err.value
        # Home is full and the target is down: the create answers at once, classified.
        with pytest.raises(CapacityExhausted):
            await home.run_container(args)
        # Local creates still work once there is room at home.
        await local[0].stop()
        again = await home.run_container(args)
        assert SandboxId.parse(again.id).node == HOME_EDGE


async def _events(client: DSecClient, model: type[M], method: str, path: str, **kw: Any) -> AsyncIterator[M]:
    """An NDJSON route's events, as a plain client reads them."""
    async for line in client._t.lines(method, path, **kw):
        yield model.model_validate_json(line)


async def _port_get(url: str, key: str, path: str) -> bytes:
    """``GET path`` over HTTP/1.0 through the apiserver's port WebSocket at ``url``: the answer."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as session, session.ws_connect(url) as ws:
        first = await ws.receive()
        if first.type is aiohttp.WSMsgType.TEXT and first.data != "open":
            body = json.loads(first.data)
            raise error_from_wire(int(body.pop("status")), body)
        await ws.send_bytes(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        answer = b""
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                break  # "eof": the server closed its side
            answer += msg.data
        return answer


@pytest.mark.slow
async def test_streams_forks_deadlines_xattrs_ports_and_fncalls_reach_the_other_cluster(
    two: TwoClusters, base_layer: str
) -> None:
    """Every call the home apiserver carries to another cluster, driven through home against a
    sandbox the away cluster runs, and checked there through the away cluster's own API."""
    args = DSecContainerRunArgs(container_image=base_layer, cpu_cores_limit=1, labels={"job": "carried"})
    async with two.client() as home, two.client("away") as away:
        local = [await home.run_container(args) for _ in range(2)]
        over = await home.run_container(args)
        sid = SandboxId.parse(over.id)
        assert sid.cluster == "west", over.id
        there = await away.get(str(sid.within_cluster()))
        base, away_base = f"/v1/sandboxes/{over.id}", f"/v1/sandboxes/{there.id}"

        # A kept process started through home runs on in the other cluster; attach, type, end.
        start = {"argv": ["sh", "-c", "echo started; cat"], "tag": "kept"}
        started = _events(home, ProcessEvent, "POST", f"{base}/processes", json_body=start)
        first = await anext(started)
        assert first.t == "start" and (await anext(started)).data == b"started\n"
        await started.aclose()
        listed = await away._t.request("GET", f"{away_base}/processes")
        assert [(p["pid"], p["tag"], p["running"]) for p in listed] == [(first.pid, "kept", True)]
        attached = _events(home, ProcessEvent, "GET", f"{base}/processes/{first.pid}/events")
        assert (await anext(attached)).t == "start"
        await home._t.request("POST", f"{base}/processes/{first.pid}/input", json_body={"data": "aGkK"})
        assert (await anext(attached)).data == b"hi\n"
        await home._t.request("POST", f"{base}/processes/{first.pid}/close-stdin")
        ended = [e async for e in attached]
        assert ended[-1].t == "end" and ended[-1].exit_code == 0, ended

        # A directory watched through home sees a file the away cluster's own client writes.
        await over.run_shell("mkdir -p /root/watched /root/www")
        watch = _events(home, WatchEvent, "GET", f"{base}/watch", params={"path": "/root/watched"})
        assert (await anext(watch)).t == "start"
        await there.write_file("/root/watched/new.txt", "from away")
        async for seen in watch:  # written atomically: a temporary name, then renamed
            if seen.name == "new.txt":
                break
        await watch.aclose()

        # A deadline and extended attributes set through home are the other cluster's.
        info = await home._t.request("POST", f"{base}/ops/set_deadline", json_body={"timeout_s": 3600})
        assert info["id"] == over.id and info["deadline_at"] is not None
        assert (await away.get(there.id)).info.deadline_at == info["deadline_at"]
        await over.write_file("/root/www/hello.txt", "hello through two clusters\n")
        attrs = {"path": "/root/www/hello.txt", "prefix": "user.meta.", "attrs": {"owner": "home"}}
        await home._t.request("POST", f"{base}/ops/set_xattrs", json_body=attrs)
        query = {"path": "/root/www/hello.txt", "prefix": "user.meta."}
        assert await away._t.request("POST", f"{away_base}/ops/xattrs", json_body=query) == {"owner": "home"}

        # A port: a web server in the sandbox, reached through home's port route, two hops away.
        server = {"argv": ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"], "cwd": "/root/www"}
        serving = _events(home, ProcessEvent, "POST", f"{base}/processes", json_body=server)
        assert (await anext(serving)).t == "start"
        await serving.aclose()  # it runs on
        ws_url = two.url("home").replace("http://", "ws://") + f"{base}/ports/8000"

        async def page() -> bytes | None:
            try:
                return await _port_get(ws_url, two.home_key, "/hello.txt")
            except Conflict:  # not listening yet
                return None

        answer = await eventually(page, "the sandbox's web server to answer through home", 30)
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"hello through two clusters\n")
        with pytest.raises(Conflict):  # nothing listens there: the edge's answer, two hops back
            await _port_get(ws_url.replace("/8000", "/8001"), two.home_key, "/")

        # A fork lands in the other cluster, labelled for home; its copy has the file.
        (copy,) = await over.fork(1, labels={"job": "forked"})
        assert SandboxId.parse(copy.id).cluster == "west" and copy.info.labels == {"job": "forked"}
        assert await copy.read_file("/root/www/hello.txt") == b"hello through two clusters\n"
        copy_there = await away.get(str(SandboxId.parse(copy.id).within_cluster()))
        assert copy_there.info.labels[HOME_PROJECT_LABEL] == "root"
        assert {s.id for s in await home.list({"job": "forked"})} == {copy.id}

        # No node at home has a function-call pool: the call runs in the other cluster's.
        async def away_pool_ready() -> bool:
            return any("fncall" in n.get("backends", ()) for n in await away.nodes() if n.get("healthy"))

        await eventually(away_pool_ready, "the away edge's function-call pool to serve", 60)
        result = await home.fncall({"language": "python", "code": "print(6 * 7)"})
        assert result.stdout == "42\n", result
        for sb in [*local, over, copy]:
            await sb.stop()
        assert await away.list() == []
