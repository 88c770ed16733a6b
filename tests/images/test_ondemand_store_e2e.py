"""A node over a shared store of split layers, end to end: create, read, restart, stop.

The sandbox's layers are a busybox base and a workspace, both imported as split layers (the
shared store's default): the node copies their META to its local disk and reads the data
blobs in place on the store.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.node.embedded import EmbeddedNode, NodeConfig
from tests.conftest import node_config
from tests.unit.test_metrics_prometheus import parse, value

from .test_mounts_split import files_outside


def busybox_tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin/busybox")
    for applet in ("sh", "cat", "ls", "echo", "test", "id", "wc"):
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "root").mkdir()
    (root / "tmp").mkdir(mode=0o1777)
    return root


async def test_sandbox_runs_on_split_layers_from_a_shared_store_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared-fs"  # stands in for an NFS/CephFS/3FS mount
    shared.mkdir()
    cfg: NodeConfig = dataclasses.replace(
        node_config(tmp_path, data_dir=tmp_path / "node"), shared_layer_dir=shared, init_shared=True
    )
    ws = tmp_path / "ws"
    (ws / "work").mkdir(parents=True)
    (ws / "work/task.txt").write_text("solve it\n")
    (ws / "work/weights.bin").write_bytes(os.urandom(4 << 20))

    node = EmbeddedNode(cfg)
    await node.start()
    running = [node]
    try:
        assert node.store.layout == "split"
        base = node.store.import_path(busybox_tree(tmp_path / "base"), "tiny-base:1")
        work = node.store.import_path(ws, "tiny-ws:1")
        assert (base.format, work.format) == ("split", "split")
        async with DSecClient(node.url, node.api_key) as c:
            sb = await c.run_container(DSecContainerRunArgs(layers=["tiny-base:1", "tiny-ws:1"]))
            r = await sb.run_shell("cat /work/task.txt; wc -c < /work/weights.bin; echo new > /work/out")
            assert (r.exit_code, r.stdout) == (0, f"solve it\n{4 << 20}\n")
        meta_dir = tmp_path / "node" / "layer-meta"
        assert sorted(p.name for p in meta_dir.iterdir()) == sorted(
            f"{i.digest[7:]}.meta" for i in (base, work)
        )
        # Writes stay local, data stays on the store: no data blob was copied to the node.
        data_sizes = {node.store.blobs.size(str(i.data_digest)) for i in (base, work)}
        local = files_outside(tmp_path / "node", [])
        assert not [p for p in local if p.stat().st_size in data_sizes]

        await running.pop().close()  # the sandbox keeps running
        restarted = EmbeddedNode(cfg)
        await restarted.start()  # re-adopts the sandbox and both layer mounts
        running.append(restarted)
        assert restarted.mounts.mounted() == {base.digest: 1, work.digest: 1}
        async with DSecClient(restarted.url, restarted.api_key) as c:
            again = await c.get(sb.id)
            assert again.info.state is SandboxState.running
            assert (await again.run_shell("cat /work/out /work/task.txt")).stdout == "new\nsolve it\n"
            await again.stop()
    finally:
        for n in running:
            await n.close(stop_sandboxes=True)
    assert not list((tmp_path / "node" / "layer-meta").iterdir())  # unmounted with the layers


def _drop_cache(root: Path) -> None:
    """Forget the page cache of every file under ``root``: a cold shared store, as another
    node's would be (this node wrote the blobs at import, so it holds them)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def test_the_edge_reports_what_a_read_fetched_from_the_shared_store(tmp_path: Path) -> None:
    shared = tmp_path / "shared-fs"
    shared.mkdir()
    cfg: NodeConfig = dataclasses.replace(
        node_config(tmp_path, data_dir=tmp_path / "node"), shared_layer_dir=shared, init_shared=True
    )
    ws = tmp_path / "ws"
    (ws / "work").mkdir(parents=True)
    (ws / "work/weights.bin").write_bytes(os.urandom(8 << 20))
    (ws / "work/unread.bin").write_bytes(os.urandom(8 << 20))
    node = EmbeddedNode(cfg)
    await node.start()
    try:
        node.store.import_path(busybox_tree(tmp_path / "base"), "tiny-base:1")
        node.store.import_path(ws, "tiny-ws:1")
        _drop_cache(shared)
        async with DSecClient(node.url, node.api_key) as c:
            sb = await c.run_container(DSecContainerRunArgs(layers=["tiny-base:1", "tiny-ws:1"]))
            node.edge.mounts.reads.scan_now()  # what the scrapes start in the background
            before = parse((await node.edge.prom.scrape()).decode())
            r = await sb.run_shell("cat /work/weights.bin | wc -c")
            assert r.stdout == f"{8 << 20}\n"
            scanned = node.edge.mounts.reads.scan_now()
            after = parse((await node.edge.prom.scrape()).decode())
            await sb.stop()
    finally:
        await node.close(stop_sandboxes=True)
    assert value(after, "dsec_ondemand_layers") == 2
    data = value(after, "dsec_ondemand_data_bytes")
    assert data >= 16 << 20  # both files of the workspace, and busybox
    fetched = value(after, "dsec_ondemand_fetched_bytes", state="cached")
    # The file read came over (readahead may add a little); the file not read stayed there.
    assert fetched - value(before, "dsec_ondemand_fetched_bytes", state="cached") >= 8 << 20
    assert fetched < data - (4 << 20)
    # Read by the sandbox, decompressed: the file it read, busybox's pages it ran, not the other.
    assert scanned.complete and scanned.files >= 3
    read = value(after, "dsec_ondemand_read_bytes")
    assert read - value(before, "dsec_ondemand_read_bytes") >= 8 << 20
    assert read < 12 << 20
    assert abs(value(after, "dsec_ondemand_read_scan_timestamp_seconds") - scanned.at) < 0.01
