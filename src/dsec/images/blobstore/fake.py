"""An in-memory blob store for tests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Hashable
from pathlib import Path

from dsec.images.blobstore.base import BLOB_SUFFIX, BlobStat, PutResult, corrupt, key_parts, sha256_file
from dsec.images.refs import digest_hex, make_digest
from dsec.protocol.errors import LayerNotFound


class FakeBlobStore:
    """In memory, for tests; ``path`` materialises a blob as a file under ``root`` on demand."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="dsec-fake-blobs-"))
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        for d in (self.blob_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}
        self._mtimes: dict[str, float] = {}
        self._records: dict[str, bytes] = {}
        self._versions: dict[str, int] = {}  # record_version: a store-wide count of record writes
        self._writes = 0

    def put(self, src: Path, expected: str | None = None) -> PutResult:
        data = src.read_bytes()
        hexdigest = hashlib.sha256(data).hexdigest()
        digest = make_digest(hexdigest)
        if expected is not None and expected != digest:
            raise corrupt(expected, hexdigest, src)
        with self._lock:
            self._mtimes[digest] = time.time()
            if digest in self._blobs:
                return PutResult(digest, len(data), created=False)
            self._blobs[digest] = data
        return PutResult(digest, len(data), created=True)

    def path(self, digest: str) -> Path:
        final = self.blob_dir / f"{digest_hex(digest)}{BLOB_SUFFIX}"
        with self._lock:
            data = self._blobs.get(digest)
            if data is not None and not final.exists():
                tmp = final.with_name(f".{final.name}.tmp")
                tmp.write_bytes(data)
                os.chmod(tmp, 0o444)
                os.rename(tmp, final)
        return final

    def exists(self, digest: str) -> bool:
        digest_hex(digest)
        with self._lock:
            return digest in self._blobs

    def stat(self, digest: str) -> BlobStat | None:
        digest_hex(digest)
        with self._lock:
            data = self._blobs.get(digest)
            return None if data is None else BlobStat(len(data), self._mtimes[digest])

    def size(self, digest: str) -> int:
        st = self.stat(digest)
        if st is None:
            raise LayerNotFound(f"no blob {digest} in the fake store")
        return st.size

    def touch(self, digest: str) -> bool:
        digest_hex(digest)
        with self._lock:
            if digest not in self._blobs:
                return False
            self._mtimes[digest] = time.time()
            return True

    def delete(self, digest: str, *, min_age: float = 0.0) -> bool:
        final = self.blob_dir / f"{digest_hex(digest)}{BLOB_SUFFIX}"
        with self._lock:
            if digest not in self._blobs or time.time() - self._mtimes[digest] < min_age:
                return False
            del self._blobs[digest], self._mtimes[digest]
            with contextlib.suppress(FileNotFoundError):
                final.unlink()
        return True

    def list_digests(self) -> list[str]:
        with self._lock:
            return sorted(self._blobs)

    def verify(self, digest: str) -> None:
        if not self.exists(digest):
            raise LayerNotFound(f"no blob {digest} in the fake store")
        final = self.path(digest)  # what the kernel reads is what must be intact
        actual = sha256_file(final)
        if actual != digest_hex(digest):
            raise corrupt(digest, actual, final)

    def sweep(self, min_age: float) -> int:
        return 0

    def create_record(self, key: str, data: bytes) -> bool:
        key_parts(key)
        with self._lock:
            if key in self._records:
                return False
            self._records[key] = bytes(data)
            self._wrote(key)
            return True

    def replace_record(self, key: str, data: bytes) -> None:
        key_parts(key)
        with self._lock:
            self._records[key] = bytes(data)
            self._wrote(key)

    def _wrote(self, key: str) -> None:
        self._writes += 1
        self._versions[key] = self._writes

    def record_version(self, key: str) -> Hashable | None:
        key_parts(key)
        with self._lock:
            return self._versions.get(key) if key in self._records else None

    def read_record(self, key: str) -> bytes | None:
        key_parts(key)
        with self._lock:
            return self._records.get(key)

    def list_records(self, prefix: str) -> list[str]:
        key_parts(prefix)
        with self._lock:
            return sorted(k for k in self._records if k.startswith(prefix + "/"))

    def delete_record(self, key: str) -> bool:
        key_parts(key)
        with self._lock:
            self._versions.pop(key, None)
            return self._records.pop(key, None) is not None
