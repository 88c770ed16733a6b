"""Overflow to another DSec cluster, in one process: a home cluster (one apiserver, one small
edge) whose apiserver sends creates to an overflow cluster (one apiserver, one edge) past its
threshold, and routes every later request there by the sandbox's ID alone."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from pydantic import BaseModel

from dsec import (
    CapacityExhausted,
    DSecClient,
    DSecContainerRunArgs,
    InfraFailure,
    QuotaExceeded,
    SandboxNotFound,
)
from dsec.apiserver.overflow import OverflowConfig, OverflowTarget, utilisation
from dsec.apiserver.overflow_link import HOME_PROJECT_LABEL
from dsec.apiserver.remote_ports import open_remote_port
from dsec.backends.fake import FakeBackend
from dsec.iam import Quota, open_iam_store
from dsec.images.store import LayerStore
from dsec.node.cluster import ApiServerConfig, ClusterApiServer, EdgeNode
from dsec.node.embedded import NodeConfig
from dsec.protocol.errors import InfraReason, InvalidRequest, ProcessNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.ops import Exec, RunShell, Stat
from dsec.protocol.processes import ProcessEvent, ProcessStart, WatchEvent
from dsec.sdk.client import Sandbox
from tests.support import eventually

from .conftest import TINY, build_tiny_layer

M = TypeVar("M", bound=BaseModel)
SECRET = "s3cret-for-this-test-only"
HOME_SLOTS = 4
THRESHOLD = 0.5  # two of the home edge's four slots


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Side:
    """One cluster: its apiserver, its edge, the IAM URL it shares."""

    name: str
    tmp: Path
    store: LayerStore
    iam_url: str
    api: ClusterApiServer | None = None
    edges: list[EdgeNode] = field(default_factory=list)

    async def start_api(self, overflow: OverflowConfig | None = None, port: int = 0) -> ClusterApiServer:
        cfg = ApiServerConfig(
            SECRET, self.store, self.iam_url, port=port, watch_interval_s=0.1, overflow=overflow
        )
        self.api = ClusterApiServer(cfg)
        await self.api.start()
        return self.api

    async def start_edge(self, node: str, slots: int = 100) -> EdgeNode:
        assert self.api is not None
        data = self.tmp / self.name / node
        cfg = NodeConfig(
            data_dir=data,
            layer_dir=self.tmp / "layers",
            port=free_port(),
            node=node,
            edge={"max_sandboxes": slots},
        )
        edge = EdgeNode(cfg, SECRET, [self.api.url], backend=FakeBackend(data / "fake"), heartbeat_s=0.2)
        await edge.start()
        self.edges.append(edge)
        return edge


@dataclass
class Two:
    home: Side
    away: Side
    home_key: str  # an admin key of the home cluster
    away_key: str  # an admin key of the overflow cluster (the test's view there)

    def client(self, key: str | None = None) -> DSecClient:
        assert self.home.api is not None
        return DSecClient(self.home.api.url, key or self.home_key)

    def away_client(self) -> DSecClient:
        assert self.away.api is not None
        return DSecClient(self.away.api.url, self.away_key)


async def _iam(path: Path) -> tuple[str, str, str]:
    """An IAM store with an admin key and a key of project root/burst."""
    iam = await open_iam_store(str(path))
    try:
        admin = await iam.issue_key(admin=True)
        await iam.create_project("root", "burst")
        burst = await iam.issue_key("root/burst")
    finally:
        await iam.close()
    return str(path), admin, burst


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[Two]:
    store = LayerStore(tmp_path / "layers")  # one store stands in for each cluster's own
    store.import_path(build_tiny_layer(tmp_path / "tiny"), TINY)
    store.mark_public(TINY)
    home_iam, home_key, _ = await _iam(tmp_path / "home.sqlite")
    away_iam, away_key, burst_key = await _iam(tmp_path / "away.sqlite")
    home, away = Side("home", tmp_path, store, home_iam), Side("away", tmp_path, store, away_iam)
    await away.start_api()
    assert away.api is not None
    await away.start_edge("a1")
    bursts = OverflowConfig(
        threshold=THRESHOLD,
        poll_interval_s=0.1,
        targets=[OverflowTarget(name="west", url=away.api.url, api_key=burst_key, max_sandboxes=3)],
    )
    await home.start_api(bursts)
    await home.start_edge("h1", slots=HOME_SLOTS)
    try:
        yield Two(home, away, home_key, away_key)
    finally:
        for side in (home, away):
            if side.api is not None:
                await side.api.close()
        for side in (home, away):
            for edge in side.edges:
                await edge.close(stop_sandboxes=True)


def _home_sees(two: Two, running: int) -> bool:
    assert two.home.api is not None
    s = two.home.api.watcher.snapshot.get("h1", {})
    return bool(s.get("healthy")) and s.get("running") == running


ARGS = DSecContainerRunArgs(container_image=TINY, labels={"job": "j1"})


async def test_creates_overflow_past_the_threshold_and_are_served_through_home(two: Two) -> None:
    async with two.client() as client, two.away_client() as away:
        await eventually(lambda: _home_sees(two, 0), "the home apiserver sees its edge")
        local = [await client.run_container(ARGS) for _ in range(2)]
        assert {SandboxId.parse(s.id).node for s in local} == {"h1"}
        await eventually(lambda: _home_sees(two, 2), "the watcher counts both")
        sb = await client.run_container(ARGS)  # 2 of 4 slots: at the threshold
        sid = SandboxId.parse(sb.id)
        assert sid.cluster == "west" and sid.node == "west--a1", sb.id
        assert sb.info.project == "root" and sb.info.labels == {"job": "j1"}
        # Every request goes through the home apiserver to the other cluster by the ID alone.
        assert (await sb.run_shell("echo over")).stdout == "over\n"
        assert (await sb.exec(["cat"], stdin="piped")).stdout == "piped"
        await sb.write_file("/tmp/f.txt", "remote bytes")
        assert await sb.read_file("/tmp/f.txt") == b"remote bytes"
        assert "f.txt" in {f.name for f in await sb.list_dir("/tmp")}
        assert (await sb.refresh()).id == sb.id
        # The link takes operations as data too (protocol/ops.py), as every EdgeLink does.
        assert two.home.api is not None and two.home.api.overflow is not None
        link = two.home.api.overflow.link("west")
        assert (await link.call(sb.id, RunShell(command="echo op"))).stdout == "op\n"
        events = [e async for e in link.stream(sb.id, Exec(argv=["echo", "streamed"]))]
        assert events[-1].t == "exit" and events[-1].result is not None
        assert (await link.call(sb.id, Stat(path="/tmp/f.txt"))).size == len("remote bytes")
        with pytest.raises(InvalidRequest, match="overflow cluster 'west'"):
            await link.fork_spec(sb.id, "a-layer")  # what the public API does not carry: a 400
        assert (await sb.pause()).state == "paused"
        assert (await sb.resume()).state == "running"
        # Another apiserver of the home cluster, with the same targets, serves it by its ID.
        assert two.home.api is not None
        other = ClusterApiServer(two.home.api.config)
        await other.start()
        try:
            async with DSecClient(other.url, two.home_key) as via_other:
                again = await via_other.get(sb.id)
                assert await again.read_file("/tmp/f.txt") == b"remote bytes"
                assert (await again.run_shell("echo other")).stdout == "other\n"
        finally:
            await other.close()
        # The other cluster knows it under its own ID, in the key's project, labelled home's.
        there = await away.get(str(sid.within_cluster()))
        assert there.info.project == "root/burst"
        assert there.info.labels[HOME_PROJECT_LABEL] == "root"
        # list spans both clusters; quota counts the overflow sandbox at home.
        listed = {s.id for s in await client.list()}
        assert listed == {s.id for s in [*local, sb]}
        assert {s.id for s in await client.list({"job": "j1"})} == listed
        assert two.home.api is not None
        usage = await two.home.api.iam.usage("root")
        assert usage.sandboxes == 3
        # A bulk stop by label spans both, and releases the overflow sandbox's quota too.
        stopped = await client.stop_all({"job": "j1"})
        assert {s.id for s in stopped} == listed
        assert await client.list() == []
        assert (await two.home.api.iam.usage("root")).sandboxes == 0
        assert await away.list() == []
        assert (await client.get(sb.id)).info.state == "stopped"  # kept a while, as at home
        with pytest.raises(SandboxNotFound):  # a cluster that is not a target
            await client.get(str(SandboxId.parse(sb.id).within_cluster().in_cluster("east")))


async def _overflowed(two: Two, client: DSecClient) -> tuple[list[Sandbox], Sandbox]:
    """Two sandboxes at home (the threshold), then one in the overflow cluster."""
    await eventually(lambda: _home_sees(two, 0), "the home apiserver sees its edge")
    local = [await client.run_container(ARGS) for _ in range(2)]
    await eventually(lambda: _home_sees(two, 2), "the watcher counts both")
    over = await client.run_container(ARGS)
    assert SandboxId.parse(over.id).cluster == "west", over.id
    return local, over


async def _events(client: DSecClient, model: type[M], method: str, path: str, **kw: Any) -> AsyncIterator[M]:
    """An NDJSON route's events, as a plain client reads them."""
    async for line in client._t.lines(method, path, **kw):
        yield model.model_validate_json(line)


async def test_streams_reach_a_sandbox_in_the_other_cluster(two: Two) -> None:
    """Starting a kept process, attaching to it and watching a directory, through the home
    apiserver's public routes, on a sandbox the other cluster runs (and sees there)."""
    async with two.client() as client, two.away_client() as away:
        local, sb = await _overflowed(two, client)
        there = await away.get(str(SandboxId.parse(sb.id).within_cluster()))
        base = f"/v1/sandboxes/{sb.id}"
        start = {"argv": ["sh", "-c", "echo started; cat"], "tag": "kept"}
        started = _events(client, ProcessEvent, "POST", f"{base}/processes", json_body=start)
        first = await anext(started)
        assert first.t == "start" and first.pid > 0
        assert (await anext(started)).data == b"started\n"
        await started.aclose()  # detaches: the process runs on, in the other cluster
        listed = await away._t.request("GET", f"/v1/sandboxes/{there.id}/processes")
        assert [(p["pid"], p["tag"], p["running"]) for p in listed] == [(first.pid, "kept", True)]
        attached = _events(client, ProcessEvent, "GET", f"{base}/processes/{first.pid}/events")
        assert (await anext(attached)).t == "start"
        await client._t.request("POST", f"{base}/processes/{first.pid}/input", json_body={"data": "aGkK"})
        assert (await anext(attached)).data == b"hi\n"
        await client._t.request("POST", f"{base}/processes/{first.pid}/close-stdin")
        ended = [e async for e in attached]
        assert ended[-1].t == "end" and ended[-1].exit_code == 0
        with pytest.raises(ProcessNotFound):  # an unknown process: the other cluster's answer
            await anext(_events(client, ProcessEvent, "GET", f"{base}/processes/999999/events"))
        # A watch from home sees a file the other cluster's own client writes.
        await client._t.request("POST", f"{base}/ops/mkdir", json_body={"path": "/tmp/watched"})
        watch = _events(client, WatchEvent, "GET", f"{base}/watch", params={"path": "/tmp/watched"})
        assert (await anext(watch)).t == "start"
        await there.write_file("/tmp/watched/new.txt", "from away")
        async for seen in watch:  # written atomically: a temporary name, then renamed
            if seen.name == "new.txt":
                assert seen.t in ("create", "rename", "write"), seen
                break
        await watch.aclose()
        for s in [*local, sb]:
            await s.stop()


async def test_forks_deadlines_xattrs_and_ports_reach_the_other_cluster(two: Two) -> None:
    async with two.client() as client, two.away_client() as away:
        local, sb = await _overflowed(two, client)
        remote = str(SandboxId.parse(sb.id).within_cluster())
        await sb.write_file("/tmp/state.txt", "before the fork")
        ops, away_ops = f"/v1/sandboxes/{sb.id}/ops", f"/v1/sandboxes/{remote}/ops"
        # A deadline set at home is the other cluster's (its reaper keeps it).
        info = await client._t.request("POST", f"{ops}/set_deadline", json_body={"timeout_s": 3600})
        assert info["id"] == sb.id and info["deadline_at"] is not None
        assert (await away.get(remote)).info.deadline_at == info["deadline_at"]
        assert two.home.api is not None and two.home.api.overflow is not None
        link = two.home.api.overflow.link("west")
        assert (await link.set_deadline(sb.id, None)).deadline_at is None
        # Extended attributes (E2B's file metadata) both ways.
        attrs = {"path": "/tmp/state.txt", "prefix": "user.meta.", "attrs": {"owner": "home"}}
        assert await client._t.request("POST", f"{ops}/set_xattrs", json_body=attrs) is None
        query = {"path": "/tmp/state.txt", "prefix": "user.meta."}
        assert await away._t.request("POST", f"{away_ops}/xattrs", json_body=query) == {"owner": "home"}
        assert await link.xattrs(sb.id, "/tmp/state.txt", "user.meta.") == {"owner": "home"}
        # A fork lands where its source runs: IDs of that cluster, the home project, home quota.
        # (what it holds there is an upper bound until a poll settles it: room for two copies)
        await eventually(lambda: two.home.api.overflow.held("west") == 1, "a poll to count it")
        copies = await sb.fork(2, labels={"job": "forked"})
        assert {SandboxId.parse(c.id).cluster for c in copies} == {"west"}
        assert all(c.info.project == "root" and c.info.labels == {"job": "forked"} for c in copies)
        for copy in copies:
            assert await copy.read_file("/tmp/state.txt") == b"before the fork"
            there = await away.get(str(SandboxId.parse(copy.id).within_cluster()))
            assert there.info.labels == {"job": "forked", HOME_PROJECT_LABEL: "root"}
        assert {c.id for c in copies} <= {s.id for s in await client.list({"job": "forked"})}
        assert (await two.home.api.iam.usage("root")).sandboxes == 5
        with pytest.raises(CapacityExhausted, match="limit"):  # the target's max_sandboxes (3)
            await sb.fork(1)
        # A port: the other cluster's port route answers through home (here the fake backend's
        # refusal, carried inside the socket as on a local node).
        with pytest.raises(InvalidRequest, match="network stack"):
            await link.open_port(sb.id, 8000)
        # The home apiserver's public port route: the owner's key gets that far, another
        # project's key is told the sandbox does not exist (inside the socket).
        await two.home.api.iam.create_project("root", "other")
        keys = {"owner": two.home_key, "other": await two.home.api.iam.issue_key("root/other")}
        url = f"{two.home.api.url}/v1/sandboxes/{sb.id}/ports/8000"
        for who, error, match in (
            ("owner", InvalidRequest, "network stack"),
            ("other", SandboxNotFound, "does not"),
        ):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {keys[who]}"}) as session:
                with pytest.raises(error, match=match):
                    await open_remote_port(session, url, "home", 5)
        for s in [*local, sb, *copies]:
            await s.stop()
        assert (await two.home.api.iam.usage("root")).sandboxes == 0


async def test_home_again_when_local_capacity_frees(two: Two) -> None:
    async with two.client() as client:
        await eventually(lambda: _home_sees(two, 0), "the home apiserver sees its edge")
        local = [await client.run_container(ARGS) for _ in range(2)]
        await eventually(lambda: _home_sees(two, 2), "the watcher counts both")
        over = await client.run_container(ARGS)
        assert SandboxId.parse(over.id).cluster == "west"
        await local[0].stop()
        await eventually(lambda: _home_sees(two, 1), "the watcher sees the freed slot")
        back = await client.run_container(ARGS)
        assert SandboxId.parse(back.id).node == "h1", "below the threshold: created at home"
        # A batch past the threshold: all or none, some at home (placement) or away.
        await eventually(lambda: _home_sees(two, 2), "the watcher counts it")
        batch = await client.run_containers(ARGS, 2)
        assert {SandboxId.parse(s.id).cluster for s in batch} == {"west"}
        # The target's limit (3) is reached: the next create stays home while there is room.
        extra = await client.run_container(ARGS)
        assert SandboxId.parse(extra.id).node == "h1"
        for s in [local[1], over, back, *batch, extra]:
            await s.stop()


async def test_the_home_quota_counts_overflow_sandboxes(two: Two) -> None:
    assert two.home.api is not None
    iam = two.home.api.iam
    await iam.create_project("root", "team")
    await iam.set_quota("root/team", Quota(sandboxes=3))
    key = await iam.issue_key("root/team")
    async with two.client(key) as client:
        await eventually(lambda: _home_sees(two, 0), "the home apiserver sees its edge")
        made = [await client.run_container(ARGS) for _ in range(2)]
        await eventually(lambda: _home_sees(two, 2), "the watcher counts both")
        made.append(await client.run_container(ARGS))
        assert SandboxId.parse(made[-1].id).cluster == "west"
        with pytest.raises(QuotaExceeded):
            await client.run_container(ARGS)
        async with two.client() as admin:  # another project's key does not see them
            assert {s.id for s in await admin.list()} >= {s.id for s in made}
        for s in made:
            await s.stop()


async def test_a_lost_target_is_classified_and_local_creates_go_on(two: Two) -> None:
    async with two.client() as client:
        await eventually(lambda: _home_sees(two, 0), "the home apiserver sees its edge")
        local = [await client.run_container(ARGS) for _ in range(2)]
        await eventually(lambda: _home_sees(two, 2), "the watcher counts both")
        over = await client.run_container(ARGS)
        assert SandboxId.parse(over.id).cluster == "west"
        assert two.away.api is not None
        away_port = int(two.away.api.url.rsplit(":", 1)[1])
        await two.away.api.close()
        with pytest.raises(InfraFailure) as err:
            await over.run_shell("echo gone")
        assert err.value.reason == InfraReason.overflow_unreachable
        assert two.home.api is not None and two.home.api.overflow is not None
        link = two.home.api.overflow.link("west")
        usage = (await two.home.api.iam.usage("root")).sandboxes
        lost = [
            anext(link.watch_dir(over.id, "/tmp", False)),
            anext(link.start_process(over.id, ProcessStart(argv=["true"]))),
            link.open_port(over.id, 8000),
            over.fork(1),  # its quota, reserved at home first, is released again
        ]
        for attempt in lost:
            with pytest.raises(InfraFailure) as err:
                await attempt
            assert err.value.reason == InfraReason.overflow_unreachable, attempt
        assert (await two.home.api.iam.usage("root")).sandboxes == usage
        # No pool at home, the target lost: a function call is refused as without overflow.
        with pytest.raises(CapacityExhausted):
            await client.fncall({"language": "python", "code": "print(1)"})
        more = await client.run_container(ARGS)  # past the threshold, the target unreachable
        assert SandboxId.parse(more.id).node == "h1"
        assert two.home.api is not None and two.home.api.overflow is not None
        assert "west" in two.home.api.overflow.down
        # The list names the unreachable target and still lists the local sandboxes.
        assert {s.id for s in await client.list()} == {s.id for s in [*local, more]}
        await two.away.start_api(port=away_port)  # it comes back: its sandbox is served again
        await eventually(lambda: "west" not in two.home.api.overflow.down, "the target is counted again")
        assert (await over.run_shell("echo back")).stdout == "back\n"
        for s in [*local, more, over]:
            await s.stop()


def test_ids_name_their_cluster_and_old_ids_still_parse() -> None:
    old = SandboxId.parse("sb-edge-7-1-" + "a" * 20)
    assert (old.node, old.epoch, old.cluster) == ("edge-7", 1, None)
    remote = SandboxId.parse("sb-a1-3-" + "b" * 20)
    home = remote.in_cluster("west")
    assert str(home) == "sb-west--a1-3-" + "b" * 20
    assert SandboxId.parse(str(home)) == home and home.cluster == "west"
    assert home.within_cluster() == remote
    nested = SandboxId.parse(str(home)).in_cluster("east")  # a target that overflowed further
    assert nested.cluster == "east" and nested.within_cluster() == home
    long = SandboxId.parse("sb-a1-3-" + "b" * 20).in_cluster("w" * 20)
    assert SandboxId.parse(str(SandboxId("x" * 40, 1, "b" * 20).in_cluster("west"))).cluster == "west"
    assert SandboxId.parse(str(long)) == long
    with pytest.raises(InvalidRequest, match="malformed"):  # longer than a node name: not a cluster's
        SandboxId.parse("sb-" + "n" * 41 + "-12-" + "a" * 20)
    with pytest.raises(InvalidRequest):
        SandboxId.new("two--parts", 1)  # "--" ends a cluster's name: no node may contain it
    with pytest.raises(InvalidRequest):
        remote.in_cluster("bad--name")


def test_utilisation_takes_the_busiest_dimension() -> None:
    snap = {
        "n1": {"healthy": True, "capacity": 10, "running": 2, "creating": 0},
        "n2": {"healthy": True, "capacity": 10, "running": 4, "creating": 0,
               "admitted": {"memory_in_use": 0.5, "memory_limits": 0.9}},
        "down": {"healthy": False, "capacity": 10, "running": 10},
    }  # fmt: skip
    assert utilisation(snap) == pytest.approx(0.9)  # memory where it is reported
    snap["n1"]["admitted"] = {"memory_limits": 0.1}
    assert utilisation(snap) == pytest.approx(0.5)  # the nodes' mean share
    del snap["n1"]["admitted"], snap["n2"]["admitted"]
    assert utilisation(snap) == pytest.approx(0.3)  # 6 of 20 slots
    assert utilisation({}) == 1.0


def test_overflow_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of api_key"):
        OverflowTarget(name="west", url="http://x")
    with pytest.raises(ValueError, match="invalid cluster name"):
        OverflowTarget(name="We st", url="http://x", api_key="k")
    with pytest.raises(ValueError, match="http"):
        OverflowTarget(name="west", url="ftp://x", api_key="k")
    path = tmp_path / "o.toml"
    path.write_text('threshold = 2\n[[targets]]\nname = "west"\nurl = "http://x"\napi_key = "k"\n')
    with pytest.raises(ValueError, match="threshold"):
        OverflowConfig.load(path)
    path.write_text('threshold = 0.7\n[[targets]]\nname = "west"\nurl = "http://x"\napi_key = "k"\n')
    assert OverflowConfig.load(path).threshold == 0.7
