"""Two nodes over one shared layer store: a layer imported on one runs on the other."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dsec import DSecClient, DSecContainerRunArgs
from dsec.node.embedded import EmbeddedNode
from tests.conftest import node_config
from tests.e2e.test_images import busybox_layer


async def test_a_layer_imported_on_one_node_runs_on_another(tmp_path: Path) -> None:
    shared = tmp_path / "shared-fs"  # stands in for an NFS/CephFS/3FS mount
    shared.mkdir()
    archive = tmp_path / "base.tar"
    archive.write_bytes(busybox_layer())
    nodes = []
    for name, init in (("alpha", True), ("beta", False)):
        cfg = dataclasses.replace(
            node_config(tmp_path / name, data_dir=tmp_path / name),
            node=name,
            shared_layer_dir=shared,
            init_shared=init,
        )
        (tmp_path / name).mkdir(exist_ok=True)
        node = EmbeddedNode(cfg)
        await node.start()
        nodes.append(node)
    alpha, beta = nodes
    try:
        async with DSecClient(alpha.url, alpha.api_key) as a:
            info = await a.import_layer(archive, "tiny-shared:1")
        async with DSecClient(beta.url, beta.api_key) as b:
            assert info.digest in {x.digest for x in await b.layers()}
            sb = await b.run_container(DSecContainerRunArgs(container_image="tiny-shared:1"))
            assert sb.id.startswith("sb-beta-")
            assert (await sb.run_shell("cat /etc/motd")).stdout == "from base\n"
            await sb.stop()
    finally:
        for node in nodes:
            await node.close(stop_sandboxes=True)
