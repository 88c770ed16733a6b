from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.images.mount import MS_RDONLY, find_mount, is_loop_backed, is_mountpoint, mount, umount
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraFailure
from dsec.protocol.models import LayerInfo

from .conftest import make_tree


@pytest.fixture
def layer(store: LayerStore, tmp_path: Path) -> LayerInfo:
    return store.import_path(make_tree(tmp_path / "src"), "base:1")


def test_acquire_mounts_once_and_counts_users(
    store: LayerStore, layer_mounts: LayerMounts, layer: LayerInfo
) -> None:
    blob = store.blob_path(layer.digest)
    first = layer_mounts.acquire(layer.digest, blob)
    entry = find_mount(first)
    assert entry is not None and entry.source == str(blob) and not is_loop_backed(entry)
    second = layer_mounts.acquire(layer.digest, blob)
    assert second == first == layer_mounts.path_for(layer.digest)
    assert find_mount(first) == entry  # same mount, not a second one stacked on it
    assert layer_mounts.refcount(layer.digest) == 2
    assert (first / "etc/hostname").read_text() == "box\n"

    layer_mounts.release(layer.digest)
    layer_mounts.release(layer.digest)
    assert is_mountpoint(first)  # released layers stay mounted: their page cache is shared
    with pytest.raises(ValueError):
        layer_mounts.release(layer.digest)

    assert layer_mounts.unmount_unused() == [layer.digest]
    assert not is_mountpoint(first) and not first.exists()
    assert layer_mounts.mounted() == {}


def test_unmount_unused_keeps_layers_in_use(
    store: LayerStore, layer_mounts: LayerMounts, layer: LayerInfo, tmp_path: Path
) -> None:
    other = make_tree(tmp_path / "other")
    (other / "x").write_text("x")
    second = store.import_path(other, "other:1")
    layer_mounts.acquire(layer.digest, store.blob_path(layer.digest))
    layer_mounts.acquire(second.digest, store.blob_path(second.digest))
    layer_mounts.release(second.digest)
    assert layer_mounts.unmount_unused() == [second.digest]
    assert layer_mounts.mounted() == {layer.digest: 1}
    assert is_mountpoint(layer_mounts.path_for(layer.digest))


def test_restart_adopts_existing_mounts(store: LayerStore, layer: LayerInfo, tmp_path: Path) -> None:
    root = tmp_path / "mnt"
    before = LayerMounts(root)
    path = before.acquire(layer.digest, store.blob_path(layer.digest))
    entry = find_mount(path)
    del before  # the "edge" dies; its mounts stay

    after = LayerMounts(root)
    try:
        assert after.mounted() == {layer.digest: 0}
        assert after.acquire(layer.digest, store.blob_path(layer.digest)) == path
        assert find_mount(path) == entry  # reused, not mounted again
        assert after.refcount(layer.digest) == 1
    finally:
        after.unmount_all()
    assert not is_mountpoint(path)


def test_missing_blob_is_a_storage_failure(layer_mounts: LayerMounts, tmp_path: Path) -> None:
    with pytest.raises(InfraFailure) as exc:
        layer_mounts.acquire("sha256:" + "a" * 64, tmp_path / "nope.erofs")
    assert exc.value.reason == "storage"
    assert layer_mounts.mounted() == {}


def test_whiteouts_and_opaque_dirs_work_through_overlayfs(
    store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path
) -> None:
    lower_src = tmp_path / "lower"
    (lower_src / "dir").mkdir(parents=True)
    (lower_src / "keep").write_text("keep")
    (lower_src / "gone").write_text("gone")
    (lower_src / "dir/old").write_text("old")
    upper_src = tmp_path / "upper"
    (upper_src / "dir").mkdir(parents=True)
    os.mknod(upper_src / "gone", stat.S_IFCHR, os.makedev(0, 0))  # "gone" deleted by this layer
    os.setxattr(upper_src / "dir", "trusted.overlay.opaque", b"y")  # "dir" replaced wholesale
    (upper_src / "dir/new").write_text("new")

    lower = store.import_path(lower_src, "lower:1")
    upper = store.import_path(upper_src, "upper:1")
    low = layer_mounts.acquire(lower.digest, store.blob_path(lower.digest))
    up = layer_mounts.acquire(upper.digest, store.blob_path(upper.digest))
    whiteout = os.lstat(up / "gone")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(up / "dir", "trusted.overlay.opaque") == b"y"

    merged = tmp_path / "merged"
    merged.mkdir()
    mount("overlay", merged, "overlay", MS_RDONLY, f"lowerdir={up}:{low}")
    try:
        assert sorted(os.listdir(merged)) == ["dir", "keep"]
        assert not os.path.lexists(merged / "gone")
        assert os.listdir(merged / "dir") == ["new"]
        assert (merged / "keep").read_text() == "keep"
    finally:
        umount(merged)

    # And a writable sandbox root on top: deleting a layer file writes a whiteout in the upper.
    rw, work, root = tmp_path / "rw", tmp_path / "work", tmp_path / "root"
    for d in (rw, work, root):
        d.mkdir()
    mount("overlay", root, "overlay", 0, f"lowerdir={up}:{low},upperdir={rw},workdir={work}")
    try:
        (root / "keep").unlink()
        assert not os.path.lexists(root / "keep") and (low / "keep").exists()
    finally:
        umount(root)
    assert stat.S_ISCHR(os.lstat(rw / "keep").st_mode)
