"""An edge over the :class:`FakeBackend` with a real layer store, for the link conformance suite.

Layers are real (mkfs.erofs, EROFS mounts: root needed); sandboxes are fake (host processes,
copied roots), so a test starts in milliseconds. At the end every sandbox is stopped, every
mount under the test's tmp directory removed, and the fake's state directory must be empty.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.images.mount import mounts_under, unmount_tree
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from tests.support import erofs_usable
from tests.unit.conftest import TINY, build_tiny_layer

NODE = "edge-a"

if not erofs_usable():
    pytest.skip("the edge's layer store needs root, mkfs.erofs and EROFS", allow_module_level=True)


@dataclass
class EdgeEnv:
    edge: Edge
    backend: FakeBackend
    store: LayerStore
    tiny: str  # the digest of the one layer of image TINY
    tmp: Path


@pytest.fixture
async def edge_env(tmp_path: Path) -> AsyncIterator[EdgeEnv]:
    store = LayerStore(tmp_path / "layers")
    tiny = store.import_path(build_tiny_layer(tmp_path / "tiny"), TINY)
    mounts = LayerMounts(tmp_path / "data" / "mnt")
    backend = FakeBackend(tmp_path / "fake-state")
    edge = Edge(
        EdgeConfig(data_dir=tmp_path / "data", node=NODE, reap_interval_s=0.05, node_labels={"zone": "a"}),
        backend,
        store,
        mounts,
    )
    await edge.start()
    try:
        yield EdgeEnv(edge, backend, store, tiny.digest, tmp_path)
    finally:
        await edge.close(stop_sandboxes=True)
        left = await backend.leftovers()
        for sid in left:  # clean up first, complain after
            await backend.destroy(sid, {}, tmp_path / "unknown")
        mounts.unmount_all()
        store.close()
        unmount_tree(tmp_path)
        assert not mounts_under(tmp_path)
        assert left == [], "the edge left sandboxes behind"
