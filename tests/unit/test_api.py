"""The HTTP API over a fake backend: auth, typed errors across the wire, listing, stopping,
admission. What a trainer relies on when it drives thousands of sandboxes through the SDK."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from dsec import (
    CapacityExhausted,
    DSecClient,
    DSecContainerRunArgs,
    InfraFailure,
    InvalidRequest,
    LayerNotFound,
    SandboxNotFound,
    SandboxState,
    Unauthorized,
)
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import error_from_wire
from dsec.protocol.ids import SandboxId
from dsec.sdk._transport import Transport

from .conftest import TINY, Nodes, fake


async def raw(node: EmbeddedNode, method: str, path: str, *, key: str | None, **kw: Any) -> tuple[int, Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, node.url + path, headers=headers, **kw) as resp,
    ):
        return resp.status, await resp.json()


# -- auth -------------------------------------------------------------------------------------


async def test_requests_without_a_key_are_unauthorized(node: EmbeddedNode) -> None:
    for method, path in [("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"), ("GET", "/v1/layers")]:
        status, body = await raw(node, method, path, key=None)
        assert status == 401
        assert isinstance(error_from_wire(status, body), Unauthorized)
    transport = Transport(node.url, "", timeout=10)  # what the SDK sends without a key
    try:
        with pytest.raises(Unauthorized, match="missing API key"):
            await transport.request("GET", "/v1/sandboxes")
    finally:
        await transport.close()


async def test_a_wrong_key_is_unauthorized_and_creates_nothing(node: EmbeddedNode) -> None:
    async with DSecClient(node.url, "dsec_" + "0" * 48) as bad:
        with pytest.raises(Unauthorized, match="unknown API key"):
            await bad.list()
        with pytest.raises(Unauthorized):
            await bad.run_container(DSecContainerRunArgs(container_image=TINY))
    status, _ = await raw(node, "GET", "/v1/sandboxes", key="not-a-key")
    assert status == 401
    assert node.edge.stats()["running"] == 0
    assert await fake(node).leftovers() == []


async def test_the_x_api_key_header_is_accepted(node: EmbeddedNode) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(node.url + "/v1/sandboxes", headers={"X-API-Key": node.api_key}) as resp:
            assert resp.status == 200
            assert await resp.json() == []


# -- typed errors across the wire ---------------------------------------------------------------


async def test_an_unknown_layer_is_layer_not_found(client: DSecClient, node: EmbeddedNode) -> None:
    with pytest.raises(LayerNotFound, match="nope:1"):
        await client.run_container(DSecContainerRunArgs(container_image="nope:1"))
    with pytest.raises(InvalidRequest):  # LayerNotFound is the caller's error too
        await client.run_container(DSecContainerRunArgs(layers=[TINY, "missing:2"]))
    assert await fake(node).leftovers() == []


async def test_a_zero_memory_limit_is_rejected_before_any_request(client: DSecClient) -> None:
    with pytest.raises(InvalidRequest, match="memory_limit_mb"):
        DSecContainerRunArgs(container_image=TINY, memory_limit_mb=0).to_spec()
    with pytest.raises(InvalidRequest, match="memory_limit_mb"):
        await client.run_container(DSecContainerRunArgs(container_image=TINY, memory_limit_mb=0))


@pytest.mark.parametrize(
    "spec",
    [
        {"image": TINY, "memory_limit_mb": 0},
        {"image": TINY, "cpu_cores_limit": 0},
        {"image": TINY, "layers": [TINY]},
        {},
        {"image": TINY, "init_user": "bad user"},
        {"image": TINY, "no_such_field": 1},
    ],
)
async def test_the_server_rejects_invalid_specs_itself(node: EmbeddedNode, spec: dict[str, Any]) -> None:
    # A client that is not our SDK (or an old one) gets the same typed error.
    status, body = await raw(node, "POST", "/v1/sandboxes", key=node.api_key, json={"spec": spec})
    assert status == 400
    err = error_from_wire(status, body)
    assert type(err) is InvalidRequest
    assert err.message
    assert node.edge.stats()["running"] == 0


async def test_a_body_that_is_not_json_is_invalid_request(node: EmbeddedNode) -> None:
    status, body = await raw(node, "POST", "/v1/sandboxes", key=node.api_key, data=b"{not json")
    assert status == 400
    assert type(error_from_wire(status, body)) is InvalidRequest


@pytest.mark.parametrize("bad_id", ["nonsense", "sb-local-1-short", "sb-LOCAL-1-" + "a" * 20])
async def test_a_malformed_sandbox_id_is_invalid_request(
    client: DSecClient, node: EmbeddedNode, bad_id: str
) -> None:
    with pytest.raises(InvalidRequest, match="malformed sandbox id"):
        await client.get(bad_id)
    status, body = await raw(node, "DELETE", f"/v1/sandboxes/{bad_id}", key=node.api_key)
    assert status == 400
    assert type(error_from_wire(status, body)) is InvalidRequest


async def test_a_well_formed_unknown_id_is_sandbox_not_found(client: DSecClient, node: EmbeddedNode) -> None:
    sid = str(SandboxId.new(node.config.node, node.edge.epoch))
    with pytest.raises(SandboxNotFound):
        await client.get(sid)
    status, _ = await raw(node, "DELETE", f"/v1/sandboxes/{sid}", key=node.api_key)
    assert status == 404
    status, _ = await raw(
        node, "POST", f"/v1/sandboxes/{sid}/shell", key=node.api_key, json={"command": "true"}
    )
    assert status == 404


async def test_an_id_from_another_node_is_sandbox_not_found(client: DSecClient, node: EmbeddedNode) -> None:
    with pytest.raises(SandboxNotFound, match="elsewhere"):
        await client.get(str(SandboxId.new("elsewhere", node.edge.epoch)))


async def test_an_id_from_an_earlier_epoch_is_sandbox_not_found(
    client: DSecClient, node: EmbeddedNode
) -> None:
    stale = node.edge.epoch - 1
    sid = str(SandboxId.new(node.config.node, stale))
    with pytest.raises(SandboxNotFound, match=f"epoch {stale}"):
        await client.get(sid)
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    try:
        parsed = SandboxId.parse(sandbox.id)
        with pytest.raises(SandboxNotFound, match=f"epoch {stale}"):
            await client.get(str(SandboxId(parsed.node, stale, parsed.tag)))  # same tag, old epoch
    finally:
        await sandbox.stop()


# -- sandboxes --------------------------------------------------------------------------------


async def test_create_run_and_stop_through_the_sdk(client: DSecClient, node: EmbeddedNode) -> None:
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, labels={"job": "j1"}))
    assert sandbox.info.state is SandboxState.running
    assert SandboxId.parse(sandbox.id).node == node.config.node
    result = await sandbox.run_shell("cat hello.txt; cd tmp; X=42")
    assert (result.exit_code, result.stdout) == (0, "hello from the layer\n")
    result = await sandbox.run_shell('echo "$X" > x; cat x')
    assert result.stdout == "42\n", "a session keeps cwd and variables between commands"
    assert await sandbox.read_file("/tmp/x") == b"42\n"
    result = await sandbox.exec(["sh", "-c", "cat; exit 4"], stdin="piped")
    assert (result.exit_code, result.stdout) == (4, "piped")
    assert fake(node).failed_creates == []
    assert await fake(node).leftovers() == [sandbox.id]
    info = await sandbox.stop()
    assert info.state is SandboxState.stopped
    assert await fake(node).leftovers() == []


async def test_list_filters_by_labels(client: DSecClient) -> None:
    a = await client.run_container(
        DSecContainerRunArgs(container_image=TINY, labels={"job": "a", "rank": "0"})
    )
    b = await client.run_container(
        DSecContainerRunArgs(container_image=TINY, labels={"job": "b", "rank": "0"})
    )
    c = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    try:

        async def ids(labels: dict[str, str] | None) -> list[str]:
            return sorted(s.id for s in await client.list(labels))

        assert await ids(None) == sorted([a.id, b.id, c.id])
        assert await ids({"job": "a"}) == [a.id]
        assert await ids({"rank": "0"}) == sorted([a.id, b.id])
        assert await ids({"job": "a", "rank": "0"}) == [a.id]
        assert await ids({"job": "a", "rank": "1"}) == []
        assert await ids({"job": "nobody"}) == []
        await a.stop()
        assert await ids({"rank": "0"}) == [b.id], "stopped sandboxes are not listed"
    finally:
        for s in (a, b, c):
            await s.stop()


async def test_a_label_filter_without_a_value_is_invalid(node: EmbeddedNode) -> None:
    status, body = await raw(node, "GET", "/v1/sandboxes?label=job", key=node.api_key)
    assert status == 400
    assert type(error_from_wire(status, body)) is InvalidRequest


async def test_stopping_twice_is_fine_and_the_stopped_sandbox_stays_visible(client: DSecClient) -> None:
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    first = await sandbox.stop()
    second = await sandbox.stop()
    assert first.state is second.state is SandboxState.stopped
    assert second.stop_reason == first.stop_reason == "stopped by user"
    assert (await client.get(sandbox.id)).info.state is SandboxState.stopped
    with pytest.raises(SandboxNotFound):
        await sandbox.run_shell("true")
    with pytest.raises(SandboxNotFound):
        await sandbox.read_file("/hello.txt")


async def test_a_second_sandbox_on_a_full_node_is_capacity_exhausted(nodes: Nodes) -> None:
    node = await nodes.start(max_sandboxes=1)
    async with DSecClient(node.url, node.api_key) as client:
        first = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        with pytest.raises(CapacityExhausted):
            await client.run_container(DSecContainerRunArgs(container_image=TINY))
        assert await fake(node).leftovers() == [first.id], "the rejected create started nothing"
        await first.stop()
        await node.watcher.poll()  # see test_capacity_freed_by_a_stop_is_usable_at_once
        second = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await second.stop()


async def test_capacity_freed_by_a_stop_is_usable_at_once(nodes: Nodes) -> None:
    node = await nodes.start(max_sandboxes=1)
    async with DSecClient(node.url, node.api_key) as client:
        first = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await node.watcher.poll()  # the watcher's regular poll happens to land now
        await first.stop()
        second = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await second.stop()


async def test_a_create_that_fails_in_the_backend_is_journaled_failed_and_leaves_nothing(
    nodes: Nodes,
) -> None:
    node = await nodes.start(max_sandboxes=1)
    backend = fake(node)
    digest = node.store.resolve(TINY).digest
    async with DSecClient(node.url, node.api_key) as client:
        backend.fail_create = True
        with pytest.raises(InfraFailure) as info:
            await client.run_container(DSecContainerRunArgs(container_image=TINY))
        assert info.value.reason == "runtime", "a trainer can mask infrastructure failures"
        [sid] = backend.failed_creates
        failed = (await client.get(sid)).info
        assert failed.state is SandboxState.failed
        assert failed.stop_reason is not None and failed.stop_reason.startswith("create failed")
        assert await client.list() == []
        assert await backend.leftovers() == []
        assert not (node.config.data_dir / "sandboxes" / sid).exists()
        assert node.mounts.refcount(digest) == 0, "the failed create released its layers"
        assert node.edge.stats()["running"] == node.edge.stats()["creating"] == 0

        backend.fail_create = False  # the failure did not use up the node's only slot
        sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        assert node.mounts.refcount(digest) == 1
        await sandbox.stop()
        assert node.mounts.refcount(digest) == 0


async def test_an_init_user_missing_from_the_image_is_invalid_request(
    client: DSecClient, node: EmbeddedNode
) -> None:
    digest = node.store.resolve(TINY).digest
    with pytest.raises(InvalidRequest, match="ghost"):
        await client.run_container(DSecContainerRunArgs(container_image=TINY, init_user="ghost"))
    assert node.mounts.refcount(digest) == 0
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, init_user="agent"))
    assert sandbox.info.init_user == "agent"
    await sandbox.stop()


async def test_a_stop_whose_destroy_failed_can_be_retried(client: DSecClient, node: EmbeddedNode) -> None:
    backend = fake(node)
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    try:
        backend.fail_destroy = True
        with pytest.raises(InfraFailure):
            await sandbox.stop()
        backend.fail_destroy = False
        info = await sandbox.stop()
        assert info.state is SandboxState.stopped, "a retried stop finishes the job"
        assert await backend.leftovers() == []
        assert node.edge.stats()["running"] == 0
    finally:
        backend.fail_destroy = False
        await backend.destroy(sandbox.id, {}, node.config.data_dir / "sandboxes" / sandbox.id)
