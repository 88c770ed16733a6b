"""A cluster in one process: two edges behind their HTTP servers, two apiservers over them."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InfraFailure, SandboxNotFound
from dsec.apiserver.cluster import ApiServerConfig, ClusterApiServer, EdgeNode
from dsec.apiserver.embedded import NodeConfig
from dsec.backends.fake import FakeBackend
from dsec.iam import open_iam_store
from dsec.images.store import LayerStore

from .conftest import TINY, build_tiny_layer

SECRET = "s3cret-for-this-test-only"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_apiservers_route_by_id_and_survive_a_lost_edge(tmp_path: Path) -> None:
    store_dir = tmp_path / "layers"
    store = LayerStore(store_dir)  # stands in for the shared store every node mounts
    store.import_path(build_tiny_layer(tmp_path / "tiny"), TINY)

    def edge_node(name: str, port: int) -> EdgeNode:
        cfg = NodeConfig(data_dir=tmp_path / name, layer_dir=store_dir, port=port, node=name)
        return EdgeNode(cfg, SECRET, backend=FakeBackend(tmp_path / f"{name}-fake"))

    edges = [edge_node("e1", free_port()), edge_node("e2", free_port())]
    for edge in edges:
        await edge.start()
    iam_url = str(tmp_path / "iam.sqlite")  # PostgreSQL in a real cluster: one IAM for all
    iam = await open_iam_store(iam_url)
    key = await iam.issue_key(admin=True)
    await iam.close()
    apis = []
    for _ in range(2):
        api = ClusterApiServer(
            ApiServerConfig({e.config.node: e.url for e in edges}, SECRET, store, iam_url, port=0)
        )
        await api.start()
        apis.append(api)
    try:
        async with DSecClient(apis[0].url, key) as one, DSecClient(apis[1].url, key) as two:
            made = [await one.run_container(DSecContainerRunArgs(container_image=TINY)) for _ in range(6)]
            assert {s.id.split("-")[1] for s in made} == {"e1", "e2"}, "placement spreads creates"
            for sb in made:  # the other apiserver serves sandboxes it never saw created
                assert (await (await two.get(sb.id)).run_shell("echo hi")).stdout == "hi\n"
            lost = [s for s in made if s.id.startswith("sb-e2-")]
            await edges[1].close()  # the node goes away (its sandboxes keep running there)
            with pytest.raises(InfraFailure) as err:
                await two.get(lost[0].id)
            assert err.value.reason == "edge_unreachable"
            for _ in range(4):  # creates keep succeeding on the node that is left
                sb = await two.run_container(DSecContainerRunArgs(container_image=TINY))
                assert sb.id.startswith("sb-e1-")
            with pytest.raises(SandboxNotFound):
                await one.get("sb-e9-1-" + "a" * 20)
            edges[1] = edge_node("e2", edges[1].config.port)  # the process starts again
            await edges[1].start()  # and re-adopts what still runs
            assert (await (await one.get(lost[0].id)).run_shell("echo back")).stdout == "back\n"
            for sb in await one.list():
                await sb.stop()
    finally:
        for api in apis:
            await api.close()
        for edge in edges:
            with contextlib.suppress(Exception):
                await edge.close(stop_sandboxes=True)
