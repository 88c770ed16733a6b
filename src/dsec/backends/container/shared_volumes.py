"""Shared volumes on one node: btrfs subvolumes of the node's quota file system (diskquota.py).

Each volume is a subvolume ``pv-<tag>`` whose qgroup limits what it holds (data and metadata)
to its ``size_mb``: a sandbox writing there, or an upload, fails with EDQUOT/ENOSPC past it,
whatever the node's disk has left. It holds ``volume.json`` (the record) and ``data/``, the
volume's root: only ``data/`` is ever bind-mounted into a sandbox or served, so the record is
out of every tenant's reach. Records are read from the subvolumes themselves (at the first
use after a start), so an edge restart or a reboot keeps every volume with no journal of its
own; per-sandbox quota volumes (named by sandbox IDs, ``sb-...``) never collide with them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from dsec.backends.container.diskquota import SHARED_PREFIX
from dsec.backends.container.volumes import DiskVolumes
from dsec.iam.base import in_subtree
from dsec.protocol.errors import (
    Conflict,
    InfraFailure,
    InfraReason,
    InvalidRequest,
    QuotaExceeded,
    QuotaReason,
    VolumeNotFound,
)
from dsec.protocol.volumes import (
    DEFAULT_DIR_MODE,
    DEFAULT_OWNER,
    MAX_VOLUMES_PER_PROJECT,
    VolumeId,
    VolumeInfo,
)

log = logging.getLogger("dsec.backends.container")
PREFIX = SHARED_PREFIX
RECORD = "volume.json"
DATA = "data"


class SharedVolumes:
    def __init__(self, disk: DiskVolumes, node: str) -> None:
        self.disk = disk
        self.node = node
        self._records: dict[str, VolumeInfo] | None = None  # volume ID -> record
        self._lock = asyncio.Lock()

    def _subvolume(self, volume_id: str) -> str:
        return PREFIX + VolumeId.parse(volume_id).tag

    async def _loaded(self) -> dict[str, VolumeInfo]:
        if self._records is None:
            await self.disk.ready("shared volumes")
            self._records = await asyncio.to_thread(self._read_all)
        return self._records

    def _read_all(self) -> dict[str, VolumeInfo]:
        out: dict[str, VolumeInfo] = {}
        for name in self.disk.fs.volumes():
            if not name.startswith(PREFIX):
                continue
            try:
                rec = VolumeInfo.model_validate_json((self.disk.fs.path(name) / RECORD).read_bytes())
            except (OSError, ValueError) as exc:  # a create cut before its record: not a volume
                log.warning("shared volume %s has no readable record (%s): left alone", name, exc)
                continue
            out[rec.id] = rec
        return out

    async def create(self, project: str, name: str, size_mb: int) -> VolumeInfo:
        if not project:
            raise InvalidRequest("a volume belongs to a project: none was given")
        size_limit = await self.disk.ready("shared volumes")
        if size_mb > size_limit:
            raise QuotaExceeded(
                f"a volume of {size_mb} MiB exceeds this node's quota file system ({size_limit} MiB)",
                reason=QuotaReason.storage_mib,
            )
        async with self._lock:
            records = await self._loaded()
            mine = [r for r in records.values() if r.project == project]
            if any(r.name == name for r in mine):
                raise Conflict(f"volume with name {name!r} already exists")
            if len(mine) >= MAX_VOLUMES_PER_PROJECT:
                raise QuotaExceeded(
                    f"project {project!r} has {len(mine)} volumes on this node: delete one first",
                    reason=QuotaReason.storage_mib,
                )
            vid = VolumeId.new(self.node)
            rec = VolumeInfo(id=str(vid), name=name, project=project, size_mb=size_mb, created_at=time.time())
            try:
                await asyncio.to_thread(self._make, PREFIX + vid.tag, rec)
            except OSError as exc:
                raise InfraFailure(f"cannot make volume {name!r}: {exc}", reason=InfraReason.storage) from exc
            records[rec.id] = rec
            return rec

    def _make(self, subvolume: str, rec: VolumeInfo) -> None:
        path = self.disk.fs.create_volume(subvolume, rec.size_mb << 20)
        try:
            data = path / DATA
            data.mkdir()
            os.chown(data, DEFAULT_OWNER, DEFAULT_OWNER)
            os.chmod(data, DEFAULT_DIR_MODE)
            tmp = path / (RECORD + ".tmp")
            tmp.write_text(rec.model_dump_json())
            os.replace(tmp, path / RECORD)  # last: a volume without its record is none
        except BaseException:
            self.disk.fs.destroy_volume(subvolume)
            raise

    async def list(self, within: str) -> list[VolumeInfo]:
        records = await self._loaded()
        mine = sorted(
            (r for r in records.values() if in_subtree(r.project, within)), key=lambda r: r.created_at
        )
        return await asyncio.to_thread(lambda: [self._with_usage(r) for r in mine])

    async def get(self, volume_id: str, within: str) -> VolumeInfo:
        rec = (await self._loaded()).get(volume_id)
        if rec is None or not in_subtree(rec.project, within):
            raise VolumeNotFound(f"volume {volume_id[:80]!r} not found")
        return rec

    async def describe(self, volume_id: str, within: str) -> VolumeInfo:
        """:meth:`get` with what the volume holds now."""
        rec = await self.get(volume_id, within)
        return await asyncio.to_thread(self._with_usage, rec)

    def _with_usage(self, rec: VolumeInfo) -> VolumeInfo:
        try:
            used = self.disk.fs.usage(self._subvolume(rec.id))
        except (OSError, ValueError):  # deleted meanwhile, or its qgroup not readable yet
            return rec
        return rec.model_copy(update={"used_bytes": used})

    async def delete(self, volume_id: str, within: str) -> None:
        async with self._lock:
            rec = await self.get(volume_id, within)
            try:
                await asyncio.to_thread(self.disk.fs.destroy_volume, self._subvolume(rec.id))
            except OSError as exc:
                why = f"cannot delete volume {rec.name!r}: {exc}"
                raise InfraFailure(why, reason=InfraReason.storage) from exc
            del (await self._loaded())[rec.id]
        self.disk.free_soon()

    def root(self, rec: VolumeInfo) -> Path:
        """The volume's content directory on the host (what sandboxes mount)."""
        return self.disk.fs.path(self._subvolume(rec.id)) / DATA

    async def mount_sources(self, mounts: dict[str, str], project: str) -> dict[str, str]:
        """Sandbox path -> host directory for a sandbox of ``project`` mounting ``mounts``
        (path -> volume ID): each volume of this node, and the project's or its subtree's."""
        out: dict[str, str] = {}
        for path, vid in mounts.items():
            rec = await self.get(vid, project)
            out[path] = str(self.root(rec))
        return out
