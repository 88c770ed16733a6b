"""The proxy's file cache: upstream files on the node's disk, each fetched once.

A file is stored under the SHA-256 of its upstream URL (registries never change the bytes
behind a release file's URL: PyPI and npm refuse re-uploads, Debian's pool paths carry the
version), written to a temporary name and renamed when whole, so a reader never sees half a
file and a crash leaves only temporaries (removed at start). Concurrent requests for one URL
share one upstream fetch (single flight): the first starts it, the rest wait for its result.
Files whose content may change (Debian's index files) are re-fetched once older than their
``max_age``. The cache keeps within its byte budget by dropping the least recently used files.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from dsec.protocol.errors import InfraFailure, InfraReason

# fetch(url, destination) writes the upstream body to destination and returns its size.
Fetch = Callable[[str, Path], Awaitable[int]]


class FileCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._inflight: dict[str, asyncio.Future[Path]] = {}
        self.upstream_fetches = 0  # what the cache saved is requests - upstream_fetches
        self.upstream_bytes = 0
        self.requests = 0
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*/*.part*"):
            stale.unlink(missing_ok=True)
        self._used = sum(p.stat().st_size for p in root.glob("*/*") if p.is_file())

    def path_of(self, url: str) -> Path:
        key = hashlib.sha256(url.encode()).hexdigest()
        return self.root / key[:2] / key

    async def get(self, url: str, fetch: Fetch, max_age: float | None = None) -> Path:
        """The local copy of ``url``, fetched (once, however many ask at the same time) when
        missing or older than ``max_age`` seconds."""
        self.requests += 1
        path = self.path_of(url)
        if self._fresh(path, max_age):
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: evicted last
            return path
        pending = self._inflight.get(url)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        self._inflight[url] = future
        try:
            await self._fetch(url, path, fetch)
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: waiters get it, nobody else needs to
            else:
                future.cancel()
            raise
        finally:
            del self._inflight[url]
        future.set_result(path)
        return path

    def _fresh(self, path: Path, max_age: float | None) -> bool:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return False
        return max_age is None or time.time() - mtime < max_age

    async def _fetch(self, url: str, path: Path, fetch: Fetch) -> None:
        path.parent.mkdir(exist_ok=True)
        part = path.with_name(f"{path.name}.part{os.getpid()}.{id(asyncio.current_task())}")
        try:
            old = _size(path)
            self.upstream_fetches += 1
            size = await fetch(url, part)
            self.upstream_bytes += size
            os.replace(part, path)
            self._used += size - old
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        if self._used > self.max_bytes:
            await asyncio.to_thread(self._evict, path)

    def _evict(self, keep: Path) -> None:
        """Drop least recently used files until the cache fits its budget again (a file being
        served stays readable to its reader: unlinking does not cut an open file)."""
        files = []
        for p in self.root.glob("*/*"):
            if ".part" in p.name or p == keep:
                continue
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        used = sum(size for _, size, _ in files) + keep.stat().st_size
        for _, size, p in sorted(files):
            if used <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            used -= size
        self._used = used
        if used > self.max_bytes:
            raise InfraFailure(
                "the registry cache cannot hold this file within its budget", reason=InfraReason.storage
            )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
