"""The edge's shared volumes (protocol/volumes.py): their records, their content, their mounts.

Content is served from the host as root, so every path is resolved inside the volume's root
exactly as a sandbox's files are (:class:`~dsec.executor.files.SandboxFiles`: ``openat2``
with ``RESOLVE_IN_ROOT``, no symlink leads out, no FIFO or device is opened): what a sandbox
planted in a volume is as hostile as anything it planted in its own root.
"""

from __future__ import annotations

import asyncio
import posixpath
import stat as st
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from typing import Any

from dsec.backends.container.shared_volumes import SharedVolumes
from dsec.backends.container.volumes import DiskVolumes
from dsec.edge.tally import LiveSandboxes
from dsec.executor.file_ops import HostFileOps
from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import Conflict, FileNotFound, InvalidRequest
from dsec.protocol.files import FileType
from dsec.protocol.models import PROJECT_LABEL, ContainerSpec
from dsec.protocol.volumes import (
    MAX_LIST_ENTRIES,
    CreateVolume,
    DeleteVolume,
    GetVolume,
    ListDir,
    ListVolumes,
    MakeDir,
    RemovePath,
    StatPath,
    UpdatePath,
    VolumeEntry,
    VolumeInfo,
    VolumeOp,
    WriteOptions,
)


def _entry(files: SandboxFiles, path: str) -> VolumeEntry:
    s = files.lstat(path)
    base = files.stat(path)
    target = files.readlink(path) if st.S_ISLNK(s.st_mode) else None
    return VolumeEntry(**base.model_dump(), atime=s.st_atime, ctime=s.st_ctime, target=target)


def _walk(files: SandboxFiles, path: str, depth: int) -> list[VolumeEntry]:
    """Depth first, in name order (E2B's listRecursive): a directory, then what it holds."""
    out: list[VolumeEntry] = []

    def visit(directory: str, left: int) -> None:
        for child in files.list_dir(directory, max_entries=MAX_LIST_ENTRIES):
            try:
                out.append(_entry(files, child.path))
            except FileNotFound:  # gone since the listing
                continue
            if len(out) > MAX_LIST_ENTRIES:
                raise InvalidRequest(f"{path} holds more than {MAX_LIST_ENTRIES} entries to depth {depth}")
            if child.type is FileType.dir and left > 1:
                try:
                    visit(child.path, left - 1)
                except FileNotFound:
                    continue

    visit(path, depth)
    return out


def for_backend(backend: object, node: str, live: LiveSandboxes) -> VolumeService:
    """The service over the container backend's quota file system (none for another backend:
    the fake's unit tests, which then get a clear refusal)."""
    disk = getattr(backend, "volumes", None)
    if isinstance(disk, DiskVolumes):
        return VolumeService(SharedVolumes(disk, node), live)
    return VolumeService(
        None, live, f"node {node} keeps no shared volumes: its backend has no quota file system"
    )


class VolumeService:
    """``shared``: None on a node whose container backend keeps no quota file system (then
    every operation says why, ``why_none``)."""

    def __init__(self, shared: SharedVolumes | None, live: LiveSandboxes, why_none: str = "") -> None:
        self.shared = shared
        self._live = live
        self._why_none = why_none or "this node keeps no shared volumes"
        self._handlers: dict[type[VolumeOp], Callable[[Any], Awaitable[Any]]] = {
            CreateVolume: lambda op: self._volumes.create(op.project, op.name, op.size_mb),
            ListVolumes: lambda op: self._volumes.list(op.within),
            GetVolume: lambda op: self._volumes.describe(op.volume_id, op.within),
            DeleteVolume: self._delete,
            StatPath: lambda op: self._on(op, lambda f: _entry(f, op.path)),
            ListDir: self._list_dir,
            MakeDir: self._make_dir,
            RemovePath: self._remove,
            UpdatePath: self._update,
        }

    @property
    def _volumes(self) -> SharedVolumes:
        if self.shared is None:
            raise InvalidRequest(self._why_none)
        return self.shared

    async def call(self, op: VolumeOp) -> Any:
        handler = self._handlers.get(type(op))
        if handler is None:
            raise InvalidRequest(f"unknown volume operation {op.kind!r}")
        return await handler(op)

    async def _files(self, volume_id: str, within: str, uid: int = 0, gid: int = 0) -> SandboxFiles:
        rec = await self._volumes.get(volume_id, within)
        return SandboxFiles(self._volumes.root(rec), uid, gid)

    async def _on(self, op: Any, act: Callable[[SandboxFiles], Any]) -> Any:
        files = await self._files(op.volume_id, op.within)
        return await asyncio.to_thread(act, files)

    def mounted_by(self, volume_id: str) -> list[str]:
        return sorted(
            sid for sid, live in self._live.items() if volume_id in live.record.spec.volumes.values()
        )

    async def _delete(self, op: DeleteVolume) -> None:
        rec = await self._volumes.get(op.volume_id, op.within)
        users = self.mounted_by(rec.id)
        if users:
            shown = ", ".join(users[:5]) + (" ..." if len(users) > 5 else "")
            raise Conflict(
                f"volume {rec.name!r} is mounted by {len(users)} sandboxes ({shown}): stop them first"
            )
        await self._volumes.delete(rec.id, op.within)

    async def _list_dir(self, op: ListDir) -> list[VolumeEntry]:
        def walk(files: SandboxFiles) -> list[VolumeEntry]:
            if files.stat(op.path).type is not FileType.dir:
                raise InvalidRequest(f"not a directory: {op.path}")
            return _walk(files, op.path, op.depth)

        return await self._on(op, walk)  # type: ignore[no-any-return]

    async def _make_dir(self, op: MakeDir) -> VolumeEntry:
        files = await self._files(op.volume_id, op.within, op.uid, op.gid)

        def make() -> VolumeEntry:
            files.mkdir(op.path, parents=op.force, mode=op.mode)
            return _entry(files, op.path)

        return await asyncio.to_thread(make)

    async def _remove(self, op: RemovePath) -> None:
        if posixpath.normpath("/" + op.path.lstrip("/")) == "/":
            raise InvalidRequest("cannot delete root")

        def remove(files: SandboxFiles) -> None:
            files.lstat(op.path)  # a missing path is E2B's 404 (path_delete.go), not RemoveAll's nothing
            files.remove(op.path, recursive=True)

        await self._on(op, remove)

    async def _update(self, op: UpdatePath) -> VolumeEntry:
        def update(files: SandboxFiles) -> VolumeEntry:
            files.chattr(op.path, op.uid, op.gid, op.mode)
            return _entry(files, op.path)

        return await self._on(op, update)  # type: ignore[no-any-return]

    # -- content --------------------------------------------------------------------------------

    async def read(self, volume_id: str, within: str, path: str) -> AsyncGenerator[bytes, None]:
        files = await self._files(volume_id, within)
        async for chunk in HostFileOps(files).read_stream(path):
            yield chunk

    async def write(
        self, volume_id: str, within: str, path: str, chunks: AsyncIterable[bytes], opts: WriteOptions
    ) -> VolumeEntry:
        files = await self._files(volume_id, within, opts.uid, opts.gid)

        def check() -> None:
            if opts.force:
                return
            # Without force, as E2B's O_EXCL create: the parent must be there, the file not.
            parent = posixpath.dirname("/" + path.lstrip("/"))
            if files.stat(parent).type is not FileType.dir:
                raise InvalidRequest(f"not a directory: {parent}")
            try:
                files.lstat(path)
            except FileNotFound:
                return
            raise Conflict(f"already exists: {path}")

        await asyncio.to_thread(check)
        await HostFileOps(files).write_stream(path, chunks, opts.mode)
        # The temporary file took the mode through the umask-free fchmod; the owner is set here
        # for a file that replaced another (its writer's uid/gid are the ones asked).
        await asyncio.to_thread(files.chattr, path, opts.uid, opts.gid, opts.mode)
        return await asyncio.to_thread(_entry, files, path)

    # -- mounts ---------------------------------------------------------------------------------

    async def mount_sources(self, spec: ContainerSpec) -> dict[str, str]:
        """Sandbox path -> host directory of each volume ``spec`` mounts; each must be on this
        node and be its project's (or its subtree's): ``VolumeNotFound`` otherwise."""
        if not spec.volumes:
            return {}
        project = spec.labels.get(PROJECT_LABEL, "")
        return await self._volumes.mount_sources(spec.volumes, project)


__all__ = ["VolumeInfo", "VolumeService"]
