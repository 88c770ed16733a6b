"""Shared volumes through DSec's own SDK: files kept across sandboxes, edge restarts and node
stops, and kept to their project."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.images.mount import find_mount
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import Conflict, Forbidden, InvalidRequest, VolumeNotFound
from tests.conftest import BASE, Sandboxes, node_config
from tests.support import RestartedNode


@pytest.fixture
async def teams(client: DSecClient, node: EmbeddedNode) -> AsyncIterator[tuple[str, DSecClient, DSecClient]]:
    """Two sibling projects, each with a client of its own key."""
    top = f"vol-{uuid.uuid4().hex[:8]}"
    await client.create_project("root", top)
    await client.create_project(f"root/{top}", "a")
    await client.create_project(f"root/{top}", "b")
    keys = [await client.issue_key(f"root/{top}/{p}") for p in ("a", "b")]
    async with DSecClient(node.url, keys[0]) as a, DSecClient(node.url, keys[1]) as b:
        yield f"root/{top}", a, b
        for c in (a, b):
            for vol in await c.list_volumes():
                await c.delete_volume(vol.id)


async def test_a_volume_keeps_files_between_sandboxes(
    teams: tuple[str, DSecClient, DSecClient], node: EmbeddedNode
) -> None:
    top, a, _ = teams
    vol = await a.create_volume("work", size_mb=16)
    assert vol.project == f"{top}/a" and vol.size_mb == 16 and vol.id.startswith(f"vol-{node.config.node}-")
    await a.write_volume_file(vol.id, "/in/task.txt", "solve it\n")
    first = await a.run_container(DSecContainerRunArgs(container_image=BASE, volumes={"/data": vol.id}))
    try:
        assert (await first.exec(["cat", "/data/in/task.txt"])).stdout == "solve it\n"
        assert (await first.run_shell("echo done > /data/out.txt")).exit_code == 0
        with pytest.raises(Conflict, match="mounted by 1"):
            await a.delete_volume(vol.id)
    finally:
        await first.stop()
    assert await a.read_volume_file(vol.id, "/out.txt") == b"done\n"
    second = await a.run_container(DSecContainerRunArgs(container_image=BASE, volumes={"/w": vol.id}))
    try:
        assert (await second.exec(["cat", "/w/out.txt"])).stdout == "done\n"
    finally:
        await second.stop()
    assert [e.path for e in await a.volume_list_dir(vol.id, "/", depth=2)] == [
        "/in",
        "/in/task.txt",
        "/out.txt",
    ]
    assert (await a.volume_mkdir(vol.id, "/x/y")).type == "dir"
    await a.volume_remove(vol.id, "/x")
    got = await a.get_volume(vol.id)
    assert got.name == "work" and got.used_bytes is not None, got  # as of btrfs's last commit
    assert [v.id for v in await a.list_volumes()] == [vol.id]
    await a.delete_volume(vol.id)
    with pytest.raises(VolumeNotFound):
        await a.get_volume(vol.id)


async def test_a_volume_is_its_project_s_only(
    teams: tuple[str, DSecClient, DSecClient], make_sandbox: Sandboxes
) -> None:
    top, a, b = teams
    vol = await a.create_volume("private", size_mb=8)
    assert await b.list_volumes() == []
    with pytest.raises(VolumeNotFound):
        await b.get_volume(vol.id)
    with pytest.raises(VolumeNotFound):
        await b.read_volume_file(vol.id, "/")
    with pytest.raises(VolumeNotFound):
        await b.write_volume_file(vol.id, "/planted", "x")
    with pytest.raises(VolumeNotFound):
        await b.delete_volume(vol.id)
    with pytest.raises(VolumeNotFound):  # B's sandbox may not mount A's volume
        await b.run_container(DSecContainerRunArgs(container_image=BASE, volumes={"/v": vol.id}))
    with pytest.raises(Forbidden):
        await b.create_volume("into-a", project=f"{top}/a")
    with pytest.raises(InvalidRequest):
        await a.create_volume("no spaces allowed")
    with pytest.raises(Conflict):
        await a.create_volume("private")
    with pytest.raises(InvalidRequest, match="crun containers only"):
        await make_sandbox(volumes={"/v": vol.id}, runtime="gvisor")
    with pytest.raises(InvalidRequest, match="normalized"):  # "//proc" is /proc to crun
        await make_sandbox(volumes={"//proc": vol.id})
    with pytest.raises(InvalidRequest, match="no volume ID"):
        await make_sandbox(volumes={"/v": "../../etc"})
    assert await b.list_volumes() == [] and [v.id for v in await a.list_volumes()] == [vol.id]


async def test_a_volume_survives_an_edge_restart_and_a_node_stop(base_layer: str, tmp_path: Path) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    cfg.microvm = cfg.vm = False
    vid = ""
    try:
        async with RestartedNode(cfg) as nodes:
            quota_fs = nodes.node.backend.disk_quota
            async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
                vid = (await c.create_volume("kept", size_mb=8)).id
                await c.write_volume_file(vid, "/a", "before")
                args = DSecContainerRunArgs(container_image=base_layer, volumes={"/v": vid})
                sb = await c.run_container(args)
            second = await nodes.restart()  # the edge adopts its sandboxes, never destroying a volume
            async with DSecClient(second.url, second.api_key) as c:
                assert [v.id for v in await c.list_volumes()] == [vid]
                again = await c.get(sb.id)
                assert (await again.run_shell("cat /v/a; echo after > /v/b")).stdout == "before"
                await again.stop()
        assert find_mount(quota_fs.mnt) is None, "a stopped node leaves its quota file system unmounted"
        assert quota_fs.image.exists(), "...and keeps the image its volumes live in"
        async with RestartedNode(cfg) as nodes:
            async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
                assert await c.read_volume_file(vid, "/b") == b"after\n"
                await c.delete_volume(vid)
                vid = ""
        assert find_mount(quota_fs.mnt) is None and not quota_fs.image.exists(), "nothing left"
    finally:
        if vid:  # the test failed with the volume made: the node goes, and so does the volume
            async with RestartedNode(cfg) as nodes, DSecClient(nodes.node.url, nodes.node.api_key) as c:
                await c.delete_volume(vid)
