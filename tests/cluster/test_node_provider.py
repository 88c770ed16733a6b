"""The local node provider: an edge started on demand in a network namespace of its own, with
labels and a size, registers with a real apiserver process, runs a sandbox that asked for its
label, and is stopped again with its namespace and veth gone. A node fenced for a drain and
restarted on its data directory still refuses creates until it is unfenced."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import CapacityExhausted, DSecClient, DSecContainerRunArgs
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.node.provider import LocalNetnsProvider, NodeRequest
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec, Hardware
from tests.iam.pgserver import PgServer
from tests.support import DSEC, eventually

from .harness import (
    CLIENT_TIMEOUT_S,
    HEARTBEAT_S,
    WATCH_INTERVAL_S,
    force_cleanup,
    free_port,
    seed_shared_store,
)
from .procs import Proc

NODE = "edge3"  # a name tests/cluster's leak checks look for


@pytest.fixture
async def api(
    base_layer: str, cluster_pg: PgServer, no_host_leaks: None, tmp_path: Path
) -> AsyncIterator[tuple[str, LocalNetnsProvider]]:
    seed_shared_store(tmp_path / "layers", base_layer)
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_urlsafe(24) + "\n")
    secret.chmod(0o600)
    port = free_port()
    argv = [
        DSEC, "apiserver",
        "--iam", cluster_pg.dsn,
        "--shared-layers", str(tmp_path / "layers"),
        "--host", "0.0.0.0",
        "--port", str(port),
        "--secret-file", str(secret),
        "--scratch", str(tmp_path / "scratch"),
        "--watch-interval", str(WATCH_INTERVAL_S),
    ]  # fmt: skip
    proc = Proc("api", argv, tmp_path / "api.log")
    edge_args = ["--heartbeat", str(HEARTBEAT_S), "--fncall-pool-size", "0", "--swap", "host"]
    provider = LocalNetnsProvider(
        [port],
        tmp_path / "layers",
        secret,
        tmp_path / "nodes",
        edge_args=[*edge_args, "--no-microvm", "--no-vm"],
    )
    try:
        yield await proc.wait_up(), provider
    finally:
        await provider.close()
        proc.terminate()
        print(proc.report())
        assert force_cleanup(tmp_path / "nodes" / NODE) == []


@pytest.mark.slow
async def test_a_provider_node_joins_runs_a_sandbox_and_goes(
    api: tuple[str, LocalNetnsProvider], admin_key: str, base_layer: str
) -> None:
    url, provider = api
    node = await provider.start(NodeRequest(name=NODE, labels={"pool": "burst"}, cpus=2))
    assert node.state == "running" and node.url
    async with DSecClient(url, admin_key, timeout=CLIENT_TIMEOUT_S) as client:

        async def joined() -> bool:
            seen = {n["node"]: n for n in await client.nodes()}
            return bool(seen.get(NODE, {}).get("healthy"))

        await eventually(joined, f"the apiserver to see {NODE} healthy", 30)
        wants = Hardware(node_labels={"pool": "burst"})
        sb = await client.run_container(DSecContainerRunArgs(container_image=base_layer, hardware=wants))
        assert SandboxId.parse(sb.id).node == NODE
        assert (await sb.run_shell("echo on demand")).stdout == "on demand\n"
        await sb.stop()
    stopped = await provider.stop(NODE)
    assert stopped.state == "stopped"
    assert [(n.name, n.state) for n in await provider.list()] == [(NODE, "stopped")]
    assert not list(Path("/run/netns").glob(f"dsecp-{os.getpid()}-*")), "its namespace is gone"


@pytest.mark.slow
async def test_a_drained_node_restarted_on_its_data_dir_still_refuses_creates(
    api: tuple[str, LocalNetnsProvider], admin_key: str, base_layer: str, tmp_path: Path
) -> None:
    # Scale-in fences a node it drains; an edge restarted before the stop must not take creates.
    url, provider = api
    secret = (tmp_path / "secret").read_text().strip()
    why = "scale-in drains this idle provider node"
    request = NodeRequest(name=NODE, labels={"pool": "burst"}, cpus=2)
    wants = Hardware(node_labels={"pool": "burst"})
    node = await provider.start(request)
    async with DSecClient(url, admin_key, timeout=CLIENT_TIMEOUT_S) as client:

        async def seen(fenced: bool) -> bool:
            entry = {n["node"]: n for n in await client.nodes()}.get(NODE, {})
            return bool(entry.get("healthy")) and entry.get("fenced") is fenced

        await eventually(lambda: seen(False), f"the apiserver to see {NODE} healthy", 30)
        link = RemoteEdgeLink(node.url, secret, NODE)
        try:
            assert await link.fence(True, why) is True  # what the scaler sends (POST /edge/v1/fence)
        finally:
            await link.close()
        await provider.stop(NODE)
        node = await provider.start(request)  # the same name: the same data directory
        link = RemoteEdgeLink(node.url, secret, NODE)
        try:
            stats = await link.stats()  # the restarted edge's own word, not a stale poll
            assert (stats["fenced"], stats["capacity"]) == (True, 0)
            with pytest.raises(CapacityExhausted, match=why):
                await link.create(ContainerSpec(image=base_layer, hardware=wants))
            await eventually(lambda: seen(True), f"the apiserver to see {NODE} fenced", 30)
            with pytest.raises(CapacityExhausted):
                await client.run_container(DSecContainerRunArgs(container_image=base_layer, hardware=wants))
            assert await link.fence(False, "scale-in keeps this node") is False
        finally:
            await link.close()
        await eventually(lambda: seen(False), f"the apiserver to see {NODE} unfenced", 30)
        sb = await client.run_container(DSecContainerRunArgs(container_image=base_layer, hardware=wants))
        assert SandboxId.parse(sb.id).node == NODE
        await sb.stop()
    assert (await provider.stop(NODE)).state == "stopped"


def test_node_requests_are_validated() -> None:
    with pytest.raises(InvalidRequest):
        NodeRequest(name="Bad Name")
    with pytest.raises(InvalidRequest):
        NodeRequest(labels={"a=b": "c"})
    with pytest.raises(InvalidRequest):
        NodeRequest(cpus=0)
