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
import contextlib
import logging
import os
import shutil
import tempfile
import threading
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
from dsec.images.catalogue import IMAGE, LAYER, LEGACY_OWNER, Catalogue, Kind, TagRecord, migrate_sqlite
from dsec.images.ondemand import DEFAULT_CHUNK_SIZE, SplitInfo
from dsec.images.owners import Viewer, _Ownership
from dsec.images.refs import HEX_PREFIX_RE, REF_FORMS, digest_hex, is_tag, parse_tag
from dsec.images.sanitize import stripped_tree
from dsec.images.storage_quota import _StorageQuota
from dsec.images.tarextract import extract_tar
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, LayerNotFound, TooLarge
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


class LayerStore(_SplitLayers, _GarbageCollection, _Ownership, _StorageQuota):
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
        self._quota_lock = threading.Lock()  # one storage-quota charge at a time (storage_quota)
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

    def import_path(
        self,
        path: Path,
        ref: str,
        *,
        owner: str = LEGACY_OWNER,
        viewer: Viewer | None = None,
        max_bytes: int | None = None,
        payer: str | None = None,
        network: Sequence[str] = (),
    ) -> LayerInfo:
        """Import a directory or a tar archive (plain, gz, bz2, xz, zst) as layer ``ref``,
        owned by project ``owner``; ``viewer`` is the caller's (may it use that name?).

        Device nodes and file capabilities are stripped (:mod:`dsec.images.sanitize`); a
        directory is changed in place (names unlinked, shared inodes copied first). A tar
        archive that expands past ``max_bytes`` stops with ``TooLarge``, nothing kept; one
        that does not fit ``owner``'s storage quota (:mod:`dsec.images.storage_quota`) with
        ``QuotaExceeded``, also nothing kept. ``payer``: another project that brings the
        content and is charged and recorded as an owner too (an OCI import's layer cache).
        ``network``: the permissions the sandbox or build that made it held (on its tag).
        """
        name, version = self.check_name(ref, viewer)  # before the expensive part
        if not path.exists():
            raise InvalidRequest(f"cannot import {path}: no such file or directory")
        work = Path(tempfile.mkdtemp(prefix="import-", dir=self.tmp_dir))
        try:
            held = contextlib.ExitStack()
            if path.is_dir():
                src = Path(os.path.realpath(path))  # mkfs.erofs would store a symlink as such
                held.enter_context(stripped_tree(src))
            else:
                src = work / "rootfs"
                src.mkdir()
                # A bomb stops at the owner's storage quota, not only at the import cap.
                bound = self.expansion_bound(payer or owner)
                if bound is not None and (max_bytes is None or bound[1] < max_bytes):
                    try:
                        extract_tar(path, src, max_bytes=bound[1])
                    except TooLarge as err:
                        raise self.past_bound(bound, "this archive") from err
                else:
                    extract_tar(path, src, max_bytes=max_bytes)
            with held:
                digest, built = self._store_tree(src, work, owner, payer)  # charged (storage_quota)
            rec, _ = self.catalogue.create(name, version, [digest], owner=owner, network=network)
            self.check_taken(rec, viewer)
            for d, file in built.items():
                if not self.blobs.exists(d):
                    # A collector removed the (old, untagged) blob between our put and our
                    # tag; the file is still here (put links it), so store it again.
                    if not file.exists():
                        raise InfraFailure(
                            f"layer blob {d} vanished during import; retry", reason=InfraReason.storage
                        )
                    self.blobs.put(file)
        except OSError as err:
            raise InfraFailure(f"importing {path} failed: {err}", reason=InfraReason.storage) from err
        finally:
            shutil.rmtree(work, ignore_errors=True)
        # The names the caller may see: the same bytes may carry another project's tags.
        return self._layer(digest, ref, viewer)

    def tag(
        self, digest: str, ref: str, *, owner: str = LEGACY_OWNER, viewer: Viewer | None = None
    ) -> LayerInfo:
        """Give an already stored blob another ``name:version`` (same immutability rules)."""
        name, version = self.check_name(ref, viewer)
        info = self.resolve(digest, viewer=viewer)
        self._pin([info.digest])
        rec, _ = self.catalogue.create(name, version, [info.digest], owner=owner)
        self.check_taken(rec, viewer)
        return self._layer(info.digest, ref, viewer)

    def retag(
        self,
        ref: str,
        target: str | Sequence[str],
        *,
        owner: str = LEGACY_OWNER,
        viewer: Viewer | None = None,
    ) -> builtins.list[LayerInfo]:
        """Move (or create) tag ``ref`` to name ``target`` explicitly; the only way a version
        ever changes content.

        ``target`` is a layer ref (``ref`` becomes a layer tag), an image's ``name:version``
        (``ref`` becomes that image), or a list of layer refs, base first (an image, or a
        layer tag if the list has one element). Returns the layers ``ref`` now stands for.
        A tag that exists keeps its owner and public mark; a new one is ``owner``'s.
        """
        name, version = self.check_name(ref, viewer)
        kind: Kind = LAYER
        if isinstance(target, str):
            rec = self._record(target)
            if rec is not None:
                kind = rec.kind
            layers = self.resolve_image(target, viewer=viewer)
        else:
            layers = [self.resolve(t, viewer=viewer) for t in target]
            kind = LAYER if len(layers) == 1 else IMAGE
        if not layers:
            raise InvalidRequest(f"{ref} needs at least one layer")
        digests = [layer.digest for layer in layers]
        self._pin(digests)
        current = self.catalogue.get(name, version)
        if current is not None:
            owner = current.owner
        public = current is not None and current.public
        rec, old = self.catalogue.replace(name, version, digests, kind=kind, owner=owner, public=public)
        if old is not None and old.digests != rec.digests:
            log.info("retagged %s: %s -> %s", ref, list(old.digests), digests)
        return [self._layer(d, ref, viewer) for d in digests]

    def untag(self, ref: str, *, viewer: Viewer | None = None) -> builtins.list[str]:
        """Remove tag ``ref`` (a layer or an image); returns the digests it named.

        The blobs stay until :meth:`gc` finds them named by no tag. Only the owner's subtree
        may remove a tag (a public one too): for anyone else it does not exist.
        """
        name, version = parse_tag(ref)
        rec = self.catalogue.get(name, version)
        if rec is not None and viewer is not None and not viewer(rec.owner):
            raise self._not_found(ref)
        old = self.catalogue.delete(name, version)
        if old is None:
            raise self._not_found(ref)
        return list(old.digests)

    # ---- lookup --------------------------------------------------------------------------------

    def _info(self, digest: str, viewer: Viewer | None = None) -> LayerInfo | None:
        st = self.blobs.stat(digest)
        if st is None:
            return None
        try:
            kind = self._kind(digest)
        except LayerNotFound:
            return None  # removed since the stat
        if kind == _DATA:
            return None  # a split layer's data blob is not a layer
        refs = [r for r in self.catalogue.referrers(digest) if self.sees_tag(r, viewer)]
        created = min((r.created_at for r in refs), default=st.mtime)
        names = [r.ref for r in refs if r.is_layer]
        info = _layer_info(digest, st.size, kind, names, created)
        network = sorted({n for r in refs if r.is_layer for n in r.network})
        return info.model_copy(update={"network": network}) if network else info

    def _layer(self, digest: str, ref: str, viewer: Viewer | None = None) -> LayerInfo:
        info = self._info(digest, viewer)
        if info is None:
            raise InfraFailure(
                f"catalogue tags {ref} with blob {digest}, which is not stored", reason=InfraReason.storage
            )
        return info

    def _not_found(self, ref: str, extra: str = "") -> LayerNotFound:
        return LayerNotFound(f"no layer {ref!r}{extra}; {_LS_HINT}")

    def resolve(self, ref: str, *, viewer: Viewer | None = None) -> LayerInfo:
        """Find a layer by ``name:version``, ``sha256:<hex>``, or a unique hex prefix (>= 12),
        among those ``viewer`` may see (:mod:`dsec.images.owners`)."""
        hexpart = ref.removeprefix("sha256:").lower()
        if HEX_PREFIX_RE.match(hexpart) and (hexpart != ref or ":" not in ref):
            return self._by_prefix(ref, hexpart, viewer)
        if ref.startswith("sha256:"):
            digest_hex(ref)  # raises: a malformed digest is a bad request, not a missing layer
        if ":" in ref:
            return self._by_tag(ref, viewer)
        versions = self._visible_versions(ref, viewer) if is_tag(f"{ref}:x") else []
        if versions:
            known = ", ".join(f"{ref}:{v}" for v in versions)
            raise self._not_found(ref, f" (a version is required: {known})")
        raise LayerNotFound(f"no layer {ref!r}: a layer reference is {REF_FORMS}; {_LS_HINT}")

    def _by_prefix(self, ref: str, hexpart: str, viewer: Viewer | None = None) -> LayerInfo:
        if len(hexpart) == 64:
            digest = f"sha256:{hexpart}"
            info = self._info(digest, viewer) if self.sees_blob(digest, viewer) else None
        else:
            matches = [
                d
                for d in self.blobs.list_digests()
                if d[7:].startswith(hexpart) and self.sees_blob(d, viewer)
            ]
            if len(matches) > 1:
                data = self._data_digests()
                matches = [d for d in matches if d not in data]
            if len(matches) > 1:
                raise InvalidRequest(f"layer prefix {ref!r} is ambiguous; give more characters")
            info = self._info(matches[0], viewer) if matches else None
        if info is None:
            raise self._not_found(ref)
        return info

    def _by_tag(self, ref: str, viewer: Viewer | None = None) -> LayerInfo:
        name, version = parse_tag(ref)
        rec = self.catalogue.get(name, version)
        if rec is not None and not self.sees_tag(rec, viewer):
            rec = None
        if rec is not None:
            if not rec.is_layer:
                raise LayerNotFound(
                    f"no layer {ref!r}: it names an image of {len(rec.digests)} layers (use it as an "
                    f"image, or one of its layers); {_LS_HINT}"
                )
            return self._layer(rec.digests[0], ref, viewer)
        versions = self._visible_versions(name, viewer)
        extra = f" (known versions of {name}: {', '.join(versions)})" if versions else ""
        raise self._not_found(ref, extra)

    # ---- images: ordered lists of layers under one name:version ------------------------------

    def tag_image(
        self,
        ref: str,
        digests: builtins.list[str],
        *,
        owner: str = LEGACY_OWNER,
        viewer: Viewer | None = None,
    ) -> builtins.list[LayerInfo]:
        """Name an ordered list of stored layers (base first) ``name:version``; immutable."""
        name, version = self.check_name(ref, viewer)
        layers = [self.resolve(d, viewer=viewer) for d in digests]
        if not layers:
            raise InvalidRequest(f"image {ref} needs at least one layer")
        self._pin(layer.digest for layer in layers)
        rec, _ = self.catalogue.create(
            name, version, [layer.digest for layer in layers], kind=IMAGE, owner=owner
        )
        self.check_taken(rec, viewer)
        return layers

    def resolve_image(self, ref: str, *, viewer: Viewer | None = None) -> builtins.list[LayerInfo]:
        """The layers (base first) that ``ref`` stands for: an image's list, or one layer."""
        rec = self._record(ref)
        if rec is not None and self.sees_tag(rec, viewer):
            return [self._layer(d, ref, viewer) for d in rec.digests]
        return [self.resolve(ref, viewer=viewer)]

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

    def list(self, *, viewer: Viewer | None = None) -> builtins.list[LayerInfo]:
        """Every stored layer ``viewer`` may see, oldest first, with the tags it may see
        (untagged ones await gc)."""
        names: dict[str, builtins.list[str]] = {}
        first: dict[str, float] = {}
        reachable: set[str] = set()  # named by a tag the viewer sees
        network: dict[str, set[str]] = {}  # the permissions its tags recorded
        for rec in self.catalogue.records():  # sorted by name, then version
            if not self.sees_tag(rec, viewer):
                continue
            reachable.update(rec.digests)
            for d in rec.digests:
                first[d] = min(first.get(d, rec.created_at), rec.created_at)
            if rec.is_layer:
                names.setdefault(rec.digests[0], []).append(rec.ref)
                network.setdefault(rec.digests[0], set()).update(rec.network)
        out = []
        data = self._data_digests()
        for d in self.blobs.list_digests():
            if d in data or (d not in reachable and not self.sees_blob(d, viewer)):
                continue
            st = self.blobs.stat(d)
            if st is None:
                continue
            try:
                kind = self._kind(d)
            except LayerNotFound:
                continue  # removed since the listing
            if kind != _DATA:
                info = _layer_info(d, st.size, kind, names.get(d, []), first.get(d, st.mtime))
                held = sorted(network.get(d, ()))
                out.append(info.model_copy(update={"network": held}) if held else info)
        return sorted(out, key=lambda i: (i.created_at, i.digest))
