"""A layer records the network permissions that built it: the grants its sandbox held at any
time (a build's last step may run without network), with their cutoffs, on the layer's tag,
seen in the layer listing."""

from __future__ import annotations

import uuid
from pathlib import Path

from dsec import DSecClient, DSecContainerRunArgs
from tests.conftest import BASE, Sandboxes, node_config
from tests.netpolicy.mirror import egress_config, net
from tests.support import RestartedNode


async def test_a_committed_sandbox_s_layer_names_every_permission_it_held(
    client: DSecClient, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(network_rules={"mirror": True, "pypi": {"before": "2025-06-01"}})
    # mirror held before: still counts
    await sb.set_network_rules({"mirror": False, "other": True, "pypi": {"before": "2025-06-01"}})  # type: ignore[dict-item]
    await sb.run_shell("echo made > /made")
    ref = f"test/net-record:{uuid.uuid4().hex[:12]}"
    info = await sb.commit(ref)
    assert info.network == ["mirror", "other", "pypi@2025-06-01"]
    listed = {layer.digest: layer for layer in await client.layers()}
    assert listed[info.digest].network == ["mirror", "other", "pypi@2025-06-01"]
    plain = await (await make_sandbox()).commit(f"{ref}-plain")
    assert plain.network == []
    # The pip.conf the node wrote for its proxy stays out of the layer (it names this node).
    assert (await sb.run_shell("test -e /etc/pip.conf")).exit_code == 0
    child = await make_sandbox(container_image=None, layers=[BASE, ref])
    assert (await child.run_shell("cat /made && test ! -e /etc/pip.conf")).exit_code == 0


async def test_a_built_layer_names_the_build_s_permissions(client: DSecClient, tmp_path: Path) -> None:
    dockerfile = f"FROM {BASE}\nRUN echo built > /built\nRUN --network=none true\n"
    ref = f"test/net-record-build:{uuid.uuid4().hex[:12]}"
    info = await client.build_layer(dockerfile, tmp_path, ref, network_rules={"mirror": True})
    assert info.network == ["mirror"]
    offline = await client.build_layer(dockerfile, tmp_path, f"{ref}-offline")
    assert offline.network == []


async def test_a_permission_held_before_an_edge_restart_is_still_recorded(
    base_layer: str, tmp_path: Path
) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    cfg.edge["egress"] = egress_config(pool=f"{net(6)}.0/24")  # beside the session's node
    async with RestartedNode(cfg) as nodes:
        async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
            sb = await c.run_container(
                DSecContainerRunArgs(container_image=base_layer, network_rules={"mirror": True})
            )
            await sb.set_network_rules({"mirror": False, "other": True})  # mirror revoked
        second = await nodes.restart()  # the edge forgets its memory; the sandbox runs on
        async with DSecClient(second.url, second.api_key) as c:
            again = await c.get(sb.id)
            info = await again.commit(f"test/net-record-restart:{uuid.uuid4().hex[:12]}")
            assert info.network == ["mirror", "other"]
            await again.stop()
