"""Per-project storage quotas: how many bytes of layers a project's subtree may own.

The quota is IAM's (``Quota.storage_mib``, set by a parent like the sandbox quotas); the layer
store enforces it, because every node that imports or commits a layer writes to the store
and not every node can reach IAM (a cluster's edges only share the store). So the apiserver
mirrors each project's storage quota into the store's record space, beside the catalogue::

    quotas/<project>     {"storage_mib": N}   (no record: no storage quota of its own)

written when a quota is set (project routes) and re-synced from IAM when an apiserver starts.

Usage of project P is the bytes of every stored blob that a project of P's subtree owns
(``owners/<hex>/<project>``, :mod:`dsec.images.catalogue`), each blob counted once however
many projects of the subtree own it; a split layer counts its META and its data blob. It is
computed from those records on every check (one listing and one stat per owned blob, no
counter to drift): a blob counts until gc removes it, so untagging frees room at the next gc.
Blobs without an owner record (stored before owners existed) count for nobody.

An import or commit is charged before its blob is stored or tagged, against the owner and
every ancestor with a quota: content the subtree already owns costs nothing (the same bytes
imported again); content that exists but belongs to others (another project's, public, the
OCI layer cache) costs its full size, since the subtree becomes one of its owners. A refusal
is ``QuotaExceeded`` naming the project, its quota and its usage; nothing is stored, tagged or
recorded. Checks in one process are serialized; imports racing in several processes may
together overshoot by what they had in flight (bounded by the upload and expansion caps).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from dsec.iam.base import ancestors, in_subtree
from dsec.images.blobstore import BlobStore, sha256_file
from dsec.images.catalogue import OWNERS, Catalogue
from dsec.images.erofs import build_erofs
from dsec.images.ondemand import build_split
from dsec.protocol.errors import InfraFailure, InfraReason, LayerNotFound, QuotaExceeded, QuotaReason

if TYPE_CHECKING:
    from dsec.images.ondemand import SplitImage, SplitInfo

QUOTAS = "quotas"
MIB = 1 << 20
REASON = QuotaReason.storage_mib


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


@dataclass(frozen=True)
class Room:
    """A storage quota above a project: whose it is, its size and what its subtree uses."""

    project: str
    limit: int  # bytes
    used: int

    def exceeded(self, need: str) -> QuotaExceeded:
        return QuotaExceeded(
            f"project {self.project!r} is at its storage quota: {_mib(self.used)} of"
            f" {self.limit // MIB} MiB in use, {need}",
            reason=REASON,
        )


class _StorageQuota:
    """LayerStore's storage quota: the mirrored limits, usage, and the charge at import."""

    blobs: BlobStore
    catalogue: Catalogue
    layout: str
    chunk_size: int
    _quota_lock: threading.Lock

    if TYPE_CHECKING:

        def split_info(self, digest: str) -> SplitInfo | None: ...
        def _put_split(self, split: SplitImage) -> str: ...
        def claim(self, digests: Iterable[str], owner: str) -> None: ...

    # -- the limits (mirrored from IAM) ---------------------------------------------------------

    def set_storage_quota(self, project: str, storage_mib: int | None) -> None:
        key = f"{QUOTAS}/{quote(project, safe='')}"
        if storage_mib is None:
            self.blobs.delete_record(key)
        else:
            self.blobs.replace_record(key, json.dumps({"storage_mib": storage_mib}).encode())

    def storage_quotas(self) -> dict[str, int]:
        """Every mirrored quota, ``{project: MiB}``."""
        out = {}
        for key in self.blobs.list_records(QUOTAS):
            project = unquote(key.rsplit("/", 1)[1])
            mib = self._read_quota(project)
            if mib is not None:
                out[project] = mib
        return out

    def _read_quota(self, project: str) -> int | None:
        key = f"{QUOTAS}/{quote(project, safe='')}"
        data = self.blobs.read_record(key)
        if data is None:
            return None
        try:
            return int(json.loads(data)["storage_mib"])
        except (ValueError, KeyError, TypeError) as err:
            raise InfraFailure(
                f"storage quota record {key} is unreadable: {err}", reason=InfraReason.storage
            ) from err

    def storage_limits(self, project: str) -> list[tuple[str, int]]:
        """``(project, bytes)`` of ``project`` and each ancestor with a quota, nearest first."""
        found = ((p, self._read_quota(p)) for p in reversed(ancestors(project)))
        return [(p, mib * MIB) for p, mib in found if mib is not None]

    # -- usage --------------------------------------------------------------------------------

    def _owned(self) -> dict[str, set[str]]:
        """``{digest: owners}`` from one listing of the owner records."""
        owned: dict[str, set[str]] = defaultdict(set)
        for key in self.blobs.list_records(OWNERS):
            parts = key.split("/")
            if len(parts) == 3:
                owned[f"sha256:{parts[1]}"].add(unquote(parts[2]))
        return owned

    def layer_bytes(self, digest: str) -> int:
        """What a stored layer occupies (a split one's META and data blob); 0 once collected."""
        st = self.blobs.stat(digest)
        if st is None:
            return 0
        try:
            split = self.split_info(digest)
        except (LayerNotFound, InfraFailure):
            return st.size  # collected since the stat, or not a layer DSec made: its own bytes
        return st.size + (split.blob_size if split is not None else 0)

    def storage_usage(
        self, projects: Iterable[str], owned: dict[str, set[str]] | None = None
    ) -> dict[str, int]:
        """Bytes of blobs each project's subtree owns (each blob once per subtree)."""
        owned = self._owned() if owned is None else owned
        sizes: dict[str, int] = {}
        out = {}
        for top in projects:
            total = 0
            for digest, owners in owned.items():
                if any(in_subtree(o, top) for o in owners):
                    if digest not in sizes:
                        sizes[digest] = self.layer_bytes(digest)
                    total += sizes[digest]
            out[top] = total
        return out

    # -- enforcement ----------------------------------------------------------------------------

    def expansion_bound(self, owner: str) -> tuple[str, int] | None:
        """The smallest storage quota above ``owner``, ``(project, bytes)``: what one archive
        may expand to (a bomb stops there). Not the room left: bytes the subtree owns already
        cost nothing, so a re-import must get as far as the charge."""
        limits = self.storage_limits(owner)
        return min(limits, key=lambda pl: pl[1]) if limits else None  # min keeps the nearest

    def past_bound(self, bound: tuple[str, int], what: str) -> QuotaExceeded:
        project, limit = bound
        used = self.storage_usage([project])[project]
        return Room(project, limit, used).exceeded(f"{what} expands past the whole quota")

    def charge(self, owner: str, layers: dict[str, int]) -> None:
        """Refuse (``QuotaExceeded``) unless ``owner`` and every ancestor with a quota has room
        for ``layers`` (``{digest: bytes}``), what the subtree owns already costing nothing.
        Call under ``_quota_lock``, and record the owner before releasing it."""
        limits = self.storage_limits(owner)
        if not limits:
            return
        owned = self._owned()
        used = self.storage_usage([p for p, _ in limits], owned)
        for project, limit in limits:  # nearest first: the refusal names the closest quota
            mine = {d for d, owners in owned.items() if any(in_subtree(o, project) for o in owners)}
            cost = sum(size for d, size in layers.items() if d not in mine)
            if cost and used[project] + cost > limit:
                raise Room(project, limit, used[project]).exceeded(f"this layer needs {_mib(cost)}")

    def claim_charged(self, digests: Iterable[str], owner: str) -> None:
        """:meth:`claim` stored layers for ``owner`` once :meth:`charge` let them in."""
        digests = list(dict.fromkeys(digests))
        with self._quota_lock:
            self.charge(owner, {d: self.layer_bytes(d) for d in digests})
            self.claim(digests, owner)

    def _store_tree(
        self, src: Path, work: Path, owner: str, payer: str | None = None
    ) -> tuple[str, dict[str, Path]]:
        """Build the layer of directory ``src`` in ``work``, charge ``payer`` (default: ``owner``)
        for it, store it and record both as owners; returns its digest and its blobs' files."""
        payer = payer or owner
        charged = bool(self.storage_limits(payer))
        split = None
        if self.layout == "split":
            split = build_split(src, work / "layer.meta", work / "layer.data", chunk_size=self.chunk_size)
            digest: str | None = split.meta_digest
            size = split.meta.stat().st_size + split.blob.stat().st_size
        else:
            image = work / "layer.erofs"
            build_erofs(src, image)
            size = image.stat().st_size
            # The digest before the blob is stored (one more read), only when it will be charged.
            digest = f"sha256:{sha256_file(image)}" if charged else None
        # Without a quota no lock: a put into a shared store may copy a large file.
        with self._quota_lock if charged else contextlib.nullcontext():
            if charged and digest is not None:
                self.charge(payer, {digest: size})
            if split is not None:
                digest = self._put_split(split)
                built = {digest: split.meta, split.blob_digest: split.blob}
            else:
                digest = self.blobs.put(image, expected=digest).digest
                built = {digest: image}
            self.claim([digest], owner)
            self.claim([digest], payer)
        return digest, built
