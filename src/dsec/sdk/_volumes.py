"""Shared volumes: the part of :class:`DSecClient` that keeps files across sandboxes.

    vol = await client.create_volume("datasets", size_mb=2048)
    await client.write_volume_file(vol.id, "/train.jsonl", data)
    sandbox = await client.run_container(DSecContainerRunArgs(..., volumes={"/data": vol.id}))

A volume lives on one node (its ID names it; sandboxes mounting it are placed there), belongs
to a project (the key's unless ``project`` names one below it), and holds at most ``size_mb``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from dsec.protocol.files import path_query
from dsec.protocol.volumes import (
    DEFAULT_SIZE_MB,
    CreateVolume,
    DeleteVolume,
    GetVolume,
    ListDir,
    ListVolumes,
    MakeDir,
    RemovePath,
    StatPath,
    VolumeEntry,
    VolumeInfo,
    VolumeOp,
    WriteOptions,
)

if TYPE_CHECKING:
    from dsec.sdk._transport import Transport


class VolumeCalls:
    if TYPE_CHECKING:

        @property
        def _t(self) -> Transport: ...

    async def _volume(self, op: VolumeOp) -> Any:
        body = await self._t.request(
            "POST", f"/v1/volumes/ops/{op.kind}", json_body=op.model_dump(mode="json")
        )
        return op.adapter.validate_python(body)

    async def create_volume(
        self, name: str, *, size_mb: int = DEFAULT_SIZE_MB, project: str | None = None
    ) -> VolumeInfo:
        """A new empty volume (``name``: 1-128 of ``A-Za-z0-9_-``, unique in its project on
        its node)."""
        info: VolumeInfo = await self._volume(CreateVolume(name=name, size_mb=size_mb, project=project or ""))
        return info

    async def list_volumes(self) -> list[VolumeInfo]:
        """The volumes of the key's project and below, on every node, oldest first."""
        found: list[VolumeInfo] = await self._volume(ListVolumes())
        return found

    async def get_volume(self, volume_id: str) -> VolumeInfo:
        info: VolumeInfo = await self._volume(GetVolume(volume_id=volume_id))
        return info

    async def delete_volume(self, volume_id: str) -> None:
        """Delete it and everything in it (``Conflict`` while a sandbox mounts it)."""
        await self._volume(DeleteVolume(volume_id=volume_id))

    async def volume_list_dir(self, volume_id: str, path: str = "/", *, depth: int = 1) -> list[VolumeEntry]:
        """Entries under ``path`` to ``depth`` (1-10), depth first in name order."""
        found: list[VolumeEntry] = await self._volume(ListDir(volume_id=volume_id, path=path, depth=depth))
        return found

    async def volume_stat(self, volume_id: str, path: str) -> VolumeEntry:
        entry: VolumeEntry = await self._volume(StatPath(volume_id=volume_id, path=path))
        return entry

    async def volume_mkdir(
        self, volume_id: str, path: str, *, parents: bool = True, mode: int = 0o755
    ) -> VolumeEntry:
        entry: VolumeEntry = await self._volume(
            MakeDir(volume_id=volume_id, path=path, force=parents, mode=mode, uid=0, gid=0)
        )
        return entry

    async def volume_remove(self, volume_id: str, path: str) -> None:
        """Remove a file, or a directory and everything below it."""
        await self._volume(RemovePath(volume_id=volume_id, path=path))

    async def read_volume_stream(self, volume_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._t.stream(
            "GET", f"/v1/volumes/{volume_id}/content", params=path_query("path", path)
        ):
            yield chunk

    async def read_volume_file(self, volume_id: str, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.read_volume_stream(volume_id, path)])

    async def write_volume_file(
        self, volume_id: str, path: str, data: bytes | str, *, mode: int = 0o644, uid: int = 0, gid: int = 0
    ) -> VolumeEntry:
        """Write ``path`` whole (replacing it, making missing parents), atomically."""
        opts = WriteOptions(uid=uid, gid=gid, mode=mode, force=True)
        params = {**path_query("path", path), **opts.to_query()}
        body = await self._t.request(
            "PUT",
            f"/v1/volumes/{volume_id}/content",
            params=params,
            data=data.encode() if isinstance(data, str) else data,
        )
        return VolumeEntry.model_validate(body)
