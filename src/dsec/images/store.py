"""The layer store: content-addressed EROFS blobs plus a catalogue of tags, both in one place.

The store runs over any :class:`~dsec.images.blobstore.BlobStore`: a local directory (the
embedded default, ``LayerStore(root)``) or a shared filesystem that every node mounts
(``LayerStore.over(SharedMountBlobStore(path))``), so that every node sees the same layers. The
catalogue (:mod:`dsec.images.catalogue`) is made of small files beside the blobs, not of a
database: SQLite and advisory locks are unsafe on network filesystems, while the atomic
create-if-absent and rename of single files that the catalogue needs work on every POSIX one.

A layer is stored in one of two formats, side by side in one store (see :meth:`LayerStore.layer_format`):

* ``single``: one lz4-compressed EROFS image (:func:`dsec.images.erofs.build_erofs`); the
  layer's digest is the image's. The default over a local directory.
* ``split``: two blobs (:mod:`dsec.images.ondemand`): a small metadata image (META) and the
  uncompressed file data, which the kernel reads in place, page by page, so starting a sandbox
  never copies the layer. The layer's digest is META's, and META records the data blob's digest
  and size, so the layer digest covers the data too. The default over a
  :class:`~dsec.images.blobstore.SharedMountBlobStore`. A data blob is not a layer: listings
  and lookups skip it (a ``split-data/<data hex>/<meta hex>`` record marks it), and gc keeps it
  while a split layer that names it is kept.

The format is read from META itself (its superblock: one small read, cached), so blobs stored
before split layers existed need no migration.

Layout under ``root`` (directory stores)::

    dsec-store.json                  marker and layout version
    blobs/sha256/<hex>.erofs         immutable images, named by the sha256 of their bytes
                                     (a split layer's data blob too)
    catalogue/tags/<name>/<version>.json   {"kind": "layer" | "image", "digests": [...],
                                     "created_at": ...}; a layer tag is a list of one digest,
                                     an image an ordered list (base first); one namespace
    catalogue/refs/<hex>/<name>/<version>  reverse index: which tags name a blob
    catalogue/meta/                  bookkeeping (the one-time import of catalog.sqlite)
    catalogue/split-data/<data hex>/<meta hex>   empty: "this blob is the data of that split layer"
    tmp/                             imports in progress (same filesystem: publishing is a link)

Rules, safe for many processes on many nodes at once:

* a blob appears with one atomic link and is never rewritten: importing the same content
  twice stores it once;
* versions are immutable: creating ``name:version`` again with other content is an
  InvalidRequest; only :meth:`LayerStore.retag` moves a tag, and only when asked;
* :meth:`LayerStore.gc` removes blobs that no tag names and the caller does not use, but never
  one put or touched within the grace period (an import stores its blob before tagging it);
  a put, a tag or a retag refreshes the blob's stamp first, so it wins any race with a
  collector (see ``BlobStore.delete``).

A store that still has the ``catalog.sqlite`` of the earlier design gets its tags and images
imported into the file catalogue once, on open; the SQLite file is left untouched.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import get_args

from dsec.images._split_layers import (
    _DATA,
    SINGLE,
    SPLIT,
    SPLIT_DATA,
    LayerFormat,
    _data_missing,
    _layer_info,
    _SplitLayers,
    default_layout,
)
from dsec.images._store_gc import _GarbageCollection
from dsec.images.blobstore import BlobStore, LocalDirBlobStore
from dsec.images.catalogue import IMAGE, LAYER, Catalogue, Kind, TagRecord, migrate_sqlite
from dsec.images.erofs import build_erofs
from dsec.images.ondemand import DEFAULT_CHUNK_SIZE, SplitInfo, build_split
from dsec.images.refs import HEX_PREFIX_RE, REF_FORMS, digest_hex, is_tag, parse_tag
from dsec.images.tarextract import extract_tar
from dsec.protocol.errors import InfraFailure, InvalidRequest, LayerNotFound
from dsec.protocol.models import LayerInfo

__all__ = [
    "DEFAULT_GC_GRACE_S",
    "DEFAULT_ROOT",
    "LEGACY_CATALOGUE",
    "SINGLE",
    "SPLIT",
    "SPLIT_DATA",
    "LayerFormat",
    "LayerStore",
    "default_layout",
]

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/var/lib/dsec/layers")
DEFAULT_GC_GRACE_S = 600.0
LEGACY_CATALOGUE = "catalog.sqlite"

_LS_HINT = "see the available layers with `dsec layer ls`"


class LayerStore(_SplitLayers, _GarbageCollection):
    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        *,
        blobs: BlobStore | None = None,
        scratch: Path | None = None,
        gc_grace_s: float = DEFAULT_GC_GRACE_S,
        layout: LayerFormat | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        """Open the store at ``root`` (a local directory), or over ``blobs`` (any BlobStore).

        ``scratch`` is where imports extract and build (default: the blob store's ``tmp/``,
        on the same filesystem as the blobs). A shared store may want a local scratch: the
        finished image is then copied once into the store.

        ``layout`` is the format new imports get (``single`` or ``split``, default:
        :func:`default_layout`); layers of either format are read whatever it is.
        ``chunk_size`` is the chunk of split layers (see :func:`dsec.images.ondemand.build_split`).
        """
        if blobs is None:
            blobs = LocalDirBlobStore(Path(root))
        elif Path(root) not in (DEFAULT_ROOT, blobs.root):
            raise ValueError(f"root {root} is not the root of {blobs!r}; pass only blobs=")
        self.blobs = blobs
        self.root = blobs.root
        self.blob_dir = blobs.blob_dir
        self.tmp_dir = Path(scratch) if scratch is not None else blobs.tmp_dir
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.gc_grace_s = gc_grace_s
        layout = default_layout(blobs) if layout is None else layout
        if layout not in get_args(LayerFormat):
            raise ValueError(f"layout must be one of {get_args(LayerFormat)}, not {layout!r}")
        self.layout: LayerFormat = layout
        self.chunk_size = chunk_size
        # What each blob is, by digest (content-addressed, so it never changes): a split
        # layer's SplitInfo, SINGLE, or _DATA for a split layer's data blob.
        self._kinds: dict[str, SplitInfo | str] = {}
        self.catalogue = Catalogue(blobs)
        self.migrated: dict[str, object] | None = None
        legacy = self.root / LEGACY_CATALOGUE
        if legacy.exists():
            self.migrated = migrate_sqlite(self.catalogue, legacy)

    @classmethod
    def over(
        cls,
        blobs: BlobStore,
        *,
        scratch: Path | None = None,
        gc_grace_s: float = DEFAULT_GC_GRACE_S,
        layout: LayerFormat | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> LayerStore:
        """A layer store over any blob store (e.g. a :class:`SharedMountBlobStore`)."""
        return cls(
            blobs.root,
            blobs=blobs,
            scratch=scratch,
            gc_grace_s=gc_grace_s,
            layout=layout,
            chunk_size=chunk_size,
        )

    def close(self) -> None:
        """Nothing to release (no connection, no lock); kept for the context-manager API."""

    def __enter__(self) -> LayerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- blobs -------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Where the kernel reads blob ``digest`` (for a split layer: its META; the data blob
        is at ``blob_path(split_info(digest).blob_digest)``)."""
        return self.blobs.path(digest)

    def _touch(self, digest: str) -> bool:
        for attempt in range(3):
            if self.blobs.touch(digest):
                return True
            time.sleep(0.05 * (attempt + 1))  # a collector may be putting it back
        return False

    def _pin(self, digests: Iterable[str]) -> None:
        """Refresh the blobs' stamps before a tag names them, so a collector spares them
        (a split layer's data blob with it)."""
        for d in dict.fromkeys(digests):
            if not self._touch(d):
                raise self._not_found(d)
            info = self.split_info(d)
            if info is not None and not self._touch(info.blob_digest):
                raise _data_missing(d, info.blob_digest)

    # ---- import --------------------------------------------------------------------------------

    def import_path(self, path: Path, ref: str) -> LayerInfo:
        """Import a directory or a tar archive (plain, gz, bz2, xz, zst) as layer ``ref``."""
        name, version = parse_tag(ref)  # before the expensive part
        if not path.exists():
            raise InvalidRequest(f"cannot import {path}: no such file or directory")
        work = Path(tempfile.mkdtemp(prefix="import-", dir=self.tmp_dir))
        try:
            if path.is_dir():
                src = Path(os.path.realpath(path))  # mkfs.erofs would store a symlink as such
            else:
                src = work / "rootfs"
                src.mkdir()
                extract_tar(path, src)
            if self.layout == SPLIT:
                split = build_split(src, work / "layer.meta", work / "layer.data", chunk_size=self.chunk_size)
                digest = self._put_split(split)
                built = {digest: split.meta, split.blob_digest: split.blob}
            else:
                image = work / "layer.erofs"
                build_erofs(src, image)
                digest = self.blobs.put(image).digest
                built = {digest: image}
            self.catalogue.create(name, version, [digest])
            for d, file in built.items():
                if not self.blobs.exists(d):
                    # A collector removed the (old, untagged) blob between our put and our
                    # tag; the file is still here (put links it), so store it again.
                    if not file.exists():
                        raise InfraFailure(f"layer blob {d} vanished during import; retry", reason="storage")
                    self.blobs.put(file)
        except OSError as err:
            raise InfraFailure(f"importing {path} failed: {err}", reason="storage") from err
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self._layer(digest, ref)

    def tag(self, digest: str, ref: str) -> LayerInfo:
        """Give an already stored blob another ``name:version`` (same immutability rules)."""
        name, version = parse_tag(ref)
        info = self.resolve(digest)
        self._pin([info.digest])
        self.catalogue.create(name, version, [info.digest])
        return self._layer(info.digest, ref)

    def retag(self, ref: str, target: str | Sequence[str]) -> builtins.list[LayerInfo]:
        """Move (or create) tag ``ref`` to name ``target`` explicitly; the only way a version
        ever changes content.

        ``target`` is a layer ref (``ref`` becomes a layer tag), an image's ``name:version``
        (``ref`` becomes that image), or a list of layer refs, base first (an image, or a
        layer tag if the list has one element). Returns the layers ``ref`` now stands for.
        """
        name, version = parse_tag(ref)
        kind: Kind = LAYER
        if isinstance(target, str):
            rec = self._record(target)
            if rec is not None:
                kind = rec.kind
            layers = self.resolve_image(target)
        else:
            layers = [self.resolve(t) for t in target]
            kind = LAYER if len(layers) == 1 else IMAGE
        if not layers:
            raise InvalidRequest(f"{ref} needs at least one layer")
        digests = [layer.digest for layer in layers]
        self._pin(digests)
        rec, old = self.catalogue.replace(name, version, digests, kind=kind)
        if old is not None and old.digests != rec.digests:
            log.info("retagged %s: %s -> %s", ref, list(old.digests), digests)
        return [self._layer(d, ref) for d in digests]

    def untag(self, ref: str) -> builtins.list[str]:
        """Remove tag ``ref`` (a layer or an image); returns the digests it named.

        The blobs stay until :meth:`gc` finds them named by no tag.
        """
        name, version = parse_tag(ref)
        old = self.catalogue.delete(name, version)
        if old is None:
            raise self._not_found(ref)
        return list(old.digests)

    # ---- lookup --------------------------------------------------------------------------------

    def _info(self, digest: str) -> LayerInfo | None:
        st = self.blobs.stat(digest)
        if st is None:
            return None
        try:
            kind = self._kind(digest)
        except LayerNotFound:
            return None  # removed since the stat
        if kind == _DATA:
            return None  # a split layer's data blob is not a layer
        refs = self.catalogue.referrers(digest)
        created = min((r.created_at for r in refs), default=st.mtime)
        names = [r.ref for r in refs if r.is_layer]
        return _layer_info(digest, st.size, kind, names, created)

    def _layer(self, digest: str, ref: str) -> LayerInfo:
        info = self._info(digest)
        if info is None:
            raise InfraFailure(
                f"catalogue tags {ref} with blob {digest}, which is not stored", reason="storage"
            )
        return info

    def _not_found(self, ref: str, extra: str = "") -> LayerNotFound:
        return LayerNotFound(f"no layer {ref!r}{extra}; {_LS_HINT}")

    def resolve(self, ref: str) -> LayerInfo:
        """Find a layer by ``name:version``, ``sha256:<hex>``, or a unique hex prefix (>= 12)."""
        hexpart = ref.removeprefix("sha256:").lower()
        if HEX_PREFIX_RE.match(hexpart) and (hexpart != ref or ":" not in ref):
            return self._by_prefix(ref, hexpart)
        if ref.startswith("sha256:"):
            digest_hex(ref)  # raises: a malformed digest is a bad request, not a missing layer
        if ":" in ref:
            return self._by_tag(ref)
        versions = self.catalogue.versions(ref) if is_tag(f"{ref}:x") else []
        if versions:
            known = ", ".join(f"{ref}:{v}" for v in versions)
            raise self._not_found(ref, f" (a version is required: {known})")
        raise LayerNotFound(f"no layer {ref!r}: a layer reference is {REF_FORMS}; {_LS_HINT}")

    def _by_prefix(self, ref: str, hexpart: str) -> LayerInfo:
        if len(hexpart) == 64:
            info = self._info(f"sha256:{hexpart}")
        else:
            matches = [d for d in self.blobs.list_digests() if d[7:].startswith(hexpart)]
            if len(matches) > 1:
                data = self._data_digests()
                matches = [d for d in matches if d not in data]
            if len(matches) > 1:
                raise InvalidRequest(f"layer prefix {ref!r} is ambiguous; give more characters")
            info = self._info(matches[0]) if matches else None
        if info is None:
            raise self._not_found(ref)
        return info

    def _by_tag(self, ref: str) -> LayerInfo:
        name, version = parse_tag(ref)
        rec = self.catalogue.get(name, version)
        if rec is not None:
            if not rec.is_layer:
                raise LayerNotFound(
                    f"no layer {ref!r}: it names an image of {len(rec.digests)} layers (use it as an "
                    f"image, or one of its layers); {_LS_HINT}"
                )
            return self._layer(rec.digests[0], ref)
        versions = self.catalogue.versions(name)
        extra = f" (known versions of {name}: {', '.join(versions)})" if versions else ""
        raise self._not_found(ref, extra)

    def verify(self, ref: str) -> LayerInfo:
        """Re-hash a layer's blobs (a split layer's META and data): InfraFailure(reason=
        "corrupt") if their bytes changed, reason="storage" if a data blob is missing."""
        info = self.resolve(ref)
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
                    reason="corrupt",
                )
            self.blobs.verify(split.blob_digest)
        return info

    # ---- images: ordered lists of layers under one name:version ------------------------------

    def tag_image(self, ref: str, digests: builtins.list[str]) -> builtins.list[LayerInfo]:
        """Name an ordered list of stored layers (base first) ``name:version``; immutable."""
        name, version = parse_tag(ref)
        layers = [self.resolve(d) for d in digests]
        if not layers:
            raise InvalidRequest(f"image {ref} needs at least one layer")
        self._pin(layer.digest for layer in layers)
        self.catalogue.create(name, version, [layer.digest for layer in layers], kind=IMAGE)
        return layers

    def resolve_image(self, ref: str) -> builtins.list[LayerInfo]:
        """The layers (base first) that ``ref`` stands for: an image's list, or one layer."""
        rec = self._record(ref)
        if rec is not None:
            return [self._layer(d, ref) for d in rec.digests]
        return [self.resolve(ref)]

    def _record(self, ref: str) -> TagRecord | None:
        """The tag record ``ref`` names, if ``ref`` is a ``name:version`` (not a digest)."""
        if ":" in ref and not ref.startswith("sha256:"):
            name, version = parse_tag(ref)
            return self.catalogue.get(name, version)
        return None

    def has_tag(self, ref: str) -> bool:
        """Whether ``ref`` names a layer (an image's name is not a layer tag)."""
        name, version = parse_tag(ref)
        rec = self.catalogue.get(name, version)
        return rec is not None and rec.is_layer

    def has_image(self, ref: str) -> bool:
        """Whether ``ref`` names an image (an ordered list of layers made by ``tag_image``)."""
        name, version = parse_tag(ref)
        rec = self.catalogue.get(name, version)
        return rec is not None and not rec.is_layer

    def tags(self) -> builtins.list[TagRecord]:
        """Every tag, layers and images, by name and version."""
        return self.catalogue.records()

    def list(self) -> builtins.list[LayerInfo]:
        """Every stored layer, oldest first, with all its tags (untagged ones await gc)."""
        names: dict[str, builtins.list[str]] = {}
        first: dict[str, float] = {}
        for rec in self.catalogue.records():  # sorted by name, then version
            for d in rec.digests:
                first[d] = min(first.get(d, rec.created_at), rec.created_at)
            if rec.is_layer:
                names.setdefault(rec.digests[0], []).append(rec.ref)
        out = []
        data = self._data_digests()
        for d in self.blobs.list_digests():
            if d in data:
                continue
            st = self.blobs.stat(d)
            if st is None:
                continue
            try:
                kind = self._kind(d)
            except LayerNotFound:
                continue  # removed since the listing
            if kind != _DATA:
                out.append(_layer_info(d, st.size, kind, names.get(d, []), first.get(d, st.mtime)))
        return sorted(out, key=lambda i: (i.created_at, i.digest))
