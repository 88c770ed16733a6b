"""The layer store in both formats: ``single`` (one EROFS image) and ``split`` (META + data blob).

Real mkfs.erofs, no mounts (those are in test_mounts_split.py): what is stored, how it is
listed and resolved, what gc keeps, and what ``verify`` catches.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from dsec.images.blobstore import FakeBlobStore, LocalDirBlobStore, SharedMountBlobStore
from dsec.images.ondemand import read_split_info
from dsec.images.store import SPLIT_DATA, LayerStore, default_layout
from dsec.protocol.errors import InfraFailure, LayerNotFound
from dsec.protocol.models import LayerInfo
from tests.support import flip_byte

from .conftest import make_tree


def shared_store(root: Path, **kw: object) -> LayerStore:
    """A store over a shared mount (a plain directory stands in for NFS/3FS here)."""
    root.mkdir(parents=True, exist_ok=True)
    return LayerStore.over(SharedMountBlobStore(root, create=True), **kw)  # type: ignore[arg-type]


def tree(tmp_path: Path, name: str, seed: str | None = None) -> Path:
    """make_tree plus 128 KiB of data that depends on ``seed`` (default: the name)."""
    src = make_tree(tmp_path / name)
    (src / "data.bin").write_bytes(hashlib.sha256((seed or name).encode()).digest() * 4096)
    os.utime(src / "data.bin", ns=(0, 1_600_000_000 * 10**9))
    os.utime(src, ns=(0, 1_700_000_000 * 10**9))  # same tree, same bytes
    return src


def age(store: LayerStore, digest: str, seconds: float = 3600.0) -> None:
    past = time.time() - seconds
    os.utime(store.blob_path(digest), (past, past))


def test_layout_defaults_by_blob_store(tmp_path: Path) -> None:
    assert LayerStore(tmp_path / "local").layout == "single"
    assert shared_store(tmp_path / "shared").layout == "split"
    assert LayerStore.over(FakeBlobStore(tmp_path / "fake")).layout == "single"
    assert default_layout(LocalDirBlobStore(tmp_path / "local")) == "single"
    assert LayerStore(tmp_path / "local", layout="split").layout == "split"
    assert shared_store(tmp_path / "shared", layout="single").layout == "single"
    with pytest.raises(ValueError, match="layout"):
        LayerStore(tmp_path / "local", layout="zip")  # type: ignore[arg-type]


def test_split_layer_is_two_blobs_named_by_meta(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    info = store.import_path(tree(tmp_path, "src"), "base:1")
    split = store.split_info(info.digest)
    assert split is not None
    assert info.format == "split" and info.data_digest == split.blob_digest
    assert store.layer_format(info.digest) == "split"
    assert store.layer_blobs(info.digest) == [info.digest, split.blob_digest]
    assert store.blobs.list_digests() == sorted([info.digest, split.blob_digest])
    meta = store.blob_path(info.digest)
    assert read_split_info(meta) == split  # META names its data blob ...
    data = store.blob_path(split.blob_digest)
    assert hashlib.sha256(data.read_bytes()).hexdigest() == split.blob_digest[7:]  # ... by content
    assert info.size == meta.stat().st_size + data.stat().st_size == meta.stat().st_size + split.blob_size
    assert meta.stat().st_size < 64 * 1024 < split.blob_size
    # The data blob is no layer: not listed, not resolvable, even by a unique prefix.
    assert store.list() == [info]
    for ref in (split.blob_digest, split.blob_digest[7:], split.blob_digest[7:19]):
        with pytest.raises(LayerNotFound):
            store.resolve(ref)
    assert store.resolve("base:1") == info == store.resolve(info.digest[7:19])
    # Another node (a fresh process) reads the format from META itself.
    other = LayerStore.over(SharedMountBlobStore(tmp_path / "shared"))
    assert other.resolve("base:1") == info and other.list() == [info]


def test_same_tree_is_stored_once_and_wire_model_round_trips(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    a = store.import_path(tree(tmp_path, "a"), "a:1")
    b = store.import_path(tree(tmp_path, "a-again", seed="a"), "a:2")
    assert (a.digest, a.data_digest) == (b.digest, b.data_digest)  # deterministic META and data
    assert len(store.blobs.list_digests()) == 2
    info = store.resolve("a:1")
    assert info.names == ["a:1", "a:2"] and LayerInfo.model_validate_json(info.model_dump_json()) == info
    old_client = LayerInfo.model_validate({"digest": a.digest, "size": 1, "created_at": 0.0})
    assert old_client.format is None and old_client.data_digest is None  # optional on the wire


def test_both_formats_side_by_side(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    single = shared_store(root, layout="single")
    s = single.import_path(tree(tmp_path, "one"), "one:1")
    split_store = LayerStore.over(SharedMountBlobStore(root))  # the split default
    p = split_store.import_path(tree(tmp_path, "two"), "two:1")
    assert (s.format, s.data_digest) == ("single", None)
    assert single.layer_format(s.digest) == "single" and single.layer_blobs(s.digest) == [s.digest]
    assert p.format == "split"
    for store in (single, split_store, LayerStore.over(SharedMountBlobStore(root))):
        assert [i.digest for i in store.list()] == sorted([s.digest, p.digest], key=lambda d: d != s.digest)
        assert store.resolve("one:1").format == "single" and store.resolve("two:1").format == "split"
        assert len(store.blobs.list_digests()) == 3
    # An image may mix them.
    split_store.tag_image("env:1", ["one:1", "two:1"])
    assert [i.format for i in single.resolve_image("env:1")] == ["single", "split"]


def test_split_layout_over_a_local_dir_and_the_fake(tmp_path: Path) -> None:
    for store in (
        LayerStore(tmp_path / "local", layout="split"),
        LayerStore.over(FakeBlobStore(tmp_path / "fake"), layout="split"),
    ):
        info = store.import_path(tree(tmp_path, f"src-{len(os.listdir(tmp_path))}"), "x:1")
        assert info.format == "split" and store.list() == [info]
        assert info.data_digest is not None and store.blobs.exists(info.data_digest)
        store.verify("x:1")


def test_gc_keeps_the_data_blob_of_every_kept_split_layer(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    kept = store.import_path(tree(tmp_path, "kept"), "kept:1")
    gone = store.import_path(tree(tmp_path, "gone"), "gone:1")
    used = store.import_path(tree(tmp_path, "used"), "used:1")
    # Same file data, other metadata: a second META over the very same data blob.
    src = tree(tmp_path, "sibling", seed="kept")
    os.chmod(src / "etc/hostname", 0o600)
    sibling = store.import_path(src, "sibling:1")
    assert sibling.digest != kept.digest and sibling.data_digest == kept.data_digest
    for ref in ("gone:1", "used:1", "sibling:1"):
        store.untag(ref)
    for d in store.blobs.list_digests():
        age(store, d)
    removed = store.gc({used.digest})
    assert removed == sorted([gone.digest, str(gone.data_digest), sibling.digest])
    # kept:1 keeps the data blob it shares with the sibling; used:1 is in use on a node
    assert set(store.blobs.list_digests()) == {kept.digest, kept.data_digest, used.digest, used.data_digest}
    store.verify("kept:1")
    # The marker of the data blob that is gone is gone; the others stay.
    markers = {tuple(m.split("/")[1:]) for m in store.blobs.list_records(SPLIT_DATA)}
    assert (str(gone.data_digest)[7:], gone.digest[7:]) not in markers
    assert {(str(i.data_digest)[7:], i.digest[7:]) for i in (kept, used)} <= markers
    assert store.gc(set(), grace_s=0) == sorted([used.digest, str(used.data_digest)])  # no longer used
    assert [i.digest for i in store.list()] == [kept.digest]


def test_gc_spares_a_young_split_import_and_its_data(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    info = store.import_path(tree(tmp_path, "young"), "young:1")
    store.untag("young:1")
    assert store.gc(set()) == []  # put within the grace period: an importer may be about to tag it
    assert store.blobs.exists(info.digest) and info.data_digest and store.blobs.exists(info.data_digest)
    age(store, info.digest)  # META old, data young: META goes, then its data once old
    assert store.gc(set()) == [info.digest]
    age(store, info.data_digest)
    assert store.gc(set()) == [info.data_digest]
    assert store.blobs.list_records(SPLIT_DATA) == []


def test_tag_refreshes_the_data_blob_too(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    info = store.import_path(tree(tmp_path, "src"), "a:1")
    assert info.data_digest is not None
    age(store, info.digest)
    age(store, info.data_digest)
    store.tag(info.digest, "b:1")
    for d in (info.digest, info.data_digest):
        assert time.time() - store.blob_path(d).stat().st_mtime < 60, d


def test_verify_hashes_meta_and_data(tmp_path: Path) -> None:
    store = shared_store(tmp_path / "shared")
    info = store.import_path(tree(tmp_path, "src"), "a:1")
    assert store.verify("a:1") == info
    assert info.data_digest is not None
    data = store.blob_path(info.data_digest)
    flip_byte(data, data.stat().st_size // 2)
    with pytest.raises(InfraFailure) as exc:
        store.verify("a:1")
    assert exc.value.reason == "corrupt"
    flip_byte(data, data.stat().st_size // 2)  # back
    store.verify("a:1")
    os.chmod(data, 0o644)
    os.truncate(data, data.stat().st_size - 4096)
    with pytest.raises(InfraFailure, match="expects") as exc:
        store.verify("a:1")
    assert exc.value.reason == "corrupt"
    data.unlink()
    with pytest.raises(InfraFailure, match="not stored") as exc:
        store.verify("a:1")
    assert exc.value.reason == "storage"
