"""The directory layout and algorithms shared by the local and the shared-mount blob stores."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Hashable
from pathlib import Path

from dsec.images.blobstore._publish import _fsync_dir, _token, publish_exclusive
from dsec.images.blobstore.base import (
    BLOB_SUFFIX,
    LAYOUT_VERSION,
    MARKER,
    BlobStat,
    PutResult,
    corrupt,
    key_parts,
    sha256_file,
)
from dsec.images.refs import digest_hex, make_digest
from dsec.protocol.errors import InfraFailure, InfraReason, LayerNotFound

log = logging.getLogger("dsec.images.blobstore")  # the package's logger, as before the split

_BLOB_NAME_RE = re.compile(r"^([0-9a-f]{64})" + re.escape(BLOB_SUFFIX) + r"$")


class _DirBlobStore:
    """The layout and algorithms shared by the local and the shared-mount stores."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs" / "sha256"
        self.tmp_dir = self.root / "tmp"
        self.record_dir = self.root / "catalogue"
        # Strings for the paths read on every create (a tag's version, a blob's stat): pathlib
        # joins cost more than the stat itself.
        self._record_prefix = f"{self.record_dir}/"
        self._blob_prefix = f"{self.blob_dir}/"

    def _make_dirs(self) -> None:
        for d in (self.blob_dir, self.tmp_dir, self.record_dir):
            d.mkdir(parents=True, exist_ok=True)

    def _write_marker(self) -> None:
        marker = self.root / MARKER
        if marker.exists():
            layout = json.loads(marker.read_text()).get("layout")
            if layout != LAYOUT_VERSION:
                raise InfraFailure(
                    f"{self.root} holds a DSec store of layout {layout}; this DSec reads layout "
                    f"{LAYOUT_VERSION}",
                    reason=InfraReason.storage,
                )
            return
        body = json.dumps({"layout": LAYOUT_VERSION, "created_at": time.time()}).encode()
        self._publish_small(marker, body)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # -- blobs --------------------------------------------------------------------------------

    def path(self, digest: str) -> Path:
        return self.blob_dir / f"{digest_hex(digest)}{BLOB_SUFFIX}"

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def stat(self, digest: str) -> BlobStat | None:
        try:
            st = os.stat(f"{self._blob_prefix}{digest_hex(digest)}{BLOB_SUFFIX}")
        except FileNotFoundError:
            return None
        return BlobStat(size=st.st_size, mtime=st.st_mtime)

    def size(self, digest: str) -> int:
        st = self.stat(digest)
        if st is None:
            raise LayerNotFound(f"no blob {digest} in the store at {self.root}")
        return st.size

    def touch(self, digest: str) -> bool:
        return self._touch(self.path(digest))

    @staticmethod
    def _touch(final: Path) -> bool:
        try:
            now = time.time()  # this node's clock, as gc's; the grace period absorbs skew
            os.utime(final, (now, now))
        except FileNotFoundError:
            return False
        except PermissionError:  # e.g. root squashed on NFS: the stamp stays, the blob exists
            log.debug("cannot refresh the stamp of %s", final)
        return True

    def put(self, src: Path, expected: str | None = None) -> PutResult:
        try:
            hexdigest = sha256_file(src)
            digest = make_digest(hexdigest)
            if expected is not None and expected != digest:
                raise corrupt(expected, hexdigest, src)
            size = os.stat(src).st_size
            final = self.path(digest)
            prepared = False
            for _ in range(10):
                st = self.stat(digest)
                if st is not None and self._touch(final):
                    if st.size == size:
                        return PutResult(digest, size, created=False)
                    self._discard_torn(final, st.size, size)
                    continue
                if not prepared:
                    os.chmod(src, 0o444)
                    now = time.time()  # the stamp counts from publication, not from the build
                    os.utime(src, (now, now))
                    with open(src, "rb") as f:
                        os.fsync(f.fileno())
                    prepared = True
                if self._publish_blob(src, final):
                    _fsync_dir(self.blob_dir)
                    return PutResult(digest, size, created=True)
                # lost a race with another writer of the same content: go round and touch it
            raise InfraFailure(f"could not store blob {digest} in {self.root}", reason=InfraReason.storage)
        except OSError as err:
            raise InfraFailure(
                f"storing {src} in {self.root} failed: {err}", reason=InfraReason.storage
            ) from err

    def _publish_blob(self, src: Path, final: Path) -> bool:
        try:
            return publish_exclusive(src, final)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
        # src is on another filesystem: copy it next to the blobs first, then publish the copy.
        tmp = self.blob_dir / f".put-{_token()}"
        try:
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o444)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            return publish_exclusive(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _discard_torn(self, final: Path, have: int, want: int) -> None:
        """A stored blob whose size is not its content's size was torn by some other tool."""
        log.warning("blob %s is %d bytes, its content is %d: discarding the torn copy", final, have, want)
        trash = final.with_name(f".torn-{final.name}-{_token()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, trash)
            trash.unlink()

    def delete(self, digest: str, *, min_age: float = 0.0) -> bool:
        final = self.path(digest)
        try:
            if time.time() - os.stat(final).st_mtime < min_age:
                return False
            # Move it aside first, then look at its stamp again: a put or touch that came in
            # between has refreshed it (it is the same inode) and the blob goes back.
            trash = final.with_name(f".gc-{final.name}-{_token()}")
            try:
                os.rename(final, trash)
            except FileNotFoundError:
                return False
            if time.time() - os.stat(trash).st_mtime < min_age:
                self._restore(trash, final)
                return False
            trash.unlink()
            _fsync_dir(self.blob_dir)
            return True
        except FileNotFoundError:
            return False
        except OSError as err:
            raise InfraFailure(f"deleting blob {digest} failed: {err}", reason=InfraReason.storage) from err

    @staticmethod
    def _restore(trash: Path, final: Path) -> None:
        # If a writer stored the same content meanwhile, theirs stays and this copy goes.
        publish_exclusive(trash, final)
        with contextlib.suppress(FileNotFoundError):
            trash.unlink()

    def list_digests(self) -> list[str]:
        out = []
        with os.scandir(self.blob_dir) as it:
            for entry in it:
                m = _BLOB_NAME_RE.match(entry.name)
                if m is not None:
                    out.append(f"sha256:{m.group(1)}")
        return sorted(out)

    def verify(self, digest: str) -> None:
        final = self.path(digest)
        try:
            actual = sha256_file(final)
        except FileNotFoundError:
            raise LayerNotFound(f"no blob {digest} in the store at {self.root}") from None
        except OSError as err:
            raise InfraFailure(f"reading blob {digest} failed: {err}", reason=InfraReason.storage) from err
        if actual != digest_hex(digest):
            raise corrupt(digest, actual, final)

    def sweep(self, min_age: float) -> int:
        now = time.time()
        removed = 0
        for d in [self.blob_dir, *(Path(p) for p, _, _ in os.walk(self.record_dir))]:
            entries: list[os.DirEntry[str]] = []
            with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
                entries = [e for e in it if e.name.startswith(".")]
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if now - max(st.st_mtime, st.st_ctime) < min_age:
                    continue
                path = Path(e.path)
                m = re.match(r"^\.gc-([0-9a-f]{64}" + re.escape(BLOB_SUFFIX) + r")-", e.name)
                if m is not None:
                    # A collector crashed between moving a blob aside and deciding: putting it
                    # back is always safe (the next collection decides again).
                    self._restore(path, self.blob_dir / m.group(1))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed += 1
        return removed

    # -- records ------------------------------------------------------------------------------

    def _record_path(self, key: str) -> Path:
        return self.record_dir.joinpath(*key_parts(key))

    def _publish_small(self, final: Path, data: bytes) -> bool:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{_token()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            created = publish_exclusive(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if created:
            _fsync_dir(final.parent)
        return created

    def create_record(self, key: str, data: bytes) -> bool:
        final = self._record_path(key)
        try:
            return self._publish_small(final, data)
        except OSError as err:
            raise InfraFailure(
                f"writing catalogue record {key} failed: {err}", reason=InfraReason.storage
            ) from err

    def replace_record(self, key: str, data: bytes) -> None:
        final = self._record_path(key)
        tmp = final.with_name(f".{final.name}.{_token()}.tmp")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as err:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise InfraFailure(
                f"writing catalogue record {key} failed: {err}", reason=InfraReason.storage
            ) from err

    def read_record(self, key: str) -> bytes | None:
        final = self._record_path(key)
        for attempt in range(5):
            try:
                return final.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as err:
                # ESTALE: another node replaced the file between lookup and read (NFS).
                if err.errno != errno.ESTALE or attempt == 4:
                    raise InfraFailure(
                        f"reading catalogue record {key} failed: {err}", reason=InfraReason.storage
                    ) from err
        return None  # pragma: no cover

    def record_version(self, key: str) -> Hashable | None:
        # A record is only ever published by a link or a rename of a new file, so a replace
        # always changes its inode. A delete and a create of the same size within one tick of
        # the file system's clock may reuse the inode number and show the same version: the
        # catalogue re-reads what it parsed after a bounded age for that.
        key_parts(key)  # validated: the key is then a relative path of safe components
        try:
            st = os.stat(self._record_prefix + key)
        except FileNotFoundError:
            return None
        except OSError:
            return object()  # ESTALE and the like: matches nothing, so the caller reads
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def list_records(self, prefix: str) -> list[str]:
        base = self._record_path(prefix)
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.record_dir).as_posix()
            out.extend(f"{rel}/{name}" for name in filenames if not name.startswith("."))
        return sorted(out)

    def delete_record(self, key: str) -> bool:
        try:
            self._record_path(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise InfraFailure(
                f"deleting catalogue record {key} failed: {err}", reason=InfraReason.storage
            ) from err
        return True
