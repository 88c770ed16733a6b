"""The disk volumes of sandboxes with ``disk_limit_mb``, as the container backend uses them.

:mod:`.diskquota` is the quota file system itself (a btrfs image with a subvolume and qgroup
per sandbox); this is the node's use of it: made on the first create that asks for a limit
(a node whose sandboxes never do carries no extra mount), mounted again by an edge that
restarts, a sandbox's working directory made a symlink into its volume, and destroyed volumes
committed soon and in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from pathlib import Path

from dsec.backends.container import diskquota
from dsec.protocol.errors import CapacityExhausted, InfraFailure, InfraReason

log = logging.getLogger("dsec.backends.container")
COMMIT_INTERVAL_S = 2.0  # at most this often, a commit that frees destroyed volumes now


class DiskVolumes:
    def __init__(self, mnt_dir: Path, *, size_mb: int | None) -> None:
        self.fs = diskquota.QuotaFs(mnt_dir, size_mb=size_mb)
        self._ready = False
        self._lock = asyncio.Lock()
        self._commit: asyncio.Task[None] | None = None
        self._commit_again = False
        self._commit_stop = asyncio.Event()

    @functools.cached_property
    def why_not(self) -> str | None:
        """Why this node cannot enforce disk_limit_mb (None: it can); asked once."""
        return diskquota.QuotaFs.unsupported()

    def capacity_mb(self) -> int:
        """What all limited sandboxes may write together: the file system's size if it is
        there, else the size it will be made with."""
        if self._ready:
            return self.fs.size_bytes() >> 20
        root = self.fs.root if self.fs.root.exists() else self.fs.root.parent
        return self.fs.size_mb or diskquota.QuotaFs.default_size_mb(root)

    def remount(self) -> None:
        """At the edge's start: the file system of an earlier run, if there is one. Sandboxes of
        that run may live there (still mounted after an edge restart, to mount again after a
        reboot, so that their leftovers can be destroyed)."""
        if not self.fs.image.exists():
            return
        try:
            self.fs.ensure()
            self._ready = True
        except OSError as exc:
            log.error("disk quotas: cannot mount %s: %s", self.fs.image, exc)

    async def ready(self, what: str = "disk_limit_mb") -> int:
        """The file system made and mounted if it was not; its size in MiB. ``what`` names
        what needs it in the error of a node that cannot have one."""
        async with self._lock:
            if not self._ready:
                why = await asyncio.to_thread(lambda: self.why_not)
                if why is not None:
                    raise CapacityExhausted(f"this node cannot enforce {what}: {why}")
                try:
                    await asyncio.to_thread(self.fs.ensure)
                except OSError as exc:
                    raise InfraFailure(f"disk quota file system: {exc}", reason=InfraReason.storage) from exc
                self._ready = True
        return await asyncio.to_thread(self.fs.size_bytes) >> 20

    async def create(self, sandbox_id: str, workdir: Path, limit_mb: int) -> Path:
        """The sandbox's working directory in a subvolume limited to ``limit_mb``; ``workdir``
        becomes a symlink to it."""
        size_mb = await self.ready()
        if limit_mb > size_mb:
            raise CapacityExhausted(
                f"disk_limit_mb={limit_mb} exceeds this node's quota file system ({size_mb} MiB)"
            )
        try:
            return await asyncio.to_thread(self._linked_volume, sandbox_id, workdir, limit_mb << 20)
        except OSError as exc:
            raise InfraFailure(
                f"cannot make the sandbox's disk volume: {exc}", reason=InfraReason.storage
            ) from exc

    def _linked_volume(self, sandbox_id: str, workdir: Path, limit_bytes: int) -> Path:
        real = self.fs.create_volume(sandbox_id, limit_bytes)
        workdir.parent.mkdir(parents=True, exist_ok=True)
        workdir.symlink_to(real, target_is_directory=True)
        return real

    async def set_limit(self, sandbox_id: str, limit_bytes: int | None) -> None:
        try:
            await asyncio.to_thread(self.fs.set_limit, sandbox_id, limit_bytes)
        except OSError as exc:
            raise InfraFailure(f"disk limit of {sandbox_id}: {exc}", reason=InfraReason.storage) from exc

    async def destroy(self, sandbox_id: str) -> None:
        """The sandbox's volume, if it has one; its space comes back within a commit interval."""
        try:
            if await asyncio.to_thread(self.fs.destroy_volume, sandbox_id):
                self.free_soon()
        except OSError as exc:
            why = f"cannot remove the disk volume of {sandbox_id}: {exc}"
            raise InfraFailure(why, reason=InfraReason.storage) from exc

    async def volumes(self) -> list[str]:
        """The sandboxes' volumes (by sandbox ID); shared volumes are not among them, so an
        edge that reconciles its leftovers never takes one for a dead sandbox's."""
        names = await asyncio.to_thread(self.fs.volumes)
        return [n for n in names if not n.startswith(diskquota.SHARED_PREFIX)]

    async def release(self) -> None:
        """At the edge's close: no more commits (the kernel drops what is left at its own
        pace), and the file system unmounted if no sandbox has a volume there."""
        if self._commit is not None:
            self._commit_stop.set()
            await self._commit
        async with self._lock:
            if await asyncio.to_thread(self.fs.release):
                self._ready = False

    def free_soon(self) -> None:
        """Have the kernel drop destroyed volumes soon (their space and qgroups come back)
        rather than after its next periodic commit (up to 30 s): one commit at a time, at most
        one per interval however many sandboxes stop (a commit flushes every volume's dirty
        data)."""
        self._commit_again = True
        if self._commit is None or self._commit.done():
            self._commit_stop.clear()
            self._commit = asyncio.create_task(self._commit_volumes())

    async def _commit_volumes(self) -> None:
        while self._commit_again and not self._commit_stop.is_set():
            self._commit_again = False
            try:
                await asyncio.to_thread(self.fs.commit)
            except OSError as exc:
                log.warning("disk quotas: commit failed: %s", exc)
            with contextlib.suppress(TimeoutError):  # stops that come meanwhile wait for the next
                await asyncio.wait_for(self._commit_stop.wait(), COMMIT_INTERVAL_S)
