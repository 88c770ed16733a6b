"""An edge over the :class:`FakeBackend` with a real layer store, for the link conformance suite.

Layers are real (mkfs.erofs, EROFS mounts: root needed); sandboxes are fake (host processes,
copied roots), so a test starts in milliseconds. At the end every sandbox is stopped, every
mount under the test's tmp directory removed, and the fake's state directory must be empty.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.backends.container.backend import ContainerBackend
from dsec.backends.fake import FakeBackend
from dsec.edge.config import EdgeConfig
from dsec.edge.edge import Edge
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


# -- an edge over real containers, for the process table and watches -------------------------

CT_NODE = "edge-ct"
BUSYBOX = "busybox-procs:1"


def build_busybox_layer(root: Path) -> Path:
    """The tiny image plus a static busybox with every applet (sh, cat, stty, sleep...)."""
    build_tiny_layer(root)
    (root / "bin").mkdir()
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "tmp").chmod(0o1777)
    return root


@pytest.fixture(scope="session")
async def ct_edge(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Edge]:
    """One edge over the real :class:`ContainerBackend` (crun, dsec-enter) for the session."""
    if shutil.which("crun") is None or shutil.which("busybox") is None or shutil.which("gcc") is None:
        pytest.skip("container sandboxes need crun, busybox-static and gcc (dsec-enter)")
    tmp = tmp_path_factory.mktemp("ct-edge")
    store = LayerStore(tmp / "layers")
    store.import_path(build_busybox_layer(tmp / "busybox"), BUSYBOX)
    mounts = LayerMounts(tmp / "data" / "mnt")
    backend = ContainerBackend(tmp / "data")
    edge = Edge(EdgeConfig(data_dir=tmp / "data", node=CT_NODE, reap_interval_s=0.1), backend, store, mounts)
    await edge.start()
    try:
        yield edge
    finally:
        await edge.close(stop_sandboxes=True)
        left = await backend.leftovers()
        for sid in left:
            await backend.destroy(sid, {}, tmp / "unknown")
        await backend.detach()
        await backend.release_node()  # its parent cgroups, named after its data directory
        mounts.unmount_all()
        store.close()
        unmount_tree(tmp)
        assert left == [], "the edge left containers behind"
