"""A cluster in one process: edges behind their HTTP servers that register through the
apiservers, and two stateless apiservers that learn them from the shared registry."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InfraFailure, QuotaExceeded, SandboxNotFound
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.backends.fake import FakeBackend
from dsec.iam import open_iam_store
from dsec.images.store import LayerStore
from dsec.node.cluster import ApiServerConfig, ClusterApiServer, EdgeNode
from dsec.node.embedded import NodeConfig
from tests.support import eventually

from .conftest import TINY, build_tiny_layer

SECRET = "s3cret-for-this-test-only"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    tmp: Path
    store: LayerStore
    iam_url: str
    key: str
    apis: list[ClusterApiServer] = field(default_factory=list)
    edges: dict[str, EdgeNode] = field(default_factory=dict)
    stopped: dict[str, EdgeNode] = field(default_factory=dict)

    async def api(self, node_lost_after_s: float = 30.0) -> ClusterApiServer:
        cfg = ApiServerConfig(
            SECRET,
            self.store,
            self.iam_url,
            port=0,
            watch_interval_s=0.2,
            node_lost_after_s=node_lost_after_s,
        )
        api = ClusterApiServer(cfg)
        await api.start()
        self.apis.append(api)
        return api

    async def edge(self, name: str, port: int = 0, *, data: str | None = None) -> EdgeNode:
        data_dir = self.tmp / (data or name)
        cfg = NodeConfig(
            data_dir=data_dir, layer_dir=self.tmp / "layers", port=port or free_port(), node=name
        )
        node = EdgeNode(
            cfg, SECRET, [a.url for a in self.apis], backend=FakeBackend(data_dir / "fake"), heartbeat_s=0.2
        )
        await node.start()
        self.edges[name] = node
        self.stopped.pop(name, None)
        return node

    async def down(self, name: str) -> EdgeNode:
        """The edge process goes away; its sandboxes keep running (until teardown restarts it)."""
        node = self.edges[name]
        await node.close()
        self.stopped[name] = node
        return node

    def client(self, i: int) -> DSecClient:
        return DSecClient(self.apis[i].url, self.key)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    store = LayerStore(tmp_path / "layers")  # stands in for the shared store every node mounts
    store.import_path(build_tiny_layer(tmp_path / "tiny"), TINY)
    store.mark_public(TINY)  # the projects' shared base
    iam_url = str(tmp_path / "iam.sqlite")  # PostgreSQL in a real cluster: one IAM for all
    iam = await open_iam_store(iam_url)
    key = await iam.issue_key(admin=True)
    await iam.close()
    c = Cluster(tmp_path, store, iam_url, key)
    try:
        yield c
    finally:
        for name, node in list(c.stopped.items()):  # a failed test may leave one down
            await c.edge(name, node.config.port)
        for api in c.apis:
            await api.close()
        for edge in c.edges.values():
            await edge.close(stop_sandboxes=True)


def knows(api: ClusterApiServer, *nodes: str) -> bool:
    return all(api.watcher.snapshot.get(n, {}).get("healthy") for n in nodes)


async def test_apiservers_route_by_id_and_survive_a_lost_edge(cluster: Cluster) -> None:
    await cluster.api()
    await cluster.api()
    await cluster.edge("e1")
    e2 = await cluster.edge("e2")
    for api in cluster.apis:  # registered through one apiserver, known to both
        await eventually(partial(knows, api, "e1", "e2"), "both apiservers see both edges")
    async with cluster.client(0) as one, cluster.client(1) as two:
        made = [await one.run_container(DSecContainerRunArgs(container_image=TINY)) for _ in range(6)]
        assert {s.id.split("-")[1] for s in made} == {"e1", "e2"}, "placement spreads creates"
        for sb in made:  # the other apiserver serves sandboxes it never saw created
            assert (await (await two.get(sb.id)).run_shell("echo hi")).stdout == "hi\n"
        lost = [s for s in made if s.id.startswith("sb-e2-")]
        await cluster.down("e2")  # the node goes away (its sandboxes keep running there)
        with pytest.raises(InfraFailure) as err:
            await two.get(lost[0].id)
        assert err.value.reason == "edge_unreachable"
        for _ in range(4):  # creates keep succeeding on the node that is left
            sb = await two.run_container(DSecContainerRunArgs(container_image=TINY))
            assert sb.id.startswith("sb-e1-")
        with pytest.raises(SandboxNotFound):
            await one.get("sb-e9-1-" + "a" * 20)
        await cluster.edge("e2", e2.config.port)  # the process starts again, same state
        assert cluster.edges["e2"].edge.epoch == int(lost[0].id.split("-")[2]), "it keeps its epoch"
        assert (await (await one.get(lost[0].id)).run_shell("echo back")).stdout == "back\n"

        async def e2_load() -> object:
            nodes = {n["node"]: n for n in await one.nodes()}
            return set(nodes) == {"e1", "e2"} and nodes["e2"].get("running") == len(lost)

        await eventually(e2_load, "the nodes listing shows the re-adopted sandboxes")


async def _says_lost(client: DSecClient, sandbox_id: str) -> bool:
    try:
        await client.get(sandbox_id)
    except InfraFailure as exc:
        assert exc.reason in ("edge_unreachable", "node_lost"), exc
        return exc.reason == "node_lost"
    raise AssertionError(f"{sandbox_id} answered while its edge was down")


async def test_a_node_not_heard_from_is_lost_until_it_comes_back(cluster: Cluster) -> None:
    api = await cluster.api(node_lost_after_s=1.0)
    edge = await cluster.edge("e1")
    await eventually(partial(knows, api, "e1"), "the apiserver sees e1")
    async with cluster.client(0) as client:
        sb = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await cluster.down("e1")  # its heartbeats stop; its sandboxes keep running
        await eventually(partial(_says_lost, client, sb.id), "e1 to be declared lost")
        link = api.links["e1"]
        assert isinstance(link, RemoteEdgeLink) and link.view.lost
        await cluster.edge("e1", edge.config.port)
        assert (await (await client.get(sb.id)).run_shell("echo back")).stdout == "back\n"
        await eventually(lambda: not link.view.lost, "e1 to be found again")


async def test_a_node_that_lost_its_state_gets_a_new_epoch(cluster: Cluster) -> None:
    api = await cluster.api()
    edge = await cluster.edge("e1")
    async with cluster.client(0) as client:
        old = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await edge.close(stop_sandboxes=True)
        shutil.rmtree(edge.config.data_dir)  # the node was reinstalled
        fresh = await cluster.edge("e1", edge.config.port)
        assert fresh.edge.epoch > edge.edge.epoch
        await eventually(lambda: api.links["e1"].epoch == fresh.edge.epoch, "the apiserver follows")
        with pytest.raises(SandboxNotFound) as err:
            await client.get(old.id)
        assert err.value.reason == "stale_epoch"
        new = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        assert new.id.startswith(f"sb-e1-{fresh.edge.epoch}-")


async def test_an_edge_replaced_under_its_name_stops_creating(cluster: Cluster) -> None:
    await cluster.api()
    first = await cluster.edge("e1", data="first")
    second = await cluster.edge("e1", data="second")  # another machine took the name
    assert second.edge.epoch > first.edge.epoch
    await first.heartbeat.beat()
    assert first.edge.fenced and first.edge.stats()["capacity"] == 0
    assert not second.edge.fenced
    await first.close(stop_sandboxes=True)
    async with cluster.client(0) as client:
        sb = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        assert sb.id.startswith(f"sb-e1-{second.edge.epoch}-")


async def test_a_restarted_apiserver_rebuilds_its_view_from_the_registry(cluster: Cluster) -> None:
    await cluster.api()
    await cluster.edge("e1")
    await cluster.edge("e2")
    await cluster.apis.pop().close()
    api = await cluster.api()  # holds nothing from before; the edges do not re-register now
    assert set(api.links) == {"e1", "e2"}
    assert knows(api, "e1", "e2"), "its first poll ran before it served"
    async with cluster.client(0) as client:
        sb = await client.run_container(DSecContainerRunArgs(container_image=TINY, labels={"job": "j"}))
        assert sb.id.split("-")[1] in {"e1", "e2"}
        await eventually(
            lambda: api.watcher.snapshot[sb.id.split("-")[1]].get("by_label", {}).get("job=j") == 1,
            "the watcher counts per label",
        )


async def test_registration_needs_the_cluster_secret(cluster: Cluster) -> None:
    import aiohttp

    api = await cluster.api()
    async with aiohttp.ClientSession() as http:
        body = {"node": "evil", "url": "http://127.0.0.1:1", "epoch": None}
        async with http.post(api.url + "/cluster/v1/register", json=body) as resp:
            assert resp.status == 401
        headers = {"Authorization": f"Bearer {SECRET}"}
        async with http.post(api.url + "/cluster/v1/register", json={"node": "BAD"}, headers=headers) as resp:
            assert resp.status == 400
    assert "evil" not in api.links


async def test_a_job_is_stopped_across_the_cluster_in_one_call(cluster: Cluster) -> None:
    api = await cluster.api()
    await cluster.edge("e1")
    e2 = await cluster.edge("e2")
    # Placement spreads over the edges its watcher has seen healthy: wait for both (a batch
    # placed before the first heartbeat of e2 all went to e1 now and then).
    await eventually(partial(knows, api, "e1", "e2"), "the watcher sees both edges")
    job = DSecContainerRunArgs(container_image=TINY, labels={"job": "j"})
    async with cluster.client(0) as admin:
        await admin.create_project("root", "team")
        team_key = await admin.issue_key("root/team")
        async with DSecClient(api.url, team_key) as team:
            theirs = [await team.run_container(job) for _ in range(6)]
            ours = await admin.run_container(job)  # same label, in the parent project
            assert {s.id.split("-")[1] for s in theirs} == {"e1", "e2"}
            stopped = await team.stop_all({"job": "j"})  # only what the key may touch
            assert sorted(i.id for i in stopped) == sorted(s.id for s in theirs)
            assert [s.id for s in await admin.list({"job": "j"})] == [ours.id]
            more = [await team.run_container(job) for _ in range(4)]
            await cluster.down("e2")  # a node is down during the cleanup: the caller must hear of it
            await eventually(lambda: not knows(api, "e2"), "the watcher sees e2 down")
            with pytest.raises(InfraFailure) as err:
                await team.stop_all({"job": "j"})
            assert err.value.reason == "edge_unreachable" and "e2" in str(err.value)
            # what the node that answered held is stopped (e2 cannot be listed while down)
            listed_e1 = [ours.id] if ours.id.startswith("sb-e1-") else []
            assert [s.id for s in await admin.list({"job": "j"})] == listed_e1
            await cluster.edge("e2", e2.config.port)
            on_e2 = {s.id for s in more if s.id.startswith("sb-e2-")}
            await eventually(lambda: knows(api, "e2"), "e2 is back")
            assert {s.id for s in await admin.list({"job": "j"})} == on_e2 | {ours.id}
            await team.stop_all({"job": "j"})  # again, once the node is back: nothing remains
            assert [s.id for s in await admin.list({"job": "j"})] == [ours.id]


async def test_a_batch_is_created_whole_or_not_at_all(cluster: Cluster) -> None:
    api = await cluster.api()
    await cluster.edge("e1")
    await cluster.edge("e2")
    await eventually(partial(knows, api, "e1", "e2"), "the watcher sees both edges")
    args = DSecContainerRunArgs(container_image=TINY, labels={"job": "batch"})
    async with cluster.client(0) as admin:
        made = await admin.run_containers(args, 12)
        assert len({s.id for s in made}) == 12
        assert {s.id.split("-")[1] for s in made} == {"e1", "e2"}, "each one placed on its own"
        await admin.stop_all({"job": "batch"})
        await admin.create_project("root", "small", sandboxes=5)
        key = await admin.issue_key("root/small")
        async with DSecClient(api.url, key) as small:
            with pytest.raises(QuotaExceeded):
                await small.run_containers(args, 6)
            assert await small.list() == [], "what was made before the refusal is stopped"
            assert len(await small.run_containers(args, 5)) == 5, "and its quota given back"


class _GatedBackend(FakeBackend):
    """Its node preparation (where a real backend starts LXCFS and mounts the runtime tmpfs)
    waits for ``gate``; ``steps`` records what was taken and given back, in order."""

    def __init__(self, state_dir: Path, fail: bool = False) -> None:
        super().__init__(state_dir)
        self.preparing = asyncio.Event()
        self.gate = asyncio.Event()
        self.fail = fail
        self.steps: list[str] = []

    async def prepare_node(self) -> None:
        self.preparing.set()
        await self.gate.wait()
        await super().prepare_node()
        self.steps.append("prepared")
        if self.fail:
            raise InfraFailure("the node cannot be prepared")

    async def release_node(self) -> None:
        self.steps.append("released")


def _gated_edge(cluster: Cluster, name: str, backend: _GatedBackend) -> EdgeNode:
    cfg = NodeConfig(
        data_dir=cluster.tmp / name, layer_dir=cluster.tmp / "layers", port=free_port(), node=name
    )
    return EdgeNode(cfg, SECRET, [a.url for a in cluster.apis], backend=backend, heartbeat_s=0.2)


async def test_an_edge_stopped_while_it_takes_the_host_gives_back_what_it_took(cluster: Cluster) -> None:
    # The node is stopped (SIGTERM, a scaler's stop) while it prepares the host: what is under
    # way ends, and only then is it given back (a cancel midway left LXCFS and mounts).
    await cluster.api()
    backend = _GatedBackend(cluster.tmp / "gated" / "fake")
    node = _gated_edge(cluster, "gated", backend)
    starting = asyncio.create_task(node.start())
    await backend.preparing.wait()
    starting.cancel()
    backend.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert backend.steps == ["prepared", "released"]
    with pytest.raises(OSError):  # and it no longer serves
        socket.create_connection(("127.0.0.1", node.config.port), timeout=5).close()


async def test_an_edge_whose_start_fails_gives_back_what_it_took(cluster: Cluster) -> None:
    await cluster.api()
    backend = _GatedBackend(cluster.tmp / "failing" / "fake", fail=True)
    backend.gate.set()
    with pytest.raises(InfraFailure, match="cannot be prepared"):
        await _gated_edge(cluster, "failing", backend).start()
    assert backend.steps == ["prepared", "released"]
