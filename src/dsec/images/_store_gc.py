"""Garbage collection of the layer store: blobs no tag names, and split layers' data blobs."""

from __future__ import annotations

import builtins
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dsec.images._split_layers import SPLIT_DATA
from dsec.images.blobstore import BlobStore
from dsec.images.catalogue import Catalogue
from dsec.images.ondemand import SplitInfo
from dsec.images.refs import digest_hex
from dsec.protocol.errors import InfraFailure, LayerNotFound

log = logging.getLogger("dsec.images.store")  # the layer store's logger, as before the split

# Temporaries of crashed writers are swept by gc once they are at least this old.
_SWEEP_MIN_AGE_S = 3600.0


class _GarbageCollection:
    """LayerStore's garbage collection (see :meth:`gc`)."""

    blobs: BlobStore
    catalogue: Catalogue
    gc_grace_s: float
    _kinds: dict[str, SplitInfo | str]

    if TYPE_CHECKING:

        def _kind(self, digest: str) -> SplitInfo | str: ...

        def _data_digests(self) -> set[str]: ...

    def gc(self, in_use: Iterable[str] = frozenset(), *, grace_s: float | None = None) -> builtins.list[str]:
        """Delete blobs that no tag names and that are not in ``in_use``; returns their digests.

        A blob put or touched less than ``grace_s`` (default: the store's ``gc_grace_s``, 10 min)
        ago is kept: an import stores its blob before it tags it. ``in_use`` must hold what
        every node sharing the store has mounted (the store cannot see other nodes' mounts).
        """
        grace = self.gc_grace_s if grace_s is None else grace_s
        keep = set()
        for d in in_use:
            digest_hex(d)
            keep.add(d)
        self.blobs.sweep(max(grace, _SWEEP_MIN_AGE_S))
        records = self.catalogue.records()
        for rec in records:
            keep.update(rec.digests)
        for d in list(keep):  # a kept split layer keeps its data blob (its META is the truth)
            info = self._split_or_none(d)
            if info is not None:
                keep.add(info.blob_digest)
        data = self._data_digests()
        stored = self.blobs.list_digests()
        # Layers first, then the data blobs that no remaining split layer names: a young
        # (spared) untagged split layer keeps its data blob as long as it stays itself.
        removed = [
            d for d in stored if d not in keep and d not in data and self.blobs.delete(d, min_age=grace)
        ]
        needed, sure = set(), True
        for d in self.blobs.list_digests():
            if d in data:
                continue
            try:
                info = self._split_or_none(d)
            except InfraFailure as err:  # unreadable META: we cannot tell which data it needs
                log.warning("gc keeps every data blob this time: %s", err)
                sure = False
                break
            if info is not None:
                needed.add(info.blob_digest)
        if sure:
            removed += [
                d
                for d in stored
                if d in data and d not in keep and d not in needed and self.blobs.delete(d, min_age=grace)
            ]
        self._prune_data_markers()
        self.catalogue.repair_index(records)
        for d in removed:
            self._kinds.pop(d, None)
        removed.sort()
        if removed:
            log.info("gc removed %d unreferenced blobs: %s", len(removed), removed)
        return removed

    def _split_or_none(self, digest: str) -> SplitInfo | None:
        """split_info for gc: None for a blob that is gone or that is no layer of ours."""
        try:
            kind = self._kind(digest)
        except LayerNotFound:
            return None
        return kind if isinstance(kind, SplitInfo) else None

    def _prune_data_markers(self) -> None:
        """Drop the markers of data blobs that are gone together with their layer; put one
        back if a writer stored either meanwhile (markers are a superset of the truth)."""
        for key in self.blobs.list_records(SPLIT_DATA):
            parts = key.split("/")
            if len(parts) != 3:
                continue
            data, meta = f"sha256:{parts[1]}", f"sha256:{parts[2]}"
            if self.blobs.exists(data) or self.blobs.exists(meta):
                continue
            self.blobs.delete_record(key)
            if self.blobs.exists(data) or self.blobs.exists(meta):
                self.blobs.create_record(key, b"")
