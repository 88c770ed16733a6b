"""Split EROFS layers (metadata image + data blob), mounted file-backed with ``device=``.

Real mkfs.erofs and real mounts (root); no network: the "remote" blob is a local file here.
What travels over a slow filesystem is measured by bench/ondemand.py; here we check the same
property locally through the blob's page cache: with buffered reads, every blob page EROFS
reads is cached under the blob's inode, so mincore(2) on the blob shows exactly which part of
it was read (after evicting it with POSIX_FADV_DONTNEED).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.images.erofs import build_erofs
from dsec.images.mount import find_mount, is_loop_backed, mount_erofs, umount
from dsec.images.ondemand import (
    DEFAULT_CHUNK_SIZE,
    SplitImage,
    build_split,
    is_split_image,
    mount_split,
    read_split_info,
    set_read_ahead,
    unmount_split,
    verify_blob,
)
from dsec.protocol.errors import InfraFailure, InvalidRequest
from tests.support import evict, resident_bytes

from .conftest import make_tree

MIB = 1 << 20


def _big_tree(root: Path) -> Path:
    """The metadata-rich tree of the other layer tests plus bulk data in a few files."""
    make_tree(root)
    data = root / "data"
    data.mkdir()
    (data / "weights.bin").write_bytes(os.urandom(24 * MIB + 12345))
    (data / "copy.bin").write_bytes((data / "weights.bin").read_bytes())  # dedups per chunk
    for i in range(50):
        (data / f"small-{i:02d}.txt").write_bytes(os.urandom(100 + 97 * i))
    (root / "empty-file").touch()
    return root


@pytest.fixture(scope="module")
def big_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _big_tree(tmp_path_factory.mktemp("split") / "src")


@contextmanager
def _mounted(target: Path) -> Iterator[Path]:
    target.mkdir(exist_ok=True)
    try:
        yield target
    finally:
        if find_mount(target) is not None:
            umount(target, lazy=True)


def _same_tree(a_root: Path, b_root: Path) -> int:
    """Assert two trees have the same entries, metadata and content; returns entries compared."""
    a_names = sorted(p.relative_to(a_root) for p in a_root.rglob("*"))
    b_names = sorted(p.relative_to(b_root) for p in b_root.rglob("*"))
    assert a_names == b_names
    for rel in [Path("."), *a_names]:
        a, b = a_root / rel, b_root / rel
        sa, sb = os.lstat(a), os.lstat(b)
        assert (sa.st_mode, sa.st_uid, sa.st_gid, sa.st_mtime_ns, sa.st_nlink) == (
            sb.st_mode,
            sb.st_uid,
            sb.st_gid,
            sb.st_mtime_ns,
            sb.st_nlink,
        ), rel
        if stat.S_ISREG(sa.st_mode):
            assert sa.st_size == sb.st_size, rel
            assert a.read_bytes() == b.read_bytes(), rel
        if stat.S_ISLNK(sa.st_mode):
            assert os.readlink(a) == os.readlink(b), rel
        if stat.S_ISCHR(sa.st_mode):
            assert sa.st_rdev == sb.st_rdev, rel
        keys = sorted(os.listxattr(a, follow_symlinks=False))
        assert keys == sorted(os.listxattr(b, follow_symlinks=False)), rel
        for key in keys:
            assert os.getxattr(a, key, follow_symlinks=False) == os.getxattr(b, key, follow_symlinks=False)
    return len(a_names)


# ---------------------------------------------------------------- build


def test_same_tree_gives_identical_meta_and_blob(tmp_path: Path, big_src: Path) -> None:
    a = build_split(big_src, tmp_path / "a.meta", tmp_path / "a.blob")
    time.sleep(0.05)  # mkfs.erofs stamps the wall clock into the superblock; we must undo it
    b = build_split(big_src, tmp_path / "b.meta", tmp_path / "b.blob")
    assert a.meta.read_bytes() == b.meta.read_bytes()
    assert a.blob.read_bytes() == b.blob.read_bytes()
    assert (a.meta_digest, a.blob_digest) == (b.meta_digest, b.blob_digest)
    assert a.chunk_size == DEFAULT_CHUNK_SIZE


def test_meta_is_small_and_records_the_blob(tmp_path: Path, big_src: Path) -> None:
    img = build_split(big_src, tmp_path / "m", tmp_path / "b")
    assert img.meta_size == img.meta.stat().st_size and img.blob_size == img.blob.stat().st_size
    # copy.bin duplicates weights.bin chunk for chunk: mkfs stores those chunks once
    assert img.blob_size < 30 * MIB
    assert img.meta_size < 64 * 1024
    assert is_split_image(img.meta)
    info = read_split_info(img.meta)
    assert (info.blob_digest, info.blob_size, info.block_size) == (img.blob_digest, img.blob_size, 4096)
    verify_blob(img.meta, img.blob)


def test_chunk_size_changes_meta_not_data(tmp_path: Path, big_src: Path) -> None:
    small = build_split(big_src, tmp_path / "s.meta", tmp_path / "s.blob", chunk_size=64 * 1024)
    large = build_split(big_src, tmp_path / "l.meta", tmp_path / "l.blob", chunk_size=4 * MIB)
    assert small.meta_digest != large.meta_digest
    assert small.meta_size >= large.meta_size  # 8 bytes of chunk index per chunk


@pytest.mark.parametrize("chunk_size", [0, 1000, 2048, 3 * 4096, 1 << 31])
def test_bad_chunk_size_is_refused(tmp_path: Path, chunk_size: int) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(InvalidRequest):
        build_split(tmp_path / "src", tmp_path / "m", tmp_path / "b", chunk_size=chunk_size)


def test_source_must_be_a_directory_and_outputs_distinct(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidRequest):
        build_split(tmp_path / "f", tmp_path / "m", tmp_path / "b")
    (tmp_path / "src").mkdir()
    with pytest.raises(InvalidRequest):
        build_split(tmp_path / "src", tmp_path / "same", tmp_path / "same")


def test_mkfs_failure_leaves_no_outputs(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src/f").write_text("x")
    with pytest.raises(InfraFailure) as exc:
        build_split(tmp_path / "src", tmp_path / "m", tmp_path / "no-such-dir" / "b")
    assert exc.value.reason == "storage"
    assert not (tmp_path / "m").exists()


def test_tree_without_regular_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    os.symlink("d", src / "l")
    (src / "empty").touch()
    img = build_split(src, tmp_path / "m", tmp_path / "b")
    assert img.blob_size == 0
    with _mounted(tmp_path / "mnt") as mnt:
        mount_split(img.meta, img.blob, mnt)
        assert sorted(os.listdir(mnt)) == ["d", "empty", "l"]
        assert (mnt / "empty").read_bytes() == b""
        unmount_split(mnt)


# ---------------------------------------------------------------- mount


@pytest.mark.parametrize("directio", [False, True])
def test_split_mount_reads_back_what_a_plain_layer_does(
    tmp_path: Path, big_src: Path, directio: bool
) -> None:
    img = build_split(big_src, tmp_path / "m", tmp_path / "b", chunk_size=64 * 1024)
    build_erofs(big_src, tmp_path / "plain.erofs")
    with _mounted(tmp_path / "split") as split, _mounted(tmp_path / "plain") as plain:
        mount_split(img.meta, img.blob, split, directio=directio)
        mount_erofs(tmp_path / "plain.erofs", plain)
        entry = find_mount(split)
        assert entry is not None and entry.fstype == "erofs"
        assert not is_loop_backed(entry) and entry.source == str(img.meta)
        assert _same_tree(plain, split) > 60
        assert _same_tree(big_src, split) > 60
        unmount_split(split)
        assert find_mount(split) is None


def test_reading_one_small_file_reads_a_small_part_of_the_blob(tmp_path: Path, big_src: Path) -> None:
    img = build_split(big_src, tmp_path / "m", tmp_path / "b")
    evict(img.blob)
    if resident_bytes(img.blob) > MIB:
        pytest.skip("the blob's filesystem keeps pages resident (tmpfs?): cannot observe reads")
    with _mounted(tmp_path / "mnt") as mnt:
        mount_split(img.meta, img.blob, mnt)
        os.listdir(mnt / "data")  # metadata only: nothing from the blob
        assert resident_bytes(img.blob) == 0
        want = (big_src / "data/small-07.txt").read_bytes()
        assert (mnt / "data/small-07.txt").read_bytes() == want
        touched = resident_bytes(img.blob)
        assert 0 < touched <= 256 * 1024, touched  # one block plus readahead, of ~24 MiB
        # a whole big file: the blob pages behind it, and not much more
        assert (mnt / "data/weights.bin").read_bytes() == (big_src / "data/weights.bin").read_bytes()
        weights = (big_src / "data/weights.bin").stat().st_size
        assert weights <= resident_bytes(img.blob) <= weights + 2 * MIB
        unmount_split(mnt)


def test_directio_leaves_the_blob_uncached(tmp_path: Path, big_src: Path) -> None:
    """With ``directio`` the blob's filesystem keeps no second copy of what EROFS caches."""
    img = build_split(big_src, tmp_path / "m", tmp_path / "b")
    evict(img.blob)
    if resident_bytes(img.blob) > MIB:
        pytest.skip("the blob's filesystem keeps pages resident (tmpfs?): cannot observe reads")
    with _mounted(tmp_path / "mnt") as mnt:
        mount_split(img.meta, img.blob, mnt, directio=True)
        assert (mnt / "data/weights.bin").read_bytes() == (big_src / "data/weights.bin").read_bytes()
        assert resident_bytes(img.blob) == 0
        unmount_split(mnt)


def test_read_ahead_is_per_layer_mount(tmp_path: Path, big_src: Path) -> None:
    img = build_split(big_src, tmp_path / "m", tmp_path / "b")
    with _mounted(tmp_path / "a") as a, _mounted(tmp_path / "b2") as b:
        mount_split(img.meta, img.blob, a, read_ahead_kb=2048)
        mount_split(img.meta, img.blob, b)
        assert set_read_ahead(a, 512) == 2048
        assert set_read_ahead(b, 128) == 128  # the kernel's default, untouched by a's setting
        unmount_split(a)
        unmount_split(b)
    with pytest.raises(InvalidRequest, match="not a mount point"):
        set_read_ahead(tmp_path, 1024)


def _split(tmp_path: Path, src: Path) -> SplitImage:
    return build_split(src, tmp_path / "m", tmp_path / "b", chunk_size=64 * 1024)


def test_missing_truncated_or_foreign_blob_is_refused(tmp_path: Path, big_src: Path) -> None:
    img = _split(tmp_path, big_src)
    with _mounted(tmp_path / "mnt") as mnt:
        with pytest.raises(InfraFailure, match="missing"):
            mount_split(img.meta, tmp_path / "nope", mnt)
        short = tmp_path / "short"
        short.write_bytes(img.blob.read_bytes()[:-4096])
        with pytest.raises(InfraFailure, match="expects"):
            mount_split(img.meta, short, mnt)
        with pytest.raises(InvalidRequest, match="regular file"):
            mount_split(img.meta, tmp_path, mnt)
        assert find_mount(mnt) is None
    foreign = tmp_path / "foreign"
    foreign.write_bytes(bytes(img.blob_size))
    with pytest.raises(InfraFailure, match="does not belong"):
        verify_blob(img.meta, foreign)


def test_plain_image_or_junk_is_not_a_split_layer(tmp_path: Path, big_src: Path) -> None:
    build_erofs(big_src, tmp_path / "plain.erofs")
    assert not is_split_image(tmp_path / "plain.erofs")
    with pytest.raises(InvalidRequest, match="single-device"):
        read_split_info(tmp_path / "plain.erofs")
    (tmp_path / "junk").write_bytes(bytes(8192))
    with pytest.raises(InvalidRequest, match="not an EROFS image"):
        is_split_image(tmp_path / "junk")
    with pytest.raises(InvalidRequest, match="does not exist"):
        read_split_info(tmp_path / "absent")


def test_blob_path_with_a_comma_is_refused(tmp_path: Path, big_src: Path) -> None:
    img = _split(tmp_path, big_src)
    odd = tmp_path / "a,b"
    os.link(img.blob, odd)
    with _mounted(tmp_path / "mnt") as mnt, pytest.raises(InvalidRequest, match="comma"):
        mount_split(img.meta, odd, mnt)


def test_unmount_split_only_unmounts_a_layer(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a mount point"):
        unmount_split(tmp_path)
