"""The scale-in drain fence (``POST /edge/v1/fence``) is journaled: an edge restarted while an
apiserver drains it goes on refusing creates, and a fence lifted before a restart stays lifted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsec import CapacityExhausted, DSecClient, DSecContainerRunArgs, SandboxState
from dsec.edge.journal import Journal
from dsec.edge.link import FenceRequest, LocalEdgeLink
from dsec.protocol.models import ContainerSpec

from .conftest import TINY, Nodes, fake

WHY = "scale-in drains this idle provider node"


async def test_an_edge_restarted_mid_drain_still_refuses_creates_until_unfenced(nodes: Nodes) -> None:
    node = await nodes.start()
    async with DSecClient(node.url, node.api_key) as client:
        kept = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    assert await LocalEdgeLink(node.edge).fence(True, WHY) is True
    # Committed when the fence is answered: a second connection reads it (a SIGKILL keeps it).
    other = Journal(node.config.data_dir / "edge" / "journal.sqlite")
    assert other.meta("drain_fence") == WHY
    other.close()

    await nodes.close(node)  # the edge restarts mid-drain; its sandbox keeps running
    node = await nodes.start()

    stats = node.edge.stats()
    assert (stats["fenced"], stats["capacity"]) == (True, 0), "every apiserver's placement skips it"
    with pytest.raises(CapacityExhausted, match=WHY):
        await node.edge.create(ContainerSpec(image=TINY))
    async with DSecClient(node.url, node.api_key) as client:
        await node.watcher.poll()
        with pytest.raises(CapacityExhausted):
            await client.run_container(DSecContainerRunArgs(container_image=TINY))
        again = await client.get(kept.id)
        assert again.info.state is SandboxState.running, "a fence refuses creates, it stops nothing"
    assert await fake(node).leftovers() == [kept.id], "the refused creates started nothing"

    assert await LocalEdgeLink(node.edge).fence(False, "scale-in keeps this node") is False
    await nodes.close(node)  # lifted before the restart: lifted after it
    node = await nodes.start()

    stats = node.edge.stats()
    assert (stats["fenced"], stats["capacity"]) == (False, node.edge.config.max_sandboxes)
    async with DSecClient(node.url, node.api_key) as client:
        await node.watcher.poll()
        made = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        await made.stop()
        await (await client.get(kept.id)).stop()


def test_a_fence_request_is_bounded() -> None:
    # The reason is journaled and repeated in every refusal: the route takes a bounded one only.
    assert FenceRequest.model_validate_json('{"fenced": true, "reason": "' + "x" * 500 + '"}').fenced
    with pytest.raises(ValidationError):
        FenceRequest.model_validate_json('{"fenced": true, "reason": "' + "x" * 501 + '"}')
    with pytest.raises(ValidationError):
        FenceRequest.model_validate_json('{"fenced": true, "until": 0}')
    with pytest.raises(ValidationError):
        FenceRequest.model_validate_json('{"reason": "no verdict"}')
