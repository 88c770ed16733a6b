"""Blob stores: where layer images and the layer catalogue live.

The :class:`BlobStore` Protocol is the seam (narrow, like containerd's snapshotter). The layer
store (:mod:`dsec.images.store`) and its file catalogue (:mod:`dsec.images.catalogue`) need
only this from it:

* **blobs**, immutable files named by the sha256 of their bytes: ``put`` a finished file (never
  replacing a blob that is already there), ``path`` (a local POSIX path the kernel reads in
  place: on a shared mount that path is on the mount, so only the pages touched travel),
  ``exists``/``stat``/``size``, ``touch`` (refresh the last-use stamp that protects a blob from
  garbage collection), ``delete`` (only if not touched for ``min_age`` seconds), ``list_digests``,
  ``verify`` (re-hash);
* **records**, small files under "/"-separated keys: atomic create-if-absent, atomic replace,
  read, list, delete. They are all a catalogue needs, on any POSIX filesystem.

Implementations:

* :class:`LocalDirBlobStore` - a directory on local disk (the embedded default);
* :class:`SharedMountBlobStore` - the same layout on a POSIX mount of a shared filesystem (NFS,
  CephFS, JuiceFS, 3FS) that every node mounts, so every node sees the same layers;
* :class:`FakeBlobStore` - in memory (a temp directory backs ``path``), for tests.

Layout of a directory store (both POSIX implementations)::

    dsec-store.json                 marker: this directory is a DSec store (layout version)
    blobs/sha256/<hex>.erofs        immutable blobs, mode 0444; mtime = last put/touch
    catalogue/<key>                 small records (see dsec.images.catalogue for the keys)
    tmp/                            scratch on the same filesystem (imports in progress)

Correctness never relies on flock/fcntl locks or SQLite (both are unreliable on network
filesystems). Every publication is "write a hidden temporary, fsync, then make it visible with
one atomic step that fails if the name exists": ``link(2)`` (EEXIST), or where a filesystem has
no hard links ``renameat2(RENAME_NOREPLACE)``, or as a last resort a claim file created with
``O_CREAT|O_EXCL`` around a plain ``rename(2)``. Replacing a record is ``rename(2)`` over it.
Readers therefore only ever see absent or complete files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from dsec.images.refs import digest_hex, make_digest
from dsec.protocol.errors import InfraFailure, InvalidRequest, LayerNotFound

log = logging.getLogger(__name__)

BLOB_SUFFIX = ".erofs"
MARKER = "dsec-store.json"
LAYOUT_VERSION = 1

# Record keys: "/"-separated components of a safe character set, never starting with "." (the
# stores' own temporaries start with "." and are thereby invisible to listings).
_KEY_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_%+=-][A-Za-z0-9._%+=-]{0,254}$")
_BLOB_NAME_RE = re.compile(r"^([0-9a-f]{64})" + re.escape(BLOB_SUFFIX) + r"$")

# A claim file (last-resort exclusive publication) older than this is from a crashed writer.
_STALE_CLAIM_S = 60.0
_CLAIM_WAIT_S = 120.0


@dataclass(frozen=True)
class PutResult:
    digest: str
    size: int
    created: bool  # False: the blob was already stored (its stamp was refreshed instead)


@dataclass(frozen=True)
class BlobStat:
    size: int
    mtime: float  # time of the last put or touch: garbage collection spares recent blobs


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed blobs plus small records; safe for many processes on many nodes."""

    root: Path  # where the store lives (messages, and the legacy catalogue next to it)
    blob_dir: Path  # the directory ``path`` points into
    tmp_dir: Path  # scratch on the store's filesystem: files built here are put by a link

    def put(self, src: Path, expected: str | None = None) -> PutResult:
        """Store the finished file ``src`` under the sha256 of its bytes.

        Never replaces a stored blob: if the content is already there, only its stamp is
        refreshed (``created`` is False). ``src`` may be linked or moved into the store (its mode
        becomes 0444); the caller removes it if it still exists. ``expected`` (a digest), if
        given, must match or InfraFailure(reason="corrupt") is raised.
        """
        ...

    def path(self, digest: str) -> Path:
        """A local path the kernel can read the blob from in place (it may not exist)."""
        ...

    def exists(self, digest: str) -> bool: ...

    def stat(self, digest: str) -> BlobStat | None: ...

    def size(self, digest: str) -> int:
        """The blob's size; LayerNotFound if it is not stored."""
        ...

    def touch(self, digest: str) -> bool:
        """Refresh the blob's stamp (it counts as just put); False if it is not stored."""
        ...

    def delete(self, digest: str, *, min_age: float = 0.0) -> bool:
        """Remove the blob unless it was put or touched less than ``min_age`` s ago.

        A put or touch that races with the delete wins: the blob is then kept. Returns whether
        the blob was removed.
        """
        ...

    def list_digests(self) -> list[str]:
        """Every stored blob's digest, sorted."""
        ...

    def verify(self, digest: str) -> None:
        """Re-hash the blob: InfraFailure(reason="corrupt") on mismatch, LayerNotFound if absent."""
        ...

    def sweep(self, min_age: float) -> int:
        """Clean up temporaries that crashed writers left behind, older than ``min_age`` s."""
        ...

    # -- records -----------------------------------------------------------------------------

    def create_record(self, key: str, data: bytes) -> bool:
        """Atomically create record ``key`` unless it exists; True if this call created it."""
        ...

    def replace_record(self, key: str, data: bytes) -> None:
        """Atomically create or replace record ``key`` (readers see the old or the new bytes)."""
        ...

    def read_record(self, key: str) -> bytes | None: ...

    def list_records(self, prefix: str) -> list[str]:
        """Keys of every record below the key prefix ``prefix`` (a directory), sorted."""
        ...

    def delete_record(self, key: str) -> bool: ...


# ---- helpers ------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def key_parts(key: str) -> list[str]:
    """Validate a record key and split it; InvalidRequest for anything path-like or unsafe."""
    parts = key.split("/")
    if not key or not all(_KEY_COMPONENT_RE.match(p) for p in parts):
        raise InvalidRequest(
            f"invalid record key {key!r}: '/'-separated components of A-Za-z0-9._%+=- "
            "that do not start with '.'"
        )
    return parts


def corrupt(digest: str, actual_hex: str, where: Path | str) -> InfraFailure:
    return InfraFailure(
        f"layer blob {digest} is corrupt: its bytes hash to sha256:{actual_hex} (at {where}); "
        "delete the blob and import the layer again",
        reason="corrupt",
    )


def _token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(6)}"


def _fsync_dir(path: Path) -> None:
    """Make a directory entry durable where the filesystem supports it (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # EINVAL on some FUSE and network filesystems: nothing to do there
        pass
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def _rename_noreplace(src: Path, dst: Path) -> None:
    """``rename`` that fails with EEXIST instead of replacing ``dst`` (Linux renameat2)."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EACCES)
_NO_NOREPLACE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def publish_exclusive(tmp: Path, final: Path) -> bool:
    """Make the complete file ``tmp`` visible as ``final`` unless ``final`` exists.

    Returns True if ``final`` is now ``tmp``'s inode, False if ``final`` already existed.
    ``tmp`` is left in place when linked, moved otherwise; the caller unlinks it if present.
    """
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        # NFS: a retransmitted LINK whose first attempt succeeded reports EEXIST (open(2)'s
        # advice for O_EXCL on NFS: check the link count of the file you linked).
        with contextlib.suppress(OSError):
            a, b = os.stat(tmp), os.stat(final)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                return True
        return False
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise
    try:
        _rename_noreplace(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno not in _NO_NOREPLACE:
            raise
    return _publish_with_claim(tmp, final)


def _publish_with_claim(tmp: Path, final: Path) -> bool:
    """Last resort: an O_EXCL claim file serialises the check-then-rename (no locks)."""
    claim = final.with_name(f".{final.name}.claim")
    deadline = time.monotonic() + _CLAIM_WAIT_S
    while True:
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if final.exists():
                return False
            with contextlib.suppress(FileNotFoundError):
                if time.time() - os.stat(claim).st_mtime > _STALE_CLAIM_S:
                    log.warning("removing stale claim %s (a writer crashed)", claim)
                    claim.unlink()
                    continue
            if time.monotonic() > deadline:
                raise InfraFailure(f"timed out waiting for the claim {claim}", reason="storage") from None
            time.sleep(0.01)
            continue
        os.close(fd)
        try:
            if final.exists():
                return False
            os.rename(tmp, final)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                claim.unlink()


# ---- POSIX directory stores -----------------------------------------------------------------


class _DirBlobStore:
    """The layout and algorithms shared by the local and the shared-mount stores."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs" / "sha256"
        self.tmp_dir = self.root / "tmp"
        self.record_dir = self.root / "catalogue"

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
                    reason="storage",
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
            st = os.stat(self.path(digest))
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
            raise InfraFailure(f"could not store blob {digest} in {self.root}", reason="storage")
        except OSError as err:
            raise InfraFailure(f"storing {src} in {self.root} failed: {err}", reason="storage") from err

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
            raise InfraFailure(f"deleting blob {digest} failed: {err}", reason="storage") from err

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
            raise InfraFailure(f"reading blob {digest} failed: {err}", reason="storage") from err
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
            raise InfraFailure(f"writing catalogue record {key} failed: {err}", reason="storage") from err

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
            raise InfraFailure(f"writing catalogue record {key} failed: {err}", reason="storage") from err

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
                        f"reading catalogue record {key} failed: {err}", reason="storage"
                    ) from err
        return None  # pragma: no cover

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
            raise InfraFailure(f"deleting catalogue record {key} failed: {err}", reason="storage") from err
        return True


class LocalDirBlobStore(_DirBlobStore):
    """A directory on local disk; created if missing. The embedded default."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        try:
            self._make_dirs()
            self._write_marker()
        except OSError as err:
            raise InfraFailure(f"cannot open the layer store at {root}: {err}", reason="storage") from err


class SharedMountBlobStore(_DirBlobStore):
    """A directory on a POSIX mount of a shared filesystem, configured by its path.

    Every node that mounts the filesystem opens the same directory and sees the same blobs and
    catalogue. The directory must already exist (it is on the mount): a missing path means the
    filesystem is not mounted, and creating it would silently fill the local disk instead. A
    directory that is not yet a store (no ``dsec-store.json``) is refused unless ``create`` is
    True, so an empty mount point (the shared filesystem not mounted over it) is never taken
    for a new store by accident.

    For network filesystems with attribute caches (NFS), mount with ``lookupcache=positive``
    (or ``actimeo`` small) so that a tag created on one node is found by the others at once.
    """

    def __init__(self, root: Path, *, create: bool = False) -> None:
        super().__init__(root)
        if not self.root.is_dir():
            raise InfraFailure(
                f"shared layer store {self.root} does not exist or is not a directory: is the shared "
                "filesystem mounted?",
                reason="storage",
            )
        if not (self.root / MARKER).exists() and not create:
            raise InfraFailure(
                f"{self.root} is not a DSec layer store (no {MARKER}): is the shared filesystem "
                "mounted there? To initialise a new store on it, open it once with create=True",
                reason="storage",
            )
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise InfraFailure(f"shared layer store {self.root} is not writable", reason="storage")
        try:
            self._make_dirs()
            self._write_marker()
        except OSError as err:
            raise InfraFailure(f"cannot open the shared layer store {root}: {err}", reason="storage") from err


# ---- fake -----------------------------------------------------------------------------------------


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
            return True

    def replace_record(self, key: str, data: bytes) -> None:
        key_parts(key)
        with self._lock:
            self._records[key] = bytes(data)

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
            return self._records.pop(key, None) is not None
