"""The import pipeline: verify every blob, then turn each layer into an EROFS layer and tag the image."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dsec.images.catalogue import LEGACY_OWNER
from dsec.images.merge import merge_layers
from dsec.images.oci.archive import _open_source, _Source
from dsec.images.oci.compression import _decompressed, _hash_reader, _sniff
from dsec.images.oci.manifest import Platform, _LayerPlan, _plan
from dsec.images.oci.validation import _sha256_hex
from dsec.images.owners import Viewer
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.images.tarextract import extract_tar
from dsec.images.whiteouts import oci_to_overlay
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, TooLarge
from dsec.protocol.models import LayerInfo

Progress = Callable[[str, int, int], None]

log = logging.getLogger("dsec.images.oci")
LAYER_NAME = "dsec/oci-layer"  # bump (oci-layer2) if the conversion of a layer ever changes
DEFAULT_PLATFORM = "linux/amd64"


# ---- the import ---------------------------------------------------------------------------------


def _corrupted(plan: _LayerPlan, kind: str, expected: str, actual: str) -> InvalidRequest:
    return InvalidRequest(f"{plan.what} is corrupted: {kind} mismatch (expected {expected}, found {actual})")


def _verify_blob(src: _Source, plan: _LayerPlan) -> str:
    """Hash the blob as stored; returns its compression. Raises on a digest or size mismatch."""
    reader, size = src.open(plan.path, plan.what)
    with reader:
        if plan.size is not None and size != plan.size:
            raise _corrupted(plan, "size", f"{plan.size} bytes", f"{size} bytes")
        kind = _sniff(reader.peek(8)[:8])
        digest, n = _hash_reader(reader)
    if n != size:
        raise _corrupted(plan, "size", f"{size} bytes", f"{n} bytes")
    if plan.digest is not None and digest != plan.digest:
        raise _corrupted(plan, "digest", plan.digest, digest)
    if kind == "tar" and digest != plan.diff_id:  # an uncompressed blob is its own diff
        raise _corrupted(plan, "digest", plan.diff_id, digest)
    return kind


def _layer_tar(
    src: _Source, plan: _LayerPlan, kind: str, work: Path, max_bytes: int | None = None
) -> tuple[Path, bool]:
    """The layer as a plain tar file on disk, its content checked against the diff_id.

    Returns (path, whether it is a temporary copy to delete). ``TooLarge`` as soon as the
    decompressed bytes pass ``max_bytes`` (the partial copy removed).
    """
    if kind == "tar":
        real = src.real_path(plan.path, plan.what)
        if real is not None:
            return real, False  # verified by _verify_blob already
    out = work / "layer.tar"
    h = hashlib.sha256()
    reader, _size = src.open(plan.path, plan.what)
    written = 0
    with reader, open(out, "xb") as dst:
        for chunk in _decompressed(reader, kind, plan.what):
            written += len(chunk)
            if max_bytes is not None and written > max_bytes:
                dst.close()
                out.unlink()
                raise TooLarge(f"{plan.what} expands to more than {max_bytes} bytes (the import cap)")
            h.update(chunk)
            dst.write(chunk)
    actual = f"sha256:{h.hexdigest()}"
    if actual != plan.diff_id:
        out.unlink()
        raise _corrupted(plan, "content (diff_id) digest", plan.diff_id, actual)
    return out, True


def _store_layer(store: LayerStore, rootfs: Path, tag: str, payer: str) -> tuple[LayerInfo, bool]:
    """The layer under cache tag ``tag``, and whether this call made that tag."""
    # The cache tag is the store's; the importer pays for the bytes (QuotaExceeded before any
    # blob is stored) and is recorded as an owner.
    try:
        return store.import_path(rootfs, tag, payer=payer), True
    except InvalidRequest:
        # Someone imported the same layer meanwhile (with an equal image unless their
        # mkfs.erofs differs); theirs serves as well.
        if store.has_tag(tag):
            return store.resolve(tag), False
        raise


class _Undo:
    """What one import added to the store, to take back if the import fails part-way: an image
    is imported whole or not at all (its earlier layers neither cached nor charged)."""

    def __init__(self, store: LayerStore, owner: str) -> None:
        self.store, self.owner = store, owner
        self.tags: list[tuple[str, str]] = []  # (cache tag, digest) this import created
        self.claims: list[str] = []  # digests this import made ``owner`` an owner of

    def claim(self, digests: list[str]) -> None:
        new = [d for d in dict.fromkeys(digests) if self.owner not in self.store.catalogue.owners(d)]
        self.store.claim_charged(digests, self.owner)
        self.claims += new

    def run(self) -> None:
        cat = self.store.catalogue
        for digest in self.claims:
            cat.remove_owner(digest, self.owner)
        for tag, digest in reversed(self.tags):
            name, version = parse_tag(tag)
            rec = cat.get(name, version)
            if rec is None or list(rec.digests) != [digest]:
                continue
            if any(r.ref != tag for r in cat.referrers(digest)):
                continue  # other tags name the same bytes: the layer stays, and the cache serves it
            cat.delete(name, version)
            if cat.referrers(digest):
                continue  # named meanwhile
            # Nothing names it: its owner records (the importer's charge) and the blob go. A
            # sandbox that mounted it meanwhile keeps its open file; gc takes a split layer's data.
            for project in cat.owners(digest):
                cat.remove_owner(digest, project)
            self.store.blobs.delete(digest)
        log.info("import rolled back: %d cached layers, %d owner claims", len(self.tags), len(self.claims))


def drop_shadowed_duplicates(digests: list[str]) -> list[str]:
    """Keep only the upper-most copy of a layer that occurs twice in a stack (base first).

    Overlayfs refuses one directory twice among its lower layers (ELOOP, "overlapping
    layers"), and images do repeat layers (identical empty layers are common). Dropping the
    lower copy changes nothing: every entry of it is also in the upper copy, which takes
    precedence over it and over whatever lies between, and the upper copy's whiteouts and
    opaque directories hide at least what the lower copy's did.
    """
    seen: set[str] = set()
    kept = []
    for digest in reversed(digests):
        if digest not in seen:
            seen.add(digest)
            kept.append(digest)
    return kept[::-1]


def import_oci(
    store: LayerStore,
    path: Path,
    ref: str,
    *,
    merge_below_bytes: int = 0,
    progress: Progress | None = None,
    image: str | None = None,
    platform: str = DEFAULT_PLATFORM,
    owner: str = LEGACY_OWNER,
    viewer: Viewer | None = None,
    max_bytes: int | None = None,
) -> list[LayerInfo]:
    """Import a ``docker save`` archive or an OCI image layout as the image ``ref``.

    ``ref`` (``name:version``) names the ordered list of layers, base first, as
    :meth:`LayerStore.tag_image` does; returns that list. ``image`` picks one image from an
    archive holding several; ``platform`` (os/arch[/variant]) picks from a multi-platform
    index. With ``merge_below_bytes`` > 0, runs of consecutive layers whose EROFS images are
    each smaller than that are merged into one (:func:`dsec.images.merge.merge_layers`).

    ``progress(stage, done, total)`` is called as each layer goes through its stages, with
    ``stage`` like ``"layer 2/5 verify"``, ``"layer 2/5 extract"``, ``"layer 2/5 mkfs"``,
    ``"layer 2/5 cached"``, then merge stages and ``"tag"``; ``done``/``total`` count layers
    (merge stages count runs).

    The image and its layers are ``owner``'s (``viewer``: may the caller use the name ``ref``);
    each layer's content is capped at ``max_bytes`` once decompressed (``TooLarge``). The
    per-layer tags (``oci-layer:<diff_id>``) are the store's shared cache, not the caller's:
    an importer that brings a cached layer's content is recorded as one of its owners.
    """
    store.check_name(ref, viewer)  # before any work
    # A layer that expands past the owner's storage quota stops there (storage_quota).
    bound = store.expansion_bound(owner)
    tight = bound if bound is not None and (max_bytes is None or bound[1] < max_bytes) else None
    if tight is not None:
        max_bytes = tight[1]
    if store.has_tag(ref):
        raise InvalidRequest(f"{ref} already names a layer and versions are immutable; choose another")
    wanted = Platform.parse(platform)
    if not path.exists():
        raise InvalidRequest(f"cannot import {path}: no such file or directory")

    def report(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    work = Path(tempfile.mkdtemp(prefix="oci-", dir=store.tmp_dir))
    undo = _Undo(store, owner)
    done = False
    try:
        with _open_source(path, work) as src:
            plans = _plan(src, image, wanted)
            n = len(plans)
            # Every blob first: a corrupted archive must not leave half an image behind.
            kinds = []
            for i, plan in enumerate(plans):
                report(f"layer {i + 1}/{n} verify", i, n)
                kinds.append(_verify_blob(src, plan))
            digests = []
            for i, (plan, kind) in enumerate(zip(plans, kinds, strict=True)):
                stage = f"layer {i + 1}/{n}"
                tag = f"{LAYER_NAME}:{_sha256_hex(plan.diff_id)}"
                if store.has_tag(tag):
                    report(f"{stage} cached", i, n)
                    digests.append(store.resolve(tag).digest)
                    undo.claim(digests[-1:])  # it brought these bytes: it may use them
                    continue
                report(f"{stage} {'extract' if kind == 'tar' else 'decompress'}", i, n)
                tar, temporary = _layer_tar(src, plan, kind, work, max_bytes)
                if kind != "tar":
                    report(f"{stage} extract", i, n)
                rootfs = work / "rootfs"
                rootfs.mkdir()
                try:
                    extract_tar(tar, rootfs, max_bytes=max_bytes)
                    oci_to_overlay(rootfs)
                except InvalidRequest as err:
                    raise type(err)(f"{plan.what}: {err.message}") from err
                finally:
                    if temporary:
                        tar.unlink()
                report(f"{stage} mkfs", i, n)
                layer, created = _store_layer(store, rootfs, tag, owner)
                if created:
                    undo.tags.append((tag, layer.digest))
                else:
                    undo.claim([layer.digest])
                digests.append(layer.digest)
                shutil.rmtree(rootfs)
            report("layers imported", n, n)
        digests = drop_shadowed_duplicates(digests)
        if merge_below_bytes > 0:
            digests = merge_layers(store, digests, merge_below_bytes, progress=progress)
            store.claim_charged(digests, owner)
        report("tag", len(digests), len(digests))
        layers = store.tag_image(ref, digests, owner=owner, viewer=viewer)
        done = True
        return layers
    except TooLarge as err:
        if tight is not None:
            raise store.past_bound(tight, "a layer of this image") from err
        raise
    except OSError as err:
        raise InfraFailure(f"importing {path} failed: {err}", reason=InfraReason.storage) from err
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not done:
            try:
                undo.run()
            except Exception as err:  # the import's own error is the answer; gc takes what is left
                log.warning("rolling back the import of %s left some of it for gc: %s", ref, err)
