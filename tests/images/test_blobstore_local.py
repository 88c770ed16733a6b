"""The local-directory blob store: conformance, plus what only a real directory can show."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.blobstore import MARKER, BlobStore, LocalDirBlobStore
from dsec.protocol.errors import InfraFailure

from .blobstore_conformance import BlobStoreConformance, Clock, digest_of, make_clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return make_clock(monkeypatch)


class TestLocalDirBlobStore(BlobStoreConformance):
    spawn = "LocalDirBlobStore(root)"

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:
        yield LocalDirBlobStore(tmp_path / "store")


def test_layout_on_disk(tmp_path: Path) -> None:
    store = LocalDirBlobStore(tmp_path / "new" / "store")  # created, parents too
    src = store.tmp_dir / "built"
    src.write_bytes(b"image")
    digest = store.put(src).digest
    store.create_record("tags/x/1.json", b"{}")
    root = tmp_path / "new" / "store"
    assert json.loads((root / MARKER).read_text())["layout"] == 1
    blob = root / "blobs" / "sha256" / f"{digest[7:]}.erofs"
    assert store.path(digest) == blob and blob.read_bytes() == b"image"
    assert blob.stat().st_mode & 0o777 == 0o444
    assert (root / "catalogue" / "tags" / "x" / "1.json").read_bytes() == b"{}"
    # nothing but the blob and the record: temporaries are gone
    assert sorted(p.name for p in store.blob_dir.iterdir()) == [blob.name]
    assert sorted(p.name for p in (root / "catalogue" / "tags" / "x").iterdir()) == ["1.json"]


def test_other_layout_version_is_refused(tmp_path: Path) -> None:
    LocalDirBlobStore(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"layout": 99}))
    with pytest.raises(InfraFailure, match="layout 99"):
        LocalDirBlobStore(tmp_path)


def test_put_from_another_filesystem_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirBlobStore(tmp_path / "store")
    src = tmp_path / "elsewhere"
    src.write_bytes(b"from another device")
    real_link = os.link

    def link(a: os.PathLike[str] | str, b: os.PathLike[str] | str) -> None:
        if Path(a) == src:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_link(a, b)

    monkeypatch.setattr(os, "link", link)
    res = store.put(src)
    assert res.created and store.path(res.digest).read_bytes() == b"from another device"
    assert [p.name for p in store.blob_dir.iterdir()] == [f"{res.digest[7:]}.erofs"]


def test_torn_blob_of_wrong_size_is_discarded(tmp_path: Path) -> None:
    """A blob whose size is not its content's (an external tool tore it) is not that content."""
    store = LocalDirBlobStore(tmp_path)
    data = b"x" * 10_000
    digest = digest_of(data)
    store.path(digest).write_bytes(data[:4096])
    src = store.tmp_dir / "src"
    src.write_bytes(data)
    assert store.put(src).created
    store.verify(digest)


def test_delete_loses_to_a_touch_that_comes_in_between(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put or tag that refreshes the blob after the collector looked at it wins."""
    store = LocalDirBlobStore(tmp_path)
    src = store.tmp_dir / "src"
    src.write_bytes(b"old and unreferenced")
    digest = store.put(src).digest
    clock(3600)
    real_rename = os.rename

    def rename(a: os.PathLike[str] | str, b: os.PathLike[str] | str) -> None:
        if Path(b).name.startswith(".gc-"):
            assert store.touch(digest)  # an importer's put of the same content, just in time
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    assert not store.delete(digest, min_age=600)
    assert store.exists(digest) and store.list_digests() == [digest]
    assert sorted(p.name for p in store.blob_dir.iterdir()) == [f"{digest[7:]}.erofs"]


def test_sweep_restores_blobs_a_crashed_collector_moved_aside(tmp_path: Path, clock: Clock) -> None:
    store = LocalDirBlobStore(tmp_path)
    src = store.tmp_dir / "src"
    src.write_bytes(b"blob")
    digest = store.put(src).digest
    final = store.path(digest)
    os.rename(final, final.with_name(f".gc-{final.name}-123-abc"))  # crashed right after
    (store.record_dir / "tags").mkdir()
    (store.record_dir / "tags" / ".1.json.123-abc.tmp").write_bytes(b"half")
    clock(7200)
    assert store.sweep(3600) == 2
    assert store.list_digests() == [digest]
    assert sorted(p.name for p in store.blob_dir.iterdir()) == [final.name]
    assert list((store.record_dir / "tags").iterdir()) == []
