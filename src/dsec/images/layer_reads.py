"""What sandboxes read of the on-demand layers: the layers' files in the page cache, by scan.

EROFS keeps no read count per mount (``/sys/fs/erofs/<id>/`` holds tunables only). What a
sandbox reads of a layer file lands in that file's page cache, decompressed (overlayfs reads a
lower file through the layer's own inode, so every sandbox over a layer shares those pages), so
the cached pages of a layer's files are what its sandboxes read and still hold, plus the
readahead within those files. That takes one ``cachestat`` per file, tens of thousands for a
Python image: too much for every scrape, so a :class:`ReadScanner` walks the mounted split
layers in a thread of its own at most every :data:`SCAN_INTERVAL_S`, and the metrics report the
last scan (``dsec_ondemand_read_bytes``, with its age and cost).

The walk is over layer content a tenant may have built: it follows no symlink, opens regular
files only (``O_NOFOLLOW``, ``O_NONBLOCK``), counts a hard-linked inode once, and stops at
:data:`MAX_FILES` files or :data:`MAX_SCAN_S` seconds (the scan then says it is partial).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.images._pagecache import CacheUse, fd_cache_use, supported

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 60.0
MAX_FILES = 1_000_000
MAX_SCAN_S = 30.0
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOATIME


@dataclass(frozen=True)
class ReadScan:
    """One scan: when it ended (``time.time()``), the layers' file bytes in the page cache, the
    files it looked at, how long it took, and whether it covered every file."""

    at: float
    cached_bytes: int
    files: int
    seconds: float
    complete: bool


def scan(
    roots: list[Path],
    guard: threading.Lock | None = None,
    max_files: int = MAX_FILES,
    max_seconds: float = MAX_SCAN_S,
) -> ReadScan:
    """Sum the page cache of every regular file under ``roots`` (one ``cachestat`` each).
    ``guard`` is held over each system call that holds a layer's mount (a directory read, an
    open file): an unmount that takes it meets no mount busy with the scan."""
    guard = guard or threading.Lock()
    started = time.monotonic()
    cached = files = 0
    for root in roots:
        seen: set[int] = set()  # inode numbers: one file system per layer, so they name files
        stack = [os.fspath(root)]
        while stack:
            try:
                with guard:
                    entries = list(os.scandir(stack.pop()))
            except OSError:
                continue  # unmounted meanwhile
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                        continue
                    # Symlinks, FIFOs, sockets, devices: none holds the layer's data.
                    if not entry.is_file(follow_symlinks=False) or entry.inode() in seen:
                        continue  # (or a hard link to a file counted already)
                    seen.add(entry.inode())
                    with guard:
                        use = _cache_use(entry.path)
                except OSError:
                    continue
                files += 1
                cached += use.cached if use is not None else 0
                if files >= max_files or time.monotonic() - started > max_seconds:
                    return ReadScan(time.time(), cached, files, time.monotonic() - started, False)
    return ReadScan(time.time(), cached, files, time.monotonic() - started, True)


def _cache_use(path: str) -> CacheUse | None:
    fd = os.open(path, _OPEN)
    try:
        return fd_cache_use(fd)
    finally:
        os.close(fd)


class ReadScanner:
    """Scans ``roots()`` (the mounted split layers) in the background, at most every
    ``interval_s``: :meth:`refresh` starts a scan if the last one is older, :attr:`last` is
    the newest finished (None before the first, or on a kernel without cachestat)."""

    def __init__(self, roots: Callable[[], list[Path]], interval_s: float = SCAN_INTERVAL_S) -> None:
        self._roots = roots
        self.guard = threading.Lock()  # taken by an unmount: see :func:`scan`
        self._interval = interval_s
        self._lock = threading.Lock()
        self._running = False
        self.last: ReadScan | None = None

    def refresh(self) -> None:
        """Start a scan in a daemon thread unless one runs or the last is fresh (returns at once)."""
        if not supported():
            return
        with self._lock:
            fresh = self.last is not None and time.time() - self.last.at < self._interval
            if self._running or fresh:
                return
            self._running = True
        threading.Thread(target=self._run, name="dsec-layer-reads", daemon=True).start()

    def scan_now(self) -> ReadScan:
        """Scan in this thread (what :meth:`refresh` runs) and keep the result."""
        result = scan(self._roots(), self.guard)
        with self._lock:
            self.last = result
        if not result.complete:
            log.warning("layer read scan stopped after %d files (%.1f s)", result.files, result.seconds)
        return result

    def _run(self) -> None:
        try:
            self.scan_now()
        except Exception:
            log.exception("layer read scan failed")
        finally:
            with self._lock:
                self._running = False
