"""The :class:`BlobStore` Protocol, its result types, and the helpers every implementation shares
(hashing, record-key validation, the "corrupt blob" error)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

BLOB_SUFFIX = ".erofs"
MARKER = "dsec-store.json"
LAYOUT_VERSION = 1

# Record keys: "/"-separated components of a safe character set, never starting with "." (the
# stores' own temporaries start with "." and are thereby invisible to listings).
_KEY_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_%+=-][A-Za-z0-9._%+=-]{0,254}$")


@dataclass(frozen=True)
class PutResult:
    digest: str
    size: int
    created: bool  # False: the blob was already stored (its stamp was refreshed instead)


@dataclass(frozen=True)
class BlobStat:
    size: int
    mtime: float  # time of the last put or touch: garbage collection spares recent blobs


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed blobs plus small records; safe for many processes on many nodes."""

    root: Path  # where the store lives (messages, and the legacy catalogue next to it)
    blob_dir: Path  # the directory ``path`` points into
    tmp_dir: Path  # scratch on the store's filesystem: files built here are put by a link

    def put(self, src: Path, expected: str | None = None) -> PutResult:
        """Store the finished file ``src`` under the sha256 of its bytes.

        Never replaces a stored blob: if the content is already there, only its stamp is
        refreshed (``created`` is False). ``src`` may be linked or moved into the store (its mode
        becomes 0444); the caller removes it if it still exists. ``expected`` (a digest), if
        given, must match or InfraFailure(reason="corrupt") is raised.
        """
        ...

    def path(self, digest: str) -> Path:
        """A local path the kernel can read the blob from in place (it may not exist)."""
        ...

    def exists(self, digest: str) -> bool: ...

    def stat(self, digest: str) -> BlobStat | None: ...

    def size(self, digest: str) -> int:
        """The blob's size; LayerNotFound if it is not stored."""
        ...

    def touch(self, digest: str) -> bool:
        """Refresh the blob's stamp (it counts as just put); False if it is not stored."""
        ...

    def delete(self, digest: str, *, min_age: float = 0.0) -> bool:
        """Remove the blob unless it was put or touched less than ``min_age`` s ago.

        A put or touch that races with the delete wins: the blob is then kept. Returns whether
        the blob was removed.
        """
        ...

    def list_digests(self) -> list[str]:
        """Every stored blob's digest, sorted."""
        ...

    def verify(self, digest: str) -> None:
        """Re-hash the blob: InfraFailure(reason="corrupt") on mismatch, LayerNotFound if absent."""
        ...

    def sweep(self, min_age: float) -> int:
        """Clean up temporaries that crashed writers left behind, older than ``min_age`` s."""
        ...

    # -- records -----------------------------------------------------------------------------

    def create_record(self, key: str, data: bytes) -> bool:
        """Atomically create record ``key`` unless it exists; True if this call created it."""
        ...

    def replace_record(self, key: str, data: bytes) -> None:
        """Atomically create or replace record ``key`` (readers see the old or the new bytes)."""
        ...

    def read_record(self, key: str) -> bytes | None: ...

    def record_version(self, key: str) -> Hashable | None:
        """A token that changes whenever record ``key`` is created, replaced or deleted (None
        while it is absent), cheaper to get than the record: a reader keeps what it parsed
        under it (the catalogue's tags, read on every create)."""
        ...

    def list_records(self, prefix: str) -> list[str]:
        """Keys of every record below the key prefix ``prefix`` (a directory), sorted."""
        ...

    def delete_record(self, key: str) -> bool: ...


# ---- helpers ------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def key_parts(key: str) -> list[str]:
    """Validate a record key and split it; InvalidRequest for anything path-like or unsafe."""
    parts = key.split("/")
    if not key or not all(_KEY_COMPONENT_RE.match(p) for p in parts):
        raise InvalidRequest(
            f"invalid record key {key!r}: '/'-separated components of A-Za-z0-9._%+=- "
            "that do not start with '.'"
        )
    return parts


def corrupt(digest: str, actual_hex: str, where: Path | str) -> InfraFailure:
    return InfraFailure(
        f"layer blob {digest} is corrupt: its bytes hash to sha256:{actual_hex} (at {where}); "
        "delete the blob and import the layer again",
        reason=InfraReason.corrupt,
    )
