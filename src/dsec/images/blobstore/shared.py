"""The blob store on a POSIX mount of a shared filesystem that every node mounts."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.images.blobstore._dirstore import _DirBlobStore
from dsec.images.blobstore.base import MARKER
from dsec.protocol.errors import InfraFailure, InfraReason


class SharedMountBlobStore(_DirBlobStore):
    """A directory on a POSIX mount of a shared filesystem, configured by its path.

    Every node that mounts the filesystem opens the same directory and sees the same blobs and
    catalogue. The directory must already exist (it is on the mount): a missing path means the
    filesystem is not mounted, and creating it would silently fill the local disk instead. A
    directory that is not yet a store (no ``dsec-store.json``) is refused unless ``create`` is
    True, so an empty mount point (the shared filesystem not mounted over it) is never taken
    for a new store by accident.

    For network filesystems with attribute caches (NFS), mount with ``lookupcache=positive``
    (or ``actimeo`` small) so that a tag created on one node is found by the others at once.
    """

    def __init__(self, root: Path, *, create: bool = False) -> None:
        super().__init__(root)
        if not self.root.is_dir():
            raise InfraFailure(
                f"shared layer store {self.root} does not exist or is not a directory: is the shared "
                "filesystem mounted?",
                reason=InfraReason.storage,
            )
        if not (self.root / MARKER).exists() and not create:
            raise InfraFailure(
                f"{self.root} is not a DSec layer store (no {MARKER}): is the shared filesystem "
                "mounted there? To initialise a new store on it, open it once with create=True",
                reason=InfraReason.storage,
            )
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise InfraFailure(f"shared layer store {self.root} is not writable", reason=InfraReason.storage)
        try:
            self._make_dirs()
            self._write_marker()
        except OSError as err:
            raise InfraFailure(
                f"cannot open the shared layer store {root}: {err}", reason=InfraReason.storage
            ) from err
