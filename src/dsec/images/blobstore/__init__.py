"""Blob stores: where layer images and the layer catalogue live.

The :class:`BlobStore` Protocol is the seam (narrow, like containerd's snapshotter). The layer
store (:mod:`dsec.images.store`) and its file catalogue (:mod:`dsec.images.catalogue`) need
only this from it:

* **blobs**, immutable files named by the sha256 of their bytes: ``put`` a finished file (never
  replacing a blob that is already there), ``path`` (a local POSIX path the kernel reads in
  place: on a shared mount that path is on the mount, so only the pages touched travel),
  ``exists``/``stat``/``size``, ``touch`` (refresh the last-use stamp that protects a blob from
  garbage collection), ``delete`` (only if not touched for ``min_age`` seconds), ``list_digests``,
  ``verify`` (re-hash);
* **records**, small files under "/"-separated keys: atomic create-if-absent, atomic replace,
  read, list, delete. They are all a catalogue needs, on any POSIX filesystem.

Implementations:

* :class:`LocalDirBlobStore` - a directory on local disk (the embedded default);
* :class:`SharedMountBlobStore` - the same layout on a POSIX mount of a shared filesystem (NFS,
  CephFS, JuiceFS, 3FS) that every node mounts, so every node sees the same layers;
* :class:`FakeBlobStore` - in memory (a temp directory backs ``path``), for tests.

Layout of a directory store (both POSIX implementations)::

    dsec-store.json                 marker: this directory is a DSec store (layout version)
    blobs/sha256/<hex>.erofs        immutable blobs, mode 0444; mtime = last put/touch
    catalogue/<key>                 small records (see dsec.images.catalogue for the keys)
    tmp/                            scratch on the same filesystem (imports in progress)

Correctness never relies on flock/fcntl locks or SQLite (both are unreliable on network
filesystems). Every publication is "write a hidden temporary, fsync, then make it visible with
one atomic step that fails if the name exists": ``link(2)`` (EEXIST), or where a filesystem has
no hard links ``renameat2(RENAME_NOREPLACE)``, or as a last resort a claim file created with
``O_CREAT|O_EXCL`` around a plain ``rename(2)``. Replacing a record is ``rename(2)`` over it.
Readers therefore only ever see absent or complete files.
"""

from dsec.images.blobstore._publish import publish_exclusive
from dsec.images.blobstore.base import (
    BLOB_SUFFIX,
    LAYOUT_VERSION,
    MARKER,
    BlobStat,
    BlobStore,
    PutResult,
    corrupt,
    key_parts,
    sha256_file,
)
from dsec.images.blobstore.fake import FakeBlobStore
from dsec.images.blobstore.local import LocalDirBlobStore
from dsec.images.blobstore.shared import SharedMountBlobStore

__all__ = [
    "BLOB_SUFFIX",
    "LAYOUT_VERSION",
    "MARKER",
    "BlobStat",
    "BlobStore",
    "FakeBlobStore",
    "LocalDirBlobStore",
    "PutResult",
    "SharedMountBlobStore",
    "corrupt",
    "key_parts",
    "publish_exclusive",
    "sha256_file",
]
