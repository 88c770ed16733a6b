"""The in-memory fake passes the blob store conformance suite (threads only: no processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.blobstore import BlobStore, FakeBlobStore

from .blobstore_conformance import BlobStoreConformance


class TestFakeBlobStore(BlobStoreConformance):
    # An in-memory store has no other processes to race with: these do not apply (not skipped).
    test_concurrent_process_puts_store_one_blob = None  # type: ignore[assignment]
    test_concurrent_process_creates_have_one_winner = None  # type: ignore[assignment]

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:
        yield FakeBlobStore(tmp_path / "fake")


def test_fake_is_a_blob_store(tmp_path: Path) -> None:
    assert isinstance(FakeBlobStore(tmp_path), BlobStore)
