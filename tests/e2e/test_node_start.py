"""A node that fails to start leaves nothing of its own behind (LXCFS, cgroups, mounts)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dsec.node.embedded import EmbeddedNode
from tests.conftest import node_config
from tests.leaks import own_parents


def _mounts_under(path: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(path))]  # fmt: skip


async def test_a_node_that_cannot_listen_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    with socket.socket() as taken:  # the port the node is told to serve on is someone else's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = node_config(tmp_path, data_dir=data_dir)
        cfg.port = taken.getsockname()[1]
        cfg.host = "127.0.0.1"
        node = EmbeddedNode(cfg)
        with pytest.raises(OSError):
            await node.start()  # the edge, its LXCFS and its cgroups were up by then
    assert _mounts_under(data_dir) == [], "LXCFS and layer mounts go with the failed start"
    assert own_parents(data_dir) == [], "so do the node's cgroups"
