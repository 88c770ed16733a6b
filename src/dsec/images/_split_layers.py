"""Split layers in the layer store: the layer formats, what each blob is, and the data blobs.

:class:`_SplitLayers` is the part of :class:`~dsec.images.store.LayerStore` that knows split
layers (a META blob naming a data blob); :mod:`dsec.images.store` re-exports the public names.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from dsec.images.blobstore import BlobStore, SharedMountBlobStore
from dsec.images.ondemand import SplitImage, SplitInfo, probe_split, read_split_info
from dsec.images.refs import digest_hex
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, LayerNotFound
from dsec.protocol.models import LayerInfo

if TYPE_CHECKING:
    from dsec.images.owners import Viewer

log = logging.getLogger("dsec.images.store")  # the layer store's logger, as before the split

LayerFormat = Literal["single", "split"]
SINGLE: LayerFormat = "single"
SPLIT: LayerFormat = "split"
# Record prefix marking data blobs: split-data/<data hex>/<meta hex> (empty records).
SPLIT_DATA = "split-data"


def default_layout(blobs: BlobStore) -> LayerFormat:
    """``split`` over a shared mount (data read in place, on demand), ``single`` elsewhere."""
    return SPLIT if isinstance(blobs, SharedMountBlobStore) else SINGLE


_DATA = "data"  # a split layer's data blob
_FOREIGN = "foreign"  # an EROFS image with extra devices that build_split did not make


class _SplitLayers:
    """LayerStore's split-layer methods: what a blob is (cached), and storing a split layer."""

    blobs: BlobStore
    _kinds: dict[str, SplitInfo | str]

    if TYPE_CHECKING:

        def _not_found(self, ref: str, extra: str = "") -> LayerNotFound: ...
        def resolve(self, ref: str, *, viewer: Viewer | None = None) -> LayerInfo: ...

    def split_info(self, digest: str) -> SplitInfo | None:
        """The data blob a split layer's META names (digest and size), None for a single one.

        Reads META's first block once per process (a blob never changes). LayerNotFound if
        the blob is not stored.
        """
        kind = self._kind(digest)
        if kind == _FOREIGN:
            raise InfraFailure(
                f"layer blob {digest} is an EROFS image with extra devices that DSec did not make",
                reason=InfraReason.storage,
            )
        return kind if isinstance(kind, SplitInfo) else None

    def layer_format(self, digest: str) -> LayerFormat:
        """``split`` (META + data blob) or ``single`` (one image); LayerNotFound if absent."""
        return SPLIT if self.split_info(digest) is not None else SINGLE

    def layer_blobs(self, digest: str) -> builtins.list[str]:
        """Every blob the layer needs: its own and, for a split layer, the data blob."""
        info = self.split_info(digest)
        return [digest] if info is None else [digest, info.blob_digest]

    def _kind(self, digest: str) -> SplitInfo | str:
        kind = self._kinds.get(digest)
        if kind is not None:
            return kind
        digest_hex(digest)
        if self._is_data(digest):
            kind = _DATA
        else:
            try:
                kind = probe_split(self.blobs.path(digest)) or SINGLE
            except FileNotFoundError:
                raise self._not_found(digest) from None
            except InvalidRequest as err:  # extra devices we did not make: not mountable
                log.warning("layer blob %s: %s", digest, err)
                kind = _FOREIGN
            except OSError as err:
                raise InfraFailure(
                    f"reading layer blob {digest} failed: {err}", reason=InfraReason.storage
                ) from err
        self._kinds[digest] = kind
        return kind

    def _is_data(self, digest: str) -> bool:
        return bool(self.blobs.list_records(f"{SPLIT_DATA}/{digest_hex(digest)}"))

    def _data_digests(self) -> set[str]:
        """Every blob marked as a split layer's data blob."""
        return {f"sha256:{key.split('/')[1]}" for key in self.blobs.list_records(SPLIT_DATA)}

    def verify(self, ref: str, *, viewer: Viewer | None = None) -> LayerInfo:
        """Re-hash a layer's blobs (a split layer's META and data): InfraFailure(reason=
        "corrupt") if their bytes changed, reason="storage" if a data blob is missing."""
        info = self.resolve(ref, viewer=viewer)
        self.blobs.verify(info.digest)
        split = self.split_info(info.digest)
        if split is not None:
            size = self.blobs.stat(split.blob_digest)
            if size is None:
                raise _data_missing(info.digest, split.blob_digest)
            if size.size != split.blob_size:
                raise InfraFailure(
                    f"data blob {split.blob_digest} of layer {info.digest} has {size.size} bytes, "
                    f"its META expects {split.blob_size}: delete it and import the layer again",
                    reason=InfraReason.corrupt,
                )
            self.blobs.verify(split.blob_digest)
        return info

    def _put_split(self, split: SplitImage) -> str:
        """Store a split layer: mark the data blob, then put it, then META (which names it).

        The marker goes first (and again last, in case a collector pruned it meanwhile), so a
        data blob is never listed as a layer; the data blob goes before META, so a stored
        META's data is stored too (a collector spares both: a put refreshes the stamp).
        """
        marker = f"{SPLIT_DATA}/{digest_hex(split.blob_digest)}/{digest_hex(split.meta_digest)}"
        self.blobs.create_record(marker, b"")
        self.blobs.put(split.blob, expected=split.blob_digest)
        self.blobs.put(split.meta, expected=split.meta_digest)
        self.blobs.create_record(marker, b"")
        self._kinds[split.blob_digest] = _DATA
        self._kinds[split.meta_digest] = read_split_info(split.meta)
        return split.meta_digest


def _layer_info(
    digest: str, size: int, kind: SplitInfo | str, names: Sequence[str], created: float
) -> LayerInfo:
    if isinstance(kind, SplitInfo):
        return LayerInfo(
            digest=digest,
            size=size + kind.blob_size,
            names=list(names),
            created_at=created,
            format=SPLIT,
            data_digest=kind.blob_digest,
        )
    fmt = SINGLE if kind == SINGLE else None
    return LayerInfo(digest=digest, size=size, names=list(names), created_at=created, format=fmt)


def _data_missing(digest: str, data: str) -> InfraFailure:
    return InfraFailure(
        f"split layer {digest} names data blob {data}, which is not stored; import the layer again",
        reason=InfraReason.storage,
    )
