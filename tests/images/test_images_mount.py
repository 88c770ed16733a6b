from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dsec.images.erofs import build_erofs
from dsec.images.mount import (
    find_mount,
    is_loop_backed,
    is_mountpoint,
    mount,
    mount_erofs,
    mounts_under,
    read_mountinfo,
    umount,
    unmount_tree,
)

from .conftest import make_tree


@pytest.fixture
def image(tmp_path: Path) -> Path:
    build_erofs(make_tree(tmp_path / "src"), tmp_path / "layer.erofs")
    return tmp_path / "layer.erofs"


def test_mount_is_file_backed_not_a_loop_device(tmp_path: Path, image: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_erofs(image, mnt)
    try:
        entry = find_mount(mnt)
        assert entry is not None
        assert entry.fstype == "erofs"
        assert entry.source == str(image)
        assert not is_loop_backed(entry)
        assert "ro" in entry.options.split(",")
        assert all(not e.source.startswith("/dev/loop") for e in mounts_under(tmp_path))
        assert (mnt / "etc/hostname").read_text() == "box\n"
    finally:
        umount(mnt)
    assert not is_mountpoint(mnt)


def test_is_mountpoint_and_lazy_umount(tmp_path: Path, image: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert not is_mountpoint(mnt)
    mount_erofs(image, mnt)
    assert is_mountpoint(mnt)
    assert not is_mountpoint(mnt / "etc")
    with open(mnt / "etc/hostname") as busy:
        with pytest.raises(OSError) as exc:
            umount(mnt)
        assert exc.value.errno == errno.EBUSY
        umount(mnt, lazy=True)  # detaches although a file is still open
        assert not is_mountpoint(mnt)
        assert busy.read() == "box\n"


def test_errors_carry_errno_and_its_text(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    with pytest.raises(OSError) as exc:
        mount_erofs(tmp_path / "missing.erofs", tmp_path / "mnt")
    assert exc.value.errno == errno.ENOENT
    assert "No such file" in str(exc.value) and "missing.erofs" in str(exc.value)
    with pytest.raises(OSError) as exc:
        umount(tmp_path / "mnt")
    assert exc.value.errno == errno.EINVAL
    assert os.strerror(errno.EINVAL) in str(exc.value)


def test_mountinfo_unescapes_paths(tmp_path: Path) -> None:
    odd = tmp_path / "with space\tand\\slash"
    odd.mkdir()
    mount("tmpfs", odd, "tmpfs", 0, "size=1m")
    try:
        entry = find_mount(odd)
        assert entry is not None and entry.mount_point == str(odd) and entry.fstype == "tmpfs"
        assert any(e.mount_point == str(odd) for e in read_mountinfo())
    finally:
        umount(odd)


def test_unmount_tree_detaches_nested_mounts_deepest_first(tmp_path: Path, image: Path) -> None:
    outer = tmp_path / "outer"
    outer.mkdir()
    mount("tmpfs", outer, "tmpfs", 0, "size=1m")
    (outer / "inner").mkdir()
    mount_erofs(image, outer / "inner")
    detached = unmount_tree(tmp_path)
    assert detached == [str(outer / "inner"), str(outer)]
    assert not mounts_under(tmp_path)
