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

import pytest

from dsec import CapacityExhausted, DSecClient, DSecContainerRunArgs, DSecError, InfraFailure
from dsec.iam import open_iam_store
from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraReason
from dsec.protocol.ids import SandboxId
from tests.support import DSEC, eventually

from .harness import (
    CLIENT_TIMEOUT_S,
    EDGE_PORT,
    HEARTBEAT_S,
    WATCH_INTERVAL_S,
    force_cleanup,
    free_port,
    seed_shared_store,
)
from .netns import Netns
from .procs import Proc

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
            "--fncall-pool-size", "0",
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
        away_store = LayerStore.over(SharedMountBlobStore(self.tmp / "away-layers"))
        away_store.mark_public(base_layer)  # the burst project's key may use it
        # The home registry is the session's shared Postgres: nodes earlier cluster tests
        # registered there (edge2 at the address the away cluster's edge2 now has) would join.
        home = await open_iam_store(self.pg_dsn)
        try:
            for record in await home.list_nodes():
                await home.forget_node(record.node)
        finally:
            await home.close()
        iam = await open_iam_store(str(self.tmp / "away-iam.sqlite"))
        try:
            self.away_key = await iam.issue_key(admin=True, name="overflow test")
            await iam.create_project("root", "burst")
            burst_key = await iam.issue_key("root/burst", name="the home cluster")
        finally:
            await iam.close()
        key_file = self.tmp / "west.key"
        key_file.write_text(burst_key + "\n")
        key_file.chmod(0o600)
        target = {"name": "west", "url": self.url("away"), "api_key_file": str(key_file)}
        config = {"threshold": 1.0, "poll_interval_s": 0.2, "targets": [target]}
        (self.tmp / "overflow.json").write_text(json.dumps(config))

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
