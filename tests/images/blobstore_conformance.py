"""The conformance suite every :class:`BlobStore` passes (as containerd's snapshotters do).

Use it by subclassing :class:`BlobStoreConformance` in a ``test_blobstore_*.py`` module and
providing a ``blobs`` fixture; set ``spawn`` to a Python expression that opens the same store in
another process from ``root`` (a ``Path``) to run the cross-process tests too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec.images.blobstore import BlobStore
from dsec.protocol.errors import InfraFailure, InvalidRequest, LayerNotFound

Clock = Callable[[float], None]

_CHILD = r"""
import json, sys, time
from pathlib import Path
from dsec.images.blobstore import *  # noqa: F403
root, go, op, arg, data = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
store = {spawn}
while not go.exists():
    time.sleep(0.001)
if op == "put":
    r = store.put(Path(arg))
    print(json.dumps({{"digest": r.digest, "created": r.created}}))
else:
    print(json.dumps({{"created": store.create_record(arg, data.encode())}}))
"""


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Move the stores' idea of "now" forward (blob stamps already set stay where they are)."""
    real = time.time
    offset = [0.0]
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])

    def advance(seconds: float) -> None:
        offset[0] += seconds

    return advance


class BlobStoreConformance:
    spawn: str | None = None  # e.g. "LocalDirBlobStore(root)"

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:  # overridden by every subclass
        raise NotImplementedError
        yield

    @pytest.fixture
    def clock(self, monkeypatch: pytest.MonkeyPatch) -> Clock:
        return make_clock(monkeypatch)

    @staticmethod
    def src(blobs: BlobStore, data: bytes, name: str = "src") -> Path:
        """A finished file where an importer builds one: the store's scratch directory."""
        path = blobs.tmp_dir / f"{name}-{os.urandom(4).hex()}"
        path.write_bytes(data)
        return path

    # -- blobs --------------------------------------------------------------------------------

    def test_put_stores_under_sha256(self, blobs: BlobStore) -> None:
        data = os.urandom(10_000)
        res = blobs.put(self.src(blobs, data))
        assert (res.digest, res.size, res.created) == (digest_of(data), len(data), True)
        assert blobs.exists(res.digest) and blobs.size(res.digest) == len(data)
        st = blobs.stat(res.digest)
        assert st is not None and st.size == len(data) and abs(st.mtime - time.time()) < 60
        path = blobs.path(res.digest)
        assert path.read_bytes() == data  # a local path the kernel can read in place
        assert blobs.list_digests() == [res.digest]
        blobs.verify(res.digest)

    def test_missing_blob(self, blobs: BlobStore) -> None:
        missing = digest_of(b"never stored")
        assert not blobs.exists(missing) and blobs.stat(missing) is None
        assert not blobs.path(missing).exists()
        assert not blobs.touch(missing) and not blobs.delete(missing)
        with pytest.raises(LayerNotFound):
            blobs.size(missing)
        with pytest.raises(LayerNotFound):
            blobs.verify(missing)
        with pytest.raises(InvalidRequest):
            blobs.path("sha256:../../etc/passwd")

    def test_same_content_twice_is_one_blob_never_replaced(self, blobs: BlobStore) -> None:
        data = b"layer bytes" * 1000
        first = blobs.put(self.src(blobs, data, "a"))
        inode = os.stat(blobs.path(first.digest)).st_ino
        second = blobs.put(self.src(blobs, data, "b"))
        assert first.digest == second.digest and first.created and not second.created
        assert os.stat(blobs.path(first.digest)).st_ino == inode
        assert blobs.list_digests() == [first.digest]

    def test_put_does_not_replace_even_a_damaged_blob(self, blobs: BlobStore) -> None:
        data = bytes(range(256)) * 64
        digest = blobs.put(self.src(blobs, data)).digest
        path = blobs.path(digest)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:  # same size, one byte flipped
            f.seek(100)
            f.write(bytes([data[100] ^ 0xFF]))
        assert not blobs.put(self.src(blobs, data)).created
        with pytest.raises(InfraFailure) as exc:
            blobs.verify(digest)
        assert (
            exc.value.reason == "corrupt" and digest in exc.value.message and "corrupt" in exc.value.message
        )

    def test_verify_detects_a_flipped_byte(self, blobs: BlobStore) -> None:
        data = os.urandom(5000)
        digest = blobs.put(self.src(blobs, data)).digest
        blobs.verify(digest)
        path = blobs.path(digest)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.seek(4321)
            f.write(bytes([data[4321] ^ 0x01]))
        with pytest.raises(InfraFailure, match="corrupt") as exc:
            blobs.verify(digest)
        assert exc.value.reason == "corrupt"

    def test_put_with_wrong_expected_digest(self, blobs: BlobStore) -> None:
        wrong = digest_of(b"something else")
        with pytest.raises(InfraFailure) as exc:
            blobs.put(self.src(blobs, b"content"), expected=wrong)
        assert exc.value.reason == "corrupt" and not blobs.list_digests()
        assert blobs.put(self.src(blobs, b"content"), expected=digest_of(b"content")).created

    def test_concurrent_thread_puts_store_one_blob(self, blobs: BlobStore) -> None:
        data = os.urandom(200_000)
        srcs = [self.src(blobs, data, f"t{i}") for i in range(8)]
        results, errors = [], []
        barrier = threading.Barrier(len(srcs))

        def work(src: Path) -> None:
            try:
                barrier.wait()
                results.append(blobs.put(src))
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=work, args=(s,)) for s in srcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert {r.digest for r in results} == {digest_of(data)}
        assert sum(r.created for r in results) == 1
        assert blobs.list_digests() == [digest_of(data)]
        blobs.verify(digest_of(data))

    def _race_processes(
        self, blobs: BlobStore, tmp_path: Path, jobs: list[tuple[str, str, str]]
    ) -> list[dict]:
        assert self.spawn is not None, "a store that cannot be opened elsewhere drops the process tests"
        go = tmp_path / "go"
        script = _CHILD.format(spawn=self.spawn)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(blobs.root), str(go), op, arg, data],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for op, arg, data in jobs
        ]
        time.sleep(0.5)  # let them all start and wait at the line
        go.touch()
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout))
        return out

    def test_concurrent_process_puts_store_one_blob(self, blobs: BlobStore, tmp_path: Path) -> None:
        data = os.urandom(300_000)
        srcs = [self.src(blobs, data, f"p{i}") for i in range(6)]
        results = self._race_processes(blobs, tmp_path, [("put", str(s), "") for s in srcs])
        assert {r["digest"] for r in results} == {digest_of(data)}
        assert sum(r["created"] for r in results) == 1
        assert blobs.list_digests() == [digest_of(data)]
        blobs.verify(digest_of(data))

    def test_delete_spares_recent_blobs(self, blobs: BlobStore, clock: Clock) -> None:
        digest = blobs.put(self.src(blobs, b"young")).digest
        assert not blobs.delete(digest, min_age=600)  # just put: an import may be tagging it
        clock(700)
        assert blobs.delete(digest, min_age=600)
        assert not blobs.exists(digest) and blobs.list_digests() == []
        assert not blobs.path(digest).exists()
        assert not blobs.delete(digest)

    def test_touch_and_put_refresh_the_stamp(self, blobs: BlobStore, clock: Clock) -> None:
        a = blobs.put(self.src(blobs, b"a")).digest
        b = blobs.put(self.src(blobs, b"b")).digest
        clock(700)
        assert blobs.touch(a)
        assert not blobs.put(self.src(blobs, b"b")).created  # a put of stored content refreshes too
        assert not blobs.delete(a, min_age=600) and not blobs.delete(b, min_age=600)
        assert blobs.exists(a) and blobs.exists(b)
        clock(700)
        assert blobs.delete(a, min_age=600) and blobs.delete(b, min_age=600)

    def test_put_after_delete_stores_again(self, blobs: BlobStore) -> None:
        digest = blobs.put(self.src(blobs, b"again")).digest
        assert blobs.delete(digest)
        assert blobs.put(self.src(blobs, b"again")).created
        assert blobs.path(digest).read_bytes() == b"again"

    def test_sweep_keeps_blobs_and_records(self, blobs: BlobStore) -> None:
        digest = blobs.put(self.src(blobs, b"kept")).digest
        blobs.create_record("a/b", b"1")
        assert blobs.sweep(0) >= 0
        assert blobs.list_digests() == [digest] and blobs.read_record("a/b") == b"1"

    # -- records ------------------------------------------------------------------------------

    def test_records_create_is_exclusive(self, blobs: BlobStore) -> None:
        assert blobs.read_record("tags/x/1.json") is None
        assert blobs.create_record("tags/x/1.json", b"first")
        assert not blobs.create_record("tags/x/1.json", b"second")
        assert blobs.read_record("tags/x/1.json") == b"first"

    def test_records_replace_read_list_delete(self, blobs: BlobStore) -> None:
        blobs.replace_record("tags/x/1.json", b"one")  # replace also creates
        blobs.replace_record("tags/x/1.json", b"two")
        assert blobs.read_record("tags/x/1.json") == b"two"
        blobs.create_record("tags/y/2.json", b"")
        blobs.create_record("tags/team%2Fy/3.json", b"3")
        blobs.create_record("refs/abc/x/1", b"")
        assert blobs.list_records("tags") == ["tags/team%2Fy/3.json", "tags/x/1.json", "tags/y/2.json"]
        assert blobs.list_records("tags/x") == ["tags/x/1.json"]
        assert blobs.list_records("nothing/here") == []
        assert blobs.read_record("tags/y/2.json") == b""
        assert blobs.delete_record("tags/x/1.json") and not blobs.delete_record("tags/x/1.json")
        assert blobs.read_record("tags/x/1.json") is None
        assert blobs.list_records("tags/x") == []

    def test_record_version_changes_with_each_write(self, blobs: BlobStore) -> None:
        key = "tags/v/1.json"
        assert blobs.record_version(key) is None
        assert blobs.create_record(key, b"first")
        v1 = blobs.record_version(key)
        assert v1 is not None and blobs.record_version(key) == v1  # stable while unchanged
        assert not blobs.create_record(key, b"other")  # refused: no new version
        assert blobs.record_version(key) == v1
        blobs.replace_record(key, b"first")  # the same bytes again are still a new version
        v2 = blobs.record_version(key)
        assert v2 is not None and v2 != v1
        blobs.replace_record(key, b"second")
        assert blobs.record_version(key) not in (v1, v2, None)
        assert blobs.delete_record(key)
        assert blobs.record_version(key) is None
        assert blobs.create_record(key, b"again")
        assert blobs.record_version(key) is not None

    @pytest.mark.parametrize(
        "key", ["", "/abs", "a//b", "../x", "a/../b", "a/./b", ".hidden", "a/.b", "a b", "a/"]
    )
    def test_record_keys_are_not_paths(self, blobs: BlobStore, key: str) -> None:
        for call in (
            lambda: blobs.create_record(key, b""),
            lambda: blobs.replace_record(key, b""),
            lambda: blobs.read_record(key),
            lambda: blobs.delete_record(key),
        ):
            with pytest.raises(InvalidRequest):
                call()

    def test_concurrent_thread_creates_have_one_winner(self, blobs: BlobStore) -> None:
        wins: list[int] = []
        barrier = threading.Barrier(8)

        def work(i: int) -> None:
            barrier.wait()
            if blobs.create_record("tags/race/1.json", f"writer {i}".encode()):
                wins.append(i)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert blobs.read_record("tags/race/1.json") == f"writer {wins[0]}".encode()
        assert blobs.list_records("tags/race") == ["tags/race/1.json"]

    def test_concurrent_process_creates_have_one_winner(self, blobs: BlobStore, tmp_path: Path) -> None:
        jobs = [("record", "tags/race/1.json", f"writer {i}") for i in range(6)]
        results = self._race_processes(blobs, tmp_path, jobs)
        winners = [i for i, r in enumerate(results) if r["created"]]
        assert len(winners) == 1
        assert blobs.read_record("tags/race/1.json") == f"writer {winners[0]}".encode()
