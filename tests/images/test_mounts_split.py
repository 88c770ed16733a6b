"""LayerMounts over a store of both formats: split layers mount from a local META copy with the
data blob read in place; corrupted blobs are refused and never mounted.

Real mkfs.erofs, real mounts (root). The "shared" store is a directory opened as a
:class:`SharedMountBlobStore`; what is read from its data blob is observed through the blob's
page cache, as in test_ondemand.py.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.mount import find_mount, is_mountpoint, umount
from dsec.images.mounts import LayerMounts, mount_stored_layer
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import LayerInfo
from tests.support import evict, flip_byte, resident_bytes

from .conftest import make_tree
from .test_ondemand import MIB, _big_tree, _same_tree


@pytest.fixture
def shared(tmp_path: Path) -> LayerStore:
    root = tmp_path / "shared"
    root.mkdir()
    return LayerStore.over(SharedMountBlobStore(root, create=True))  # split by default


@pytest.fixture
def node_mounts(tmp_path: Path) -> Iterator[LayerMounts]:
    m = LayerMounts(tmp_path / "node" / "mnt")
    try:
        yield m
    finally:
        m.unmount_all(lazy=True)


def assert_nothing_mounted(mounts: LayerMounts, digest: str) -> None:
    assert mounts.mounted() == {}
    assert find_mount(mounts.path_for(digest)) is None
    assert not mounts.path_for(digest).exists()
    assert not mounts.meta_path(digest).exists()
    assert [p.name for p in mounts.meta_dir.iterdir() if p.name.startswith(".")] == []  # no temporaries


def files_outside(root: Path, skip: list[Path]) -> list[Path]:
    """Every regular file below ``root`` except under ``skip`` (never entering a mount)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if d / n not in skip and not os.path.ismount(d / n)]
        out += [d / n for n in filenames if (d / n).is_file() and not (d / n).is_symlink()]
    return out


def test_split_layer_mounts_from_a_local_meta_with_the_data_read_in_place(
    shared: LayerStore, node_mounts: LayerMounts, tmp_path: Path
) -> None:
    src = _big_tree(tmp_path / "src")
    info = shared.import_path(src, "big:1")
    assert info.format == "split" and info.data_digest is not None
    mnt = node_mounts.acquire_layer(shared, info.digest)
    assert mnt == node_mounts.path_for(info.digest)
    assert _same_tree(src, mnt) > 60
    # META is on node-local disk, beside the mount root, and is byte for byte the stored one.
    meta = node_mounts.meta_path(info.digest)
    assert meta.parent == tmp_path / "node" / "layer-meta"
    assert hashlib.sha256(meta.read_bytes()).hexdigest() == info.digest[7:]
    entry = find_mount(mnt)
    assert entry is not None and entry.fstype == "erofs" and entry.source == str(meta)
    # No copy of the data blob exists outside the store: the only file the node wrote is META.
    data = shared.blob_path(info.data_digest)
    node_files = files_outside(tmp_path, [tmp_path / "shared", tmp_path / "src"])
    assert [p for p in node_files if p.stat().st_size > 0] == [meta]  # (and the empty .lock)
    assert meta.stat().st_size < 64 * 1024 < data.stat().st_size
    # A second user shares the mount; releasing keeps it (page cache) until unmount_unused.
    assert node_mounts.acquire_layer(shared, info.digest) == mnt and find_mount(mnt) == entry
    node_mounts.release(info.digest)
    node_mounts.release(info.digest)
    assert node_mounts.unmount_unused() == [info.digest]
    assert not is_mountpoint(mnt) and not meta.exists()  # the META copy goes with the mount


def test_reading_one_small_file_of_a_large_split_layer_reads_a_few_pages(
    shared: LayerStore, node_mounts: LayerMounts, tmp_path: Path
) -> None:
    src = _big_tree(tmp_path / "src")
    info = shared.import_path(src, "big:1")
    assert info.data_digest is not None
    data = shared.blob_path(info.data_digest)
    evict(data)
    if resident_bytes(data) > MIB:
        pytest.skip("the store's filesystem keeps pages resident (tmpfs?): cannot observe reads")
    mnt = node_mounts.acquire_layer(shared, info.digest)
    os.listdir(mnt / "data")
    (mnt / "etc/hostname").stat()
    assert resident_bytes(data) == 0  # mounting and metadata: nothing from the data blob
    assert (mnt / "data/small-07.txt").read_bytes() == (src / "data/small-07.txt").read_bytes()
    touched = resident_bytes(data)
    print(
        f"\none small file ({(src / 'data/small-07.txt').stat().st_size} B) of a {data.stat().st_size} B "
        f"data blob: {touched} B of the blob read"
    )
    assert 0 < touched <= 256 * 1024, touched  # one block plus readahead, of ~24 MiB


def test_single_blob_with_a_flipped_byte_is_refused(node_mounts: LayerMounts, tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "local")  # single by default
    info = store.import_path(make_tree(tmp_path / "src"), "base:1")
    assert info.format == "single"
    blob = store.blob_path(info.digest)
    flip_byte(blob, blob.stat().st_size // 2)
    with pytest.raises(InfraFailure, match="corrupt") as exc:
        node_mounts.acquire_layer(store, info.digest)
    assert exc.value.reason == "corrupt"
    assert_nothing_mounted(node_mounts, info.digest)
    flip_byte(blob, 1024)  # the superblock magic: it is not even an image any more
    flip_byte(blob, blob.stat().st_size // 2)
    with pytest.raises(InfraFailure) as exc:
        node_mounts.acquire_layer(LayerStore(tmp_path / "local"), info.digest)
    assert exc.value.reason == "corrupt"
    assert_nothing_mounted(node_mounts, info.digest)


def test_single_blob_is_hashed_once_per_node(
    node_mounts: LayerMounts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LayerStore(tmp_path / "local")
    info = store.import_path(make_tree(tmp_path / "src"), "base:1")
    hashed: list[str] = []
    real = hashlib.sha256

    def counting() -> hashlib._Hash:
        hashed.append("x")
        return real()

    monkeypatch.setattr("dsec.images.mounts.hashlib.sha256", counting)
    node_mounts.acquire_layer(store, info.digest)
    node_mounts.release(info.digest)
    node_mounts.unmount_unused()
    node_mounts.acquire_layer(store, info.digest)  # mounted again: not hashed again
    assert hashed == ["x"]


@pytest.mark.parametrize("where", ["middle", "magic", "blob digest"])
def test_meta_with_a_flipped_byte_is_refused(
    shared: LayerStore, node_mounts: LayerMounts, tmp_path: Path, where: str
) -> None:
    info = shared.import_path(make_tree(tmp_path / "src"), "base:1")
    assert info.data_digest is not None
    meta = shared.blob_path(info.digest)
    offset = {
        "middle": meta.stat().st_size // 2,
        "magic": 1024,
        "blob digest": meta.read_bytes().index(info.data_digest[7:].encode()) + 5,
    }[where]
    flip_byte(meta, offset)
    other_node = LayerStore.over(SharedMountBlobStore(shared.root))  # reads the damaged META afresh
    for store in (shared, other_node):
        with pytest.raises(InfraFailure) as exc:
            node_mounts.acquire_layer(store, info.digest)
        assert exc.value.reason == "corrupt", exc.value
        assert_nothing_mounted(node_mounts, info.digest)


def test_truncated_or_missing_data_blob_is_refused(
    shared: LayerStore, node_mounts: LayerMounts, tmp_path: Path
) -> None:
    info = shared.import_path(make_tree(tmp_path / "src"), "base:1")
    assert info.data_digest is not None
    data = shared.blob_path(info.data_digest)
    os.chmod(data, 0o644)
    os.truncate(data, data.stat().st_size - 4096)
    with pytest.raises(InfraFailure, match="expects") as exc:
        node_mounts.acquire_layer(shared, info.digest)
    assert exc.value.reason == "corrupt"
    assert node_mounts.mounted() == {} and find_mount(node_mounts.path_for(info.digest)) is None
    data.unlink()
    with pytest.raises(InfraFailure, match="missing") as exc:
        node_mounts.acquire_layer(shared, info.digest)
    assert exc.value.reason == "storage"
    assert node_mounts.mounted() == {}
    shared.blob_path(info.digest).unlink()
    with pytest.raises(InfraFailure, match="missing") as exc:
        node_mounts.acquire_layer(LayerStore.over(SharedMountBlobStore(shared.root)), info.digest)
    assert exc.value.reason == "storage"


def _two_formats(tmp_path: Path) -> tuple[LayerStore, LayerInfo, LayerInfo]:
    root = tmp_path / "shared"
    root.mkdir()
    single = LayerStore.over(SharedMountBlobStore(root, create=True), layout="single")
    one = single.import_path(make_tree(tmp_path / "one"), "one:1")
    two_src = tmp_path / "two"
    (two_src / "etc").mkdir(parents=True)
    (two_src / "etc/hostname").write_text("split\n")
    (two_src / "only-in-two").write_bytes(b"2" * 100_000)
    split = LayerStore.over(SharedMountBlobStore(root))
    two = split.import_path(two_src, "two:1")
    assert (one.format, two.format) == ("single", "split")
    return split, one, two


def test_both_formats_in_one_store_mount_side_by_side(node_mounts: LayerMounts, tmp_path: Path) -> None:
    store, one, two = _two_formats(tmp_path)
    a = node_mounts.acquire_layer(store, one.digest)
    b = node_mounts.acquire_layer(store, two.digest)
    assert (a / "etc/hostname").read_text() == "box\n" and (b / "etc/hostname").read_text() == "split\n"
    assert (b / "only-in-two").read_bytes() == b"2" * 100_000
    assert find_mount(a).source == str(store.blob_path(one.digest))  # type: ignore[union-attr]
    assert find_mount(b).source == str(node_mounts.meta_path(two.digest))  # type: ignore[union-attr]
    assert not node_mounts.meta_path(one.digest).exists()  # a single image needs no local copy
    # The old entry point takes single images only: a split META alone would read garbage.
    other = LayerMounts(tmp_path / "other" / "mnt")
    with pytest.raises(InvalidRequest, match="split"):
        other.acquire(two.digest, store.blob_path(two.digest))
    assert other.mounted() == {} and not other.path_for(two.digest).exists()


def test_restart_adopts_mounts_of_both_formats(tmp_path: Path) -> None:
    store, one, two = _two_formats(tmp_path)
    root = tmp_path / "node" / "mnt"
    before = LayerMounts(root)
    paths = [before.acquire_layer(store, d) for d in (one.digest, two.digest)]
    entries = [find_mount(p) for p in paths]
    del before  # the edge dies; its mounts (and the local META) stay
    orphan = root.parent / "layer-meta" / ("ab" * 32 + ".meta")  # its layer is not mounted (reboot)
    unfinished = root.parent / "layer-meta" / f".{'cd' * 32}.123.456.tmp"  # a crash mid-copy
    orphan.write_bytes(b"x")
    unfinished.write_bytes(b"x")

    after = LayerMounts(root)
    try:
        assert after.mounted() == {one.digest: 0, two.digest: 0}
        assert not orphan.exists() and not unfinished.exists()
        assert after.meta_path(two.digest).exists()
        fresh = LayerStore.over(SharedMountBlobStore(store.root))
        assert [after.acquire_layer(fresh, d) for d in (one.digest, two.digest)] == paths
        assert [find_mount(p) for p in paths] == entries  # reused, not mounted again
        assert (paths[1] / "only-in-two").read_bytes() == b"2" * 100_000
        assert after.meta_path(two.digest).exists()
    finally:
        after.unmount_all()
    assert not any(is_mountpoint(p) for p in paths)
    assert not after.meta_path(two.digest).exists()


def test_mount_stored_layer_for_short_jobs(tmp_path: Path) -> None:
    store, one, two = _two_formats(tmp_path)
    for info, name in ((one, "box\n"), (two, "split\n")):
        target = tmp_path / f"job-{info.format}"
        target.mkdir()
        mount_stored_layer(store, info.digest, target)
        try:
            assert (target / "etc/hostname").read_text() == name
        finally:
            umount(target)
