"""Shared volumes through an :class:`EdgeLink` (part of :class:`LinkConformance`): records,
content, limits and mounts in real container sandboxes (the ``ct_link`` fixture), so the local
link and the wire both carry every volume operation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dsec.edge.link import EdgeLink
from dsec.protocol.errors import Conflict, FileNotFound, InvalidRequest, VolumeNotFound
from dsec.protocol.models import PROJECT_LABEL, ContainerSpec, ShellRequest
from dsec.protocol.volumes import (
    CreateVolume,
    DeleteVolume,
    GetVolume,
    ListDir,
    ListVolumes,
    MakeDir,
    RemovePath,
    StatPath,
    UpdatePath,
    VolumeInfo,
    WriteOptions,
)

from .conftest import BUSYBOX


async def _bytes(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _spec(project: str, volumes: dict[str, str]) -> ContainerSpec:
    base = ContainerSpec(image=BUSYBOX, volumes=volumes)
    return base.model_copy(update={"labels": {PROJECT_LABEL: project}})


class VolumeConformance:
    @pytest.fixture
    async def volume(self, ct_link: EdgeLink) -> AsyncIterator[VolumeInfo]:
        rec: VolumeInfo = await ct_link.volume(CreateVolume(name="conf", project="root/va", size_mb=8))
        yield rec
        try:
            await ct_link.volume(DeleteVolume(volume_id=rec.id, within="root"))
        except VolumeNotFound:
            pass

    async def test_a_volume_is_its_project_s_and_its_content_is_confined(
        self, ct_link: EdgeLink, volume: VolumeInfo
    ) -> None:
        vid = volume.id
        assert [r.id for r in await ct_link.volume(ListVolumes(within="root/va"))] == [vid]
        assert vid in [r.id for r in await ct_link.volume(ListVolumes(within="root"))], "a parent sees it"
        assert await ct_link.volume(ListVolumes(within="root/vb")) == []
        with pytest.raises(VolumeNotFound):
            await ct_link.volume(GetVolume(volume_id=vid, within="root/vb"))
        with pytest.raises(Conflict):
            await ct_link.volume(CreateVolume(name="conf", project="root/va"))

        opts = WriteOptions(force=True, uid=1000, gid=1000, mode=0o600)
        entry = await ct_link.volume_write(vid, "root/va", "/a/b/f.txt", _bytes(b"content"), opts)
        assert (entry.path, entry.size, entry.uid, entry.mode) == ("/a/b/f.txt", 7, 1000, 0o600)
        with pytest.raises(Conflict):  # no force: an existing file stays
            await ct_link.volume_write(vid, "root/va", "/a/b/f.txt", _bytes(b"x"), WriteOptions())
        with pytest.raises(FileNotFound):  # no force: no parents made
            await ct_link.volume_write(vid, "root/va", "/new/f.txt", _bytes(b"x"), WriteOptions())
        with pytest.raises(VolumeNotFound):  # another project's key reaches nothing
            await ct_link.volume_write(vid, "root/vb", "/g.txt", _bytes(b"x"), WriteOptions())
        got = b"".join([c async for c in ct_link.volume_read(vid, "root/va", "/a/b/f.txt")])
        assert got == b"content"
        made = await ct_link.volume(MakeDir(volume_id=vid, within="root/va", path="/d", mode=0o700))
        assert made.type == "dir" and made.mode == 0o700
        listing = await ct_link.volume(ListDir(volume_id=vid, within="root/va", path="/", depth=3))
        assert [e.path for e in listing] == ["/a", "/a/b", "/a/b/f.txt", "/d"], "depth first, by name"
        changed = await ct_link.volume(UpdatePath(volume_id=vid, within="root/va", path="/d", mode=0o755))
        assert changed.mode == 0o755 and changed.uid == made.uid
        with pytest.raises(InvalidRequest):
            await ct_link.volume(RemovePath(volume_id=vid, within="root/va", path="/"))
        await ct_link.volume(RemovePath(volume_id=vid, within="root/va", path="/a"))
        with pytest.raises(FileNotFound):
            await ct_link.volume(StatPath(volume_id=vid, within="root/va", path="/a"))

    async def test_a_mounted_volume_outlives_its_sandboxes_and_holds_its_size(
        self, ct_link: EdgeLink, volume: VolumeInfo
    ) -> None:
        vid = volume.id
        with pytest.raises(VolumeNotFound):  # another project's sandbox may not mount it
            await ct_link.create(_spec("root/vb", {"/v": vid}))
        info = await ct_link.create(_spec("root/va", {"/v": vid}))
        try:
            with pytest.raises(Conflict):
                await ct_link.volume(DeleteVolume(volume_id=vid, within="root/va"))
            # A symlink out of the volume, and past its size limit of 8 MiB.
            script = "ln -s /etc /v/out; echo kept > /v/kept; dd if=/dev/zero of=/v/big bs=1M count=16 2>&1"
            res = await ct_link.run_shell(info.id, ShellRequest(command=script))
            assert "Disk quota exceeded" in res.stdout or "No space left" in res.stdout, res.stdout
        finally:
            await ct_link.stop(info.id)
        with pytest.raises(FileNotFound):  # /out/passwd resolves in the volume, which has no /etc
            await anext(ct_link.volume_read(vid, "root/va", "/out/passwd"))
        second = await ct_link.create(_spec("root/va", {"/data": vid}))
        try:
            res = await ct_link.run_shell(second.id, ShellRequest(command="cat /data/kept"))
            assert res.stdout == "kept\n"
        finally:
            await ct_link.stop(second.id)
        await ct_link.volume(DeleteVolume(volume_id=vid, within="root/va"))
        with pytest.raises(VolumeNotFound):
            await ct_link.volume(GetVolume(volume_id=vid, within="root/va"))
        with pytest.raises(VolumeNotFound):  # a sandbox cannot mount it any more
            await ct_link.create(_spec("root/va", {"/v": vid}))
