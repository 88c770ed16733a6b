"""Per-node layer mounts: each layer mounted once, shared by every sandbox that uses it.

A layer is mounted at ``<mount_root>/<hex>`` on first use and stays mounted when its last user
releases it: one superblock per layer is what lets all sandboxes share its page cache, and
remounting a hot layer for every sandbox would throw that away. Idle mounts are removed only
by an explicit :meth:`LayerMounts.unmount_unused` (e.g. under disk or memory pressure).

:meth:`LayerMounts.acquire_layer` mounts a layer of a :class:`~dsec.images.store.LayerStore`
in either format, and refuses one whose bytes are not what its digest says:

* ``single`` (one EROFS image): the whole image is hashed the first time this process mounts
  it, and the (digest, device, inode, size, mtime) that passed is remembered, so remounting
  it later costs nothing. That reads the image once per node: cheap on local disk, and the
  reason a shared store defaults to the split format.
* ``split`` (META + data blob, :mod:`dsec.images.ondemand`): META, small, is copied once into
  a node-local cache (``<meta_dir>/<hex>.meta``, default ``<mount_root>/../layer-meta``) and
  hashed while it is copied; a copy whose hash is not the layer's digest is discarded, never
  mounted. Then the data blob's size is checked against META (one stat) and the kernel mounts
  the local META with the data blob read in place on the store, page by page as files are
  read. The data blob's *content* is not hashed at mount (that would read all of it, which is
  what on demand avoids): a truncated or swapped blob is caught by the size check, a flipped
  byte inside it is not, until :meth:`LayerStore.verify` re-hashes it. META's digest covers
  the data blob's digest and size (they are stamped into META), so the layer's identity does
  cover its data.

Mounts outlive the process: after an edge restart the constructor adopts the ones it finds
under ``mount_root`` with a reference count of zero (both formats: a split layer's mount keeps
its META and data blob open). The edge must re-acquire the layers of the sandboxes it recovers
from its journal *before* calling ``unmount_unused``.

Mounting is a sub-millisecond syscall (0.4-1.5 ms measured here); the first mount of a layer
on a node adds its check (copying META, or hashing a single image). The methods are plain sync
methods; async callers may call them directly or through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.images._pagecache import cache_use
from dsec.images.blobstore import corrupt
from dsec.images.layer_reads import ReadScan, ReadScanner
from dsec.images.mount import find_mount, mount_erofs, read_mountinfo, umount
from dsec.images.ondemand import mount_split, probe_split, read_split_info
from dsec.images.refs import digest_hex, make_digest
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, LayerNotFound

if TYPE_CHECKING:
    from dsec.images.store import LayerStore

# Node-local on purpose: the blob store may be a shared filesystem, mount points may not be.
DEFAULT_MOUNT_ROOT = Path("/run/dsec/layers")
META_DIR_NAME = "layer-meta"  # beside the mount root: the local copies of split layers' META

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class OnDemandUse:
    """The node's split layers mounted, their data blobs' bytes, and how much of those this
    node's page cache holds (``cached``) or held and evicted (``evicted``): see
    :meth:`LayerMounts.ondemand_use`."""

    layers: int
    data_bytes: int
    cached_bytes: int
    evicted_bytes: int
    read: ReadScan | None = None  # their files' page cache, by the last background scan


class LayerMounts:
    def __init__(self, mount_root: Path = DEFAULT_MOUNT_ROOT, *, meta_dir: Path | None = None) -> None:
        """``meta_dir``: node-local directory for split layers' META copies (default:
        ``layer-meta`` beside ``mount_root``)."""
        mount_root.mkdir(parents=True, exist_ok=True)
        self.mount_root = Path(os.path.realpath(mount_root))
        self.meta_dir = Path(meta_dir) if meta_dir is not None else self.mount_root.parent / META_DIR_NAME
        self.meta_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}  # hex digest -> users in this process
        # Single images hashed by this process: (hex digest, st_dev, st_ino, size, mtime_ns).
        self._verified: set[tuple[str, int, int, int, int]] = set()
        # Mounted layers' data blobs (split) or None (single), for the on-demand metrics.
        self._data: dict[str, tuple[Path, int] | None] = {}
        self.reads = ReadScanner(self._split_mounts)  # what sandboxes read of them, by scan
        with self._node_lock():
            self._adopt_existing()
            self._prune_meta()

    def _adopt_existing(self) -> None:
        root = os.fspath(self.mount_root)
        for entry in read_mountinfo():
            parent, _, name = entry.mount_point.rpartition("/")
            if parent == root and entry.fstype == "erofs" and _HEX64.match(name):
                self._refs.setdefault(name, 0)

    def _prune_meta(self) -> None:
        """Drop META copies of layers not mounted (a reboot, a crash) and unfinished copies.
        Under the node lock: no other process is copying or mounting meanwhile."""
        for entry in os.scandir(self.meta_dir):
            hexdigest = entry.name.removesuffix(".meta")
            unfinished = entry.name.startswith(".") and entry.name.endswith(".tmp")
            if unfinished or (_HEX64.match(hexdigest) and hexdigest not in self._refs):  # (adopted)
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)

    @contextmanager
    def _node_lock(self) -> Iterator[None]:
        # Serialises check-then-mount with other processes on this node (a CLI next to the
        # edge): two concurrent mounts on one directory would stack instead of failing.
        fd = os.open(self.mount_root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def path_for(self, digest: str) -> Path:
        return self.mount_root / digest_hex(digest)

    def meta_path(self, digest: str) -> Path:
        """Where this node keeps its verified copy of a split layer's META."""
        return self.meta_dir / f"{digest_hex(digest)}.meta"

    def acquire_layer(self, store: LayerStore, digest: str) -> Path:
        """Mount layer ``digest`` of ``store`` (either format) if this node has not yet, count
        one more user; returns the mount.

        InfraFailure(reason="corrupt") if the layer's bytes are not what its digest says (see
        the module doc for what is checked per format), reason="storage" if a blob is missing
        or the mount fails. Nothing is mounted then.
        """
        mounted = self._acquire(digest, lambda target: self._mount_from_store(store, digest, target))
        self._note_data(store, digest)
        return mounted

    def acquire(self, digest: str, blob_path: Path) -> Path:
        """Like :meth:`acquire_layer` for a single-format image at ``blob_path``."""
        return self._acquire(digest, lambda target: self._mount_single(digest, blob_path, target))

    def _acquire(self, digest: str, do_mount: Callable[[Path], None]) -> Path:
        hexdigest = digest_hex(digest)
        target = self.mount_root / hexdigest
        with self._lock:
            if hexdigest in self._refs:
                self._refs[hexdigest] += 1
                return target
            with self._node_lock():
                if find_mount(target) is None:
                    target.mkdir(exist_ok=True)
                    try:
                        do_mount(target)
                    except BaseException:
                        with suppress(OSError):
                            target.rmdir()
                        raise
            self._refs[hexdigest] = 1
            return target

    # -- mounting one layer (under both locks) --------------------------------------------------

    def _mount_from_store(self, store: LayerStore, digest: str, target: Path) -> None:
        blob = store.blob_path(digest)
        try:
            split = store.split_info(digest)
        except LayerNotFound:
            raise InfraFailure(
                f"layer blob {blob} for {digest} is missing", reason=InfraReason.storage
            ) from None
        except InfraFailure:
            self._verify_single(digest, blob)  # corrupt rather than "not a layer", if it is
            raise
        if split is None:
            self._mount_single(digest, blob, target)
        else:
            self._mount_split(store, digest, target)

    def _mount_single(self, digest: str, blob: Path, target: Path) -> None:
        self._verify_single(digest, blob)
        try:
            is_split = probe_split(blob) is not None
        except (InvalidRequest, OSError) as err:
            raise InfraFailure(f"cannot mount layer {digest}: {err}", reason=InfraReason.storage) from err
        if is_split:
            # Without its data blob the kernel would mount it and read garbage.
            raise InvalidRequest(f"layer {digest} is a split layer: mount it with acquire_layer")
        try:
            mount_erofs(blob, target)
        except OSError as err:
            raise InfraFailure(f"cannot mount layer {digest}: {err}", reason=InfraReason.storage) from err

    def _verify_single(self, digest: str, blob: Path) -> None:
        """Hash the whole image once per process (per inode, size and mtime)."""
        hexdigest = digest_hex(digest)
        try:
            f = open(blob, "rb")  # closed below: fstat and hash the same open file
        except FileNotFoundError:
            raise InfraFailure(
                f"layer blob {blob} for {digest} is missing", reason=InfraReason.storage
            ) from None
        except OSError as err:
            raise InfraFailure(f"cannot read layer blob {blob}: {err}", reason=InfraReason.storage) from err
        with f:
            st = os.fstat(f.fileno())
            key = (hexdigest, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key in self._verified:
                return
            h = hashlib.sha256()
            try:
                while chunk := f.read(_COPY_CHUNK):
                    h.update(chunk)
            except OSError as err:
                raise InfraFailure(
                    f"cannot read layer blob {blob}: {err}", reason=InfraReason.storage
                ) from err
        if h.hexdigest() != hexdigest:
            raise corrupt(digest, h.hexdigest(), blob)
        self._verified.add(key)

    def _mount_split(self, store: LayerStore, digest: str, target: Path) -> None:
        meta = self._local_meta(store.blob_path(digest), digest)
        info = read_split_info(meta)  # from the verified copy, not from the store
        data = store.blob_path(info.blob_digest)
        try:
            size = os.stat(data).st_size
        except FileNotFoundError:
            raise InfraFailure(
                f"data blob {data} of split layer {digest} is missing", reason=InfraReason.storage
            ) from None
        except OSError as err:
            raise InfraFailure(
                f"cannot stat data blob {data} of layer {digest}: {err}", reason=InfraReason.storage
            ) from err
        if size != info.blob_size:
            raise InfraFailure(
                f"data blob {info.blob_digest} of split layer {digest} has {size} bytes, its META "
                f"expects {info.blob_size} (truncated or replaced): delete it and import the layer again",
                reason=InfraReason.corrupt,
            )
        mount_split(meta, data, target)
        self._data[digest_hex(digest)] = (data, info.blob_size)

    def _note_data(self, store: LayerStore, digest: str) -> None:
        """Remember an adopted split layer's data blob (a restart: its local META is there)."""
        hexdigest = digest_hex(digest)
        if hexdigest in self._data:
            return
        meta = self.meta_path(digest)
        try:
            info = read_split_info(meta) if meta.is_file() else None
        except (InvalidRequest, OSError):
            info = None
        self._data[hexdigest] = None if info is None else (store.blob_path(info.blob_digest), info.blob_size)

    def ondemand_use(self) -> OnDemandUse:
        """What the split layers mounted here hold of their data, read now: one ``cachestat``
        per data blob (``dsec_ondemand_*`` metrics). The kernel reads a data blob through its
        page cache, so its cached pages are what this node fetched from the shared store (and
        its readahead with it) and still holds; evicted pages were fetched and dropped since.
        A layer mounted by another process and not acquired here is not counted. What the
        sandboxes read of the layers' files comes from :attr:`reads`' last scan, and a stale one
        starts the next (in the background: a later call reports it)."""
        self.reads.refresh()
        with self._lock:
            split = [data for h, data in self._data.items() if data is not None and h in self._refs]
        blobs = set(split)  # two layers may share one data blob: its pages are counted once
        cached = evicted = 0
        for path, _ in blobs:
            use = cache_use(path)
            if use is not None:
                cached += use.cached
                evicted += use.evicted
        return OnDemandUse(len(split), sum(size for _, size in blobs), cached, evicted, self.reads.last)

    def _split_mounts(self) -> list[Path]:
        """Where the split layers in use here are mounted (what :attr:`reads` scans)."""
        with self._lock:
            return [
                self.mount_root / h
                for h, data in self._data.items()
                if data is not None and self._refs.get(h)
            ]

    def _local_meta(self, src: Path, digest: str) -> Path:
        """The node-local copy of META, made (and hashed while copied) on first use."""
        local = self.meta_path(digest)
        if local.is_file():  # only ever renamed into place after its hash matched
            return local
        hexdigest = digest_hex(digest)
        tmp = self.meta_dir / f".{hexdigest}.{os.getpid()}.{threading.get_ident()}.tmp"
        h = hashlib.sha256()
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while chunk := fin.read(_COPY_CHUNK):
                    h.update(chunk)
                    fout.write(chunk)
                fout.flush()
                os.fsync(fout.fileno())
            if h.hexdigest() != hexdigest:
                raise corrupt(digest, h.hexdigest(), src)
            os.chmod(tmp, 0o444)
            os.rename(tmp, local)
        except FileNotFoundError as err:
            if err.filename == os.fspath(src):
                raise InfraFailure(
                    f"layer blob {src} for {digest} is missing", reason=InfraReason.storage
                ) from None
            raise InfraFailure(
                f"cannot copy META of layer {digest}: {err}", reason=InfraReason.storage
            ) from err
        except OSError as err:
            raise InfraFailure(
                f"cannot copy META of layer {digest}: {err}", reason=InfraReason.storage
            ) from err
        finally:
            with suppress(FileNotFoundError):
                tmp.unlink()
        return local

    def release(self, digest: str) -> None:
        """One user fewer. The mount stays (see the module doc)."""
        hexdigest = digest_hex(digest)
        with self._lock:
            count = self._refs.get(hexdigest, 0)
            if count <= 0:
                raise ValueError(f"release of layer {digest} that has no users")
            self._refs[hexdigest] = count - 1

    def refcount(self, digest: str) -> int:
        with self._lock:
            return self._refs.get(digest_hex(digest), 0)

    def mounted(self) -> dict[str, int]:
        """Every layer mounted by (or adopted into) this instance, by digest, with its users."""
        with self._lock:
            return {make_digest(h): n for h, n in self._refs.items()}

    def _unmount(self, hexdigest: str, lazy: bool) -> None:
        target = self.mount_root / hexdigest
        # Loop: a crash between check and mount in an older process could have stacked two.
        while find_mount(target) is not None:
            with self.reads.guard:  # not while the read scan holds it (:mod:`.layer_reads`)
                umount(target, lazy=lazy)
        try:
            target.rmdir()
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
                raise
        self._data.pop(hexdigest, None)
        # A (lazily) detached mount keeps its META open; the next mount copies it again.
        with suppress(FileNotFoundError):
            (self.meta_dir / f"{hexdigest}.meta").unlink()

    def unmount_unused(self) -> list[str]:
        """Unmount every layer without users; returns their digests. Busy ones are skipped."""
        done = []
        with self._lock, self._node_lock():
            for hexdigest, count in list(self._refs.items()):
                if count > 0:
                    continue
                try:
                    self._unmount(hexdigest, lazy=False)
                except OSError as err:
                    if err.errno == errno.EBUSY:  # still used outside our accounting
                        continue
                    raise InfraFailure(
                        f"cannot unmount layer {hexdigest}: {err}", reason=InfraReason.storage
                    ) from err
                del self._refs[hexdigest]
                done.append(make_digest(hexdigest))
        return done

    def unmount_all(self, lazy: bool = False) -> None:
        """Unmount every layer, used or not (node shutdown, tests). Raises the first failure."""
        first: OSError | None = None
        with self._lock, self._node_lock():
            self._adopt_existing()  # also what another process mounted since we started
            for hexdigest in list(self._refs):
                try:
                    self._unmount(hexdigest, lazy=lazy)
                except OSError as err:
                    first = first or err
                    continue
                del self._refs[hexdigest]
        if first is not None:
            raise InfraFailure(f"cannot unmount every layer: {first}", reason=InfraReason.storage) from first


def mount_stored_layer(store: LayerStore, digest: str, target: Path) -> None:
    """Mount layer ``digest`` of ``store``, either format, at ``target`` for a short job (e.g.
    merging layers): no reference count, no local META copy (META is read in place), no hash
    check. A split layer must never be mounted as a plain image (it would read garbage)."""
    split = store.split_info(digest)
    blob = store.blob_path(digest)
    if split is not None:
        mount_split(blob, store.blob_path(split.blob_digest), target)
        return
    try:
        mount_erofs(blob, target)
    except OSError as err:
        raise InfraFailure(f"cannot mount layer {digest}: {err}", reason=InfraReason.storage) from err
