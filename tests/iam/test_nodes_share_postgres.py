"""Two nodes over one PostgreSQL IAM: keys work on both, a quota holds across both."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, QuotaExceeded
from dsec.backends.fake import FakeBackend
from dsec.node.embedded import EmbeddedNode, NodeConfig
from tests.unit.conftest import TINY, build_tiny_layer

from .pgserver import PgServer


async def test_quota_holds_across_nodes_sharing_postgres(pg_server: PgServer, tmp_path: Path) -> None:
    layer = build_tiny_layer(tmp_path / "tiny")
    nodes: list[EmbeddedNode] = []
    for name in ("pg-a", "pg-b"):
        cfg = NodeConfig(
            data_dir=tmp_path / name,
            port=0,
            node=name,
            config_file=tmp_path / f"{name}.json",
            iam_url=pg_server.dsn,
        )
        node = EmbeddedNode(cfg, backend=FakeBackend(tmp_path / f"{name}-fake"))
        node.store.import_path(layer, TINY)
        node.store.mark_public(TINY)  # the team's base
        await node.start()
        nodes.append(node)
    a, b = nodes
    try:
        team = f"team-{uuid.uuid4().hex[:8]}"
        async with DSecClient(a.url, a.api_key) as admin:
            await admin.create_project("root", team, sandboxes=1)
            key = await admin.issue_key(f"root/{team}")
        args = DSecContainerRunArgs(container_image=TINY)
        async with DSecClient(a.url, key) as on_a, DSecClient(b.url, key) as on_b:
            first = await on_a.run_container(args)  # the key, issued through a, works on b too
            with pytest.raises(QuotaExceeded):
                await on_b.run_container(args)
            await first.stop()
            second = await on_b.run_container(args)
            assert second.id.startswith("sb-pg-b-")
            await second.stop()
    finally:
        for node in nodes:
            await node.close(stop_sandboxes=True)
