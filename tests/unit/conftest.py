"""Fast control-plane fixtures: a whole embedded DSec (apiserver, placement, edge, journal,
layer store) over the :class:`FakeBackend`, in a tmp directory, on a random port.

The layer store and its mounts are real (mkfs.erofs, EROFS mounts), so these need root; the
sandboxes are fake (host processes, copied roots), so they start in milliseconds. Every node a
test starts is closed, every sandbox stopped, every mount under the test's tmp directory
removed, and the fake's state directory must be empty at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends.fake import FakeBackend
from dsec.images.mount import mounts_under, unmount_tree
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.sdk.client import DSecClient
from tests.support import erofs_usable

TINY = "tiny:1"


if not erofs_usable():
    pytest.skip("the embedded node's layer store needs root, mkfs.erofs and EROFS", allow_module_level=True)


def build_tiny_layer(root: Path) -> Path:
    """A minimal image: /etc/passwd with root and an unprivileged user, /tmp, a file."""
    for d in ("etc", "tmp", "home/agent"):
        (root / d).mkdir(parents=True)
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"
    )
    (root / "hello.txt").write_text("hello from the layer\n")
    return root


class Nodes:
    """Starts embedded nodes over fake backends; closes them all at the end of the test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.layer_src = build_tiny_layer(tmp / "tiny")
        self.started: list[EmbeddedNode] = []

    def config(self, name: str = "n", **edge: float) -> NodeConfig:
        return NodeConfig(
            data_dir=self.tmp / name,
            port=0,
            config_file=self.tmp / f"{name}-client.json",
            edge={"reap_interval_s": 0.05, **edge},
        )

    def backend(self, name: str = "n") -> FakeBackend:
        return FakeBackend(self.tmp / f"{name}-fake-state")

    async def start(
        self, name: str = "n", *, backend: FakeBackend | None = None, **edge: float
    ) -> EmbeddedNode:
        node = EmbeddedNode(self.config(name, **edge), backend=backend or self.backend(name))
        if not node.store.has_tag(TINY):
            node.store.import_path(self.layer_src, TINY)
        node.store.mark_public(TINY)  # every test project's base, as `dsec base` makes its own
        await node.start()
        self.started.append(node)
        return node

    async def close(self, node: EmbeddedNode, *, stop_sandboxes: bool = False) -> None:
        """Close as a restart would (sandboxes keep running unless asked)."""
        self.started.remove(node)
        await node.close(stop_sandboxes=stop_sandboxes)
        node.store.close()


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        backends = []
        for node in list(n.started):
            backends.append(node.backend)
            await n.close(node, stop_sandboxes=True)
        left = []
        for backend in backends:
            assert isinstance(backend, FakeBackend)
            for sid in await backend.leftovers():  # clean up first, complain after
                left.append(sid)
                await backend.destroy(sid, {}, tmp_path / "unknown")
        unmount_tree(tmp_path)
        assert not mounts_under(tmp_path)
        assert left == [], "the node left sandboxes behind"


@pytest.fixture
async def node(nodes: Nodes) -> EmbeddedNode:
    return await nodes.start()


@pytest.fixture
async def client(node: EmbeddedNode) -> AsyncIterator[DSecClient]:
    async with DSecClient(node.url, node.api_key, timeout=30) as c:
        yield c


def fake(node: EmbeddedNode) -> FakeBackend:
    assert isinstance(node.backend, FakeBackend)
    return node.backend
