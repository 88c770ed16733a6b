"""Per-node layer mounts: each EROFS blob mounted once, shared by every sandbox that uses it.

A layer is mounted at ``<mount_root>/<hex>`` on first use and stays mounted when its last user
releases it: one superblock per layer is what lets all sandboxes share its page cache, and
remounting a hot layer for every sandbox would throw that away. Idle mounts are removed only
by an explicit :meth:`LayerMounts.unmount_unused` (e.g. under disk or memory pressure).

Mounts outlive the process: after an edge restart the constructor adopts the ones it finds
under ``mount_root`` with a reference count of zero. The edge must re-``acquire`` the layers of
the sandboxes it recovers from its journal *before* calling ``unmount_unused``.

The methods are sub-millisecond syscalls (mount 0.4-1.5 ms measured here), so they are plain
sync methods; async callers may call them directly or through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsec.images.mount import find_mount, mount_erofs, read_mountinfo, umount
from dsec.images.refs import digest_hex, make_digest
from dsec.protocol.errors import InfraFailure

# Node-local on purpose: the blob store may be a shared filesystem, mount points may not be.
DEFAULT_MOUNT_ROOT = Path("/run/dsec/layers")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class LayerMounts:
    def __init__(self, mount_root: Path = DEFAULT_MOUNT_ROOT) -> None:
        mount_root.mkdir(parents=True, exist_ok=True)
        self.mount_root = Path(os.path.realpath(mount_root))
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}  # hex digest -> users in this process
        self._adopt_existing()

    def _adopt_existing(self) -> None:
        root = os.fspath(self.mount_root)
        for entry in read_mountinfo():
            parent, _, name = entry.mount_point.rpartition("/")
            if parent == root and entry.fstype == "erofs" and _HEX64.match(name):
                self._refs.setdefault(name, 0)

    @contextmanager
    def _node_lock(self) -> Iterator[None]:
        # Serialises check-then-mount with other processes on this node (a CLI next to the
        # edge): two concurrent mounts on one directory would stack instead of failing.
        fd = os.open(self.mount_root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def path_for(self, digest: str) -> Path:
        return self.mount_root / digest_hex(digest)

    def acquire(self, digest: str, blob_path: Path) -> Path:
        """Mount the layer if this node has not yet, count one more user; returns the mount."""
        hexdigest = digest_hex(digest)
        target = self.mount_root / hexdigest
        with self._lock:
            if hexdigest in self._refs:
                self._refs[hexdigest] += 1
                return target
            with self._node_lock():
                if find_mount(target) is None:
                    if not blob_path.is_file():
                        raise InfraFailure(
                            f"layer blob {blob_path} for {digest} is missing", reason="storage"
                        )
                    target.mkdir(exist_ok=True)
                    try:
                        mount_erofs(blob_path, target)
                    except OSError as err:
                        raise InfraFailure(f"cannot mount layer {digest}: {err}", reason="storage") from err
            self._refs[hexdigest] = 1
            return target

    def release(self, digest: str) -> None:
        """One user fewer. The mount stays (see the module doc)."""
        hexdigest = digest_hex(digest)
        with self._lock:
            count = self._refs.get(hexdigest, 0)
            if count <= 0:
                raise ValueError(f"release of layer {digest} that has no users")
            self._refs[hexdigest] = count - 1

    def refcount(self, digest: str) -> int:
        with self._lock:
            return self._refs.get(digest_hex(digest), 0)

    def mounted(self) -> dict[str, int]:
        """Every layer mounted by (or adopted into) this instance, by digest, with its users."""
        with self._lock:
            return {make_digest(h): n for h, n in self._refs.items()}

    def _unmount(self, hexdigest: str, lazy: bool) -> None:
        target = self.mount_root / hexdigest
        # Loop: a crash between check and mount in an older process could have stacked two.
        while find_mount(target) is not None:
            umount(target, lazy=lazy)
        try:
            target.rmdir()
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
                raise

    def unmount_unused(self) -> list[str]:
        """Unmount every layer without users; returns their digests. Busy ones are skipped."""
        done = []
        with self._lock, self._node_lock():
            for hexdigest, count in list(self._refs.items()):
                if count > 0:
                    continue
                try:
                    self._unmount(hexdigest, lazy=False)
                except OSError as err:
                    if err.errno == errno.EBUSY:  # still used outside our accounting
                        continue
                    raise InfraFailure(f"cannot unmount layer {hexdigest}: {err}", reason="storage") from err
                del self._refs[hexdigest]
                done.append(make_digest(hexdigest))
        return done

    def unmount_all(self, lazy: bool = False) -> None:
        """Unmount every layer, used or not (node shutdown, tests). Raises the first failure."""
        first: OSError | None = None
        with self._lock, self._node_lock():
            self._adopt_existing()  # also what another process mounted since we started
            for hexdigest in list(self._refs):
                try:
                    self._unmount(hexdigest, lazy=lazy)
                except OSError as err:
                    first = first or err
                    continue
                del self._refs[hexdigest]
        if first is not None:
            raise InfraFailure(f"cannot unmount every layer: {first}", reason="storage") from first
