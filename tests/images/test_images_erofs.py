from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from dsec.images.erofs import build_erofs, normalize_superblock
from dsec.images.mount import mount_erofs, umount
from dsec.protocol.errors import InfraFailure, InvalidRequest

from .conftest import NS, make_tree


def test_same_tree_gives_identical_bytes(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    build_erofs(src, tmp_path / "a.erofs")
    time.sleep(0.05)  # mkfs.erofs stamps the wall clock into the superblock; we must undo it
    build_erofs(src, tmp_path / "b.erofs")
    assert (tmp_path / "a.erofs").read_bytes() == (tmp_path / "b.erofs").read_bytes()


def test_different_mtime_gives_different_image(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    build_erofs(src, tmp_path / "a.erofs")
    os.utime(src / "etc/hostname", ns=(0, 5 * NS))
    build_erofs(src, tmp_path / "b.erofs")
    assert (tmp_path / "a.erofs").read_bytes() != (tmp_path / "b.erofs").read_bytes()


def test_image_keeps_all_metadata(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    build_erofs(src, tmp_path / "l.erofs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_erofs(tmp_path / "l.erofs", mnt)
    try:
        for p in [src, *sorted(src.rglob("*"))]:
            rel = p.relative_to(src)
            a, b = os.lstat(p), os.lstat(mnt / rel)
            assert (a.st_mode, a.st_uid, a.st_gid, a.st_mtime_ns) == (
                b.st_mode,
                b.st_uid,
                b.st_gid,
                b.st_mtime_ns,
            ), rel
            if stat.S_ISCHR(a.st_mode):
                assert a.st_rdev == b.st_rdev, rel
            if stat.S_ISLNK(a.st_mode):
                assert os.readlink(p) == os.readlink(mnt / rel)
            if stat.S_ISREG(a.st_mode):
                assert p.read_bytes() == (mnt / rel).read_bytes()
            for key in os.listxattr(p, follow_symlinks=False):
                assert os.getxattr(mnt / rel, key, follow_symlinks=False) == os.getxattr(
                    p, key, follow_symlinks=False
                ), (rel, key)
        tool = os.lstat(mnt / "bin/tool")
        assert tool.st_mode & stat.S_ISUID and tool.st_nlink == 2
        assert tool.st_ino == os.lstat(mnt / "bin/tool-hardlink").st_ino
    finally:
        umount(mnt)


def test_mkfs_failure_is_a_storage_infra_failure_with_its_stderr(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    with pytest.raises(InfraFailure) as exc:
        build_erofs(src, tmp_path / "no-such-dir" / "l.erofs")
    assert exc.value.reason == "storage"
    assert "mkfs.erofs failed" in exc.value.message
    assert "no-such-dir" in exc.value.message or "No such file" in exc.value.message


def test_source_must_be_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidRequest):
        build_erofs(tmp_path / "f", tmp_path / "l.erofs")


def test_source_date_epoch_does_not_erase_mtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src")
    build_erofs(src, tmp_path / "a.erofs")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    build_erofs(src, tmp_path / "b.erofs")
    assert (tmp_path / "a.erofs").read_bytes() == (tmp_path / "b.erofs").read_bytes()


def test_normalize_refuses_a_non_erofs_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 8192)
    with pytest.raises(InfraFailure):
        normalize_superblock(junk)
