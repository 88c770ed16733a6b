"""The shared-mount blob store: conformance (also on filesystems without hard links or
renameat2), the checks at construction, and one store seen through two mounts ("nodes")."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.blobstore import MARKER, BlobStore, SharedMountBlobStore, _publish
from dsec.protocol.errors import InfraFailure

from .blobstore_conformance import BlobStoreConformance


def shared(root: Path) -> SharedMountBlobStore:
    root.mkdir(parents=True, exist_ok=True)  # the mount is there: the operator mounted it
    return SharedMountBlobStore(root, create=True)


class TestSharedMountBlobStore(BlobStoreConformance):
    spawn = "SharedMountBlobStore(root)"

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:
        yield shared(tmp_path / "mnt")


def _no_hard_links(monkeypatch: pytest.MonkeyPatch) -> None:
    def link(*args: object, **kw: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", link)


class TestSharedMountWithoutHardLinks(BlobStoreConformance):
    """Filesystems without link(2) (some FUSE ones): renameat2(RENAME_NOREPLACE) publishes."""

    # The fallback is forced by patching this process; a child process would not be patched.
    test_concurrent_process_puts_store_one_blob = None  # type: ignore[assignment]
    test_concurrent_process_creates_have_one_winner = None  # type: ignore[assignment]

    @pytest.fixture
    def blobs(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BlobStore]:
        store = shared(tmp_path / "mnt")
        _no_hard_links(monkeypatch)
        yield store


class TestSharedMountWithClaimsOnly(BlobStoreConformance):
    """Neither link(2) nor RENAME_NOREPLACE: an O_EXCL claim file around rename(2) publishes."""

    # The fallback is forced by patching this process; a child process would not be patched.
    test_concurrent_process_puts_store_one_blob = None  # type: ignore[assignment]
    test_concurrent_process_creates_have_one_winner = None  # type: ignore[assignment]

    @pytest.fixture
    def blobs(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BlobStore]:
        store = shared(tmp_path / "mnt")
        _no_hard_links(monkeypatch)

        def no_noreplace(src: Path, dst: Path) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(_publish, "_rename_noreplace", no_noreplace)
        yield store


def test_missing_mount_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InfraFailure, match="is the shared filesystem mounted") as exc:
        SharedMountBlobStore(tmp_path / "not-mounted")
    assert exc.value.reason == "storage"
    assert not (tmp_path / "not-mounted").exists()  # never created on the local disk instead


def test_empty_mount_point_is_not_taken_for_a_store(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    with pytest.raises(InfraFailure, match=f"no {MARKER}"):
        SharedMountBlobStore(tmp_path / "mnt")
    assert list((tmp_path / "mnt").iterdir()) == []
    SharedMountBlobStore(tmp_path / "mnt", create=True)
    SharedMountBlobStore(tmp_path / "mnt")  # initialised once, opened by every node after


def test_two_mounts_of_one_store_see_the_same_blobs_and_records(tmp_path: Path) -> None:
    """Two nodes mount the shared filesystem at different paths (bind mounts stand in here)."""
    export = tmp_path / "export"
    export.mkdir()
    a_mnt, b_mnt = tmp_path / "node-a", tmp_path / "node-b"
    for mnt in (a_mnt, b_mnt):
        mnt.mkdir()
        subprocess.run(["mount", "--bind", str(export), str(mnt)], check=True)
    a = SharedMountBlobStore(a_mnt, create=True)
    b = SharedMountBlobStore(b_mnt)
    src = a.tmp_dir / "built"
    src.write_bytes(b"layer from node a")
    digest = a.put(src).digest
    assert b.exists(digest) and b.path(digest).parent == b_mnt / "blobs" / "sha256"
    assert b.path(digest).read_bytes() == b"layer from node a"
    srcb = b.tmp_dir / "built"
    srcb.write_bytes(b"layer from node a")
    assert not b.put(srcb).created  # node b imports the same content: stored once
    assert a.create_record("tags/x/1.json", b"a")
    assert not b.create_record("tags/x/1.json", b"b")
    assert b.read_record("tags/x/1.json") == b"a" and b.list_records("tags") == ["tags/x/1.json"]
    b.replace_record("tags/x/1.json", b"b")
    assert a.read_record("tags/x/1.json") == b"b"
