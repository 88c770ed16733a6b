"""Split EROFS layers: metadata in a small local image, file data read in place from a blob.

The paper keeps layer data on the cluster's distributed filesystem and reads it on demand
("EROFS multi-device mode: the small metadata image is copied to local disk, the data image is
read in place"). With erofs-utils 1.5 and Linux >= 6.12 that is::

    mkfs.erofs -Eforce-inode-extended -U<uuid> --chunksize=<N> --blobdev=BLOB META SRC
    mount(META, target, "erofs", MS_RDONLY, "device=/abs/path/BLOB")   # both plain files

``--chunksize`` turns every regular file into a chunk-based inode whose chunk index (8 bytes
per chunk, in META) points into the extra device BLOB; directories, inodes, symlinks, xattrs
and chunk indexes stay in META. The kernel's file-backed mode accepts the extra device as a
regular *file* path as well, so no loop device is involved for either file: only the blob pages
that are actually read go to the blob's filesystem (plus that filesystem's readahead).

Determinism: META is normalised like a plain layer (:func:`dsec.images.erofs.normalize_superblock`);
BLOB holds only file data, chunk-aligned, in mkfs's (sorted) tree order, deduplicated per chunk.
We then record the blob's sha256 in META's device slot ``tag`` (a field the kernel only reads in
fscache mode, where it names the blob too) and the blob's size in ``blocks``, so the digest of
META covers the data and a truncated or swapped blob is caught by a stat() before mounting.

Caveats found while building this:
  - mkfs.erofs 1.5 does not compress chunk-based files (``-z`` is ignored with ``--chunksize``),
    so a blob is as large as its files, rounded up to 4 KiB each.
  - Mounting META *without* ``device=`` succeeds and reads garbage (the kernel then assumes a
    flattened device and reads the blob's offsets from META itself): always use
    :func:`mount_split`, which refuses to do that.
  - The legacy mount(2) option string is comma-separated, so blob paths with ``,`` are refused.
  - Readahead: with buffered reads (the default) a cold sequential read is prefetched twice,
    by the layer's bdi and by the blob filesystem's (for FUSE 128 KiB unless raised), and the
    pages are cached twice (the blob's inode and the layer's). ``directio`` drops the second
    copy and fetches closest to what was read; see bench/ondemand.py for the trade-off.

Kernels before 6.12 (no file-backed mounts) would need both files on read-only loop devices
(``mount -o device=/dev/loopB /dev/loopM``); not implemented: DSec requires file-backed mounts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec._linux import MS_RDONLY, mount, umount
from dsec.images.erofs import LAYER_UUID, MKFS, _sb_checksum, normalize_superblock
from dsec.images.mount import find_mount
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "SplitImage",
    "SplitInfo",
    "build_split",
    "is_split_image",
    "mount_split",
    "probe_split",
    "read_split_info",
    "set_read_ahead",
    "unmount_split",
    "verify_blob",
]

# 1 MiB: the chunk index costs 8 bytes per chunk in META (8 KiB per GiB of data) and a chunk is
# the unit of dedup and of one contiguous mapping; the last chunk of a file is only rounded up
# to the 4 KiB block, so a large chunk wastes no blob space. What travels per read is decided
# by readahead, not by the chunk size.
DEFAULT_CHUNK_SIZE = 1 << 20
_MIN_CHUNK = 4096  # the block size mkfs.erofs 1.5 uses on x86-64
_MAX_CHUNK = 1 << 30

_SB_OFFSET = 1024
_SB_MAGIC = 0xE0F5E1E2
_MIN_BLKSZBITS, _MAX_BLKSZBITS = 9, 16  # 512 B .. 64 KiB: what the kernel could mount
_OFF_CHECKSUM = 4
_OFF_FEATURE_COMPAT = 8
_OFF_BLKSZBITS = 12
_OFF_FEATURE_INCOMPAT = 80
_OFF_EXTRA_DEVICES = 86
_OFF_DEVT_SLOTOFF = 88
_FEATURE_COMPAT_SB_CHKSUM = 0x1
_FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
_FEATURE_INCOMPAT_DEVICE_TABLE = 0x8
_DEVT_SLOT_SIZE = 128  # struct erofs_deviceslot: u8 tag[64]; __le32 blocks; __le32 mapped_blkaddr; ...
_TAG_LEN = 64
_HEX64 = re.compile(rb"[0-9a-f]{64}")


@dataclass(frozen=True)
class SplitInfo:
    """What a split META image says about its blob."""

    blob_digest: str  # "sha256:<hex>"
    blob_size: int  # bytes
    block_size: int


@dataclass(frozen=True)
class SplitImage:
    meta: Path
    blob: Path
    meta_digest: str  # "sha256:<hex>" of META, which covers the blob digest: the layer's identity
    blob_digest: str
    meta_size: int
    blob_size: int
    chunk_size: int


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _read_block(path: Path) -> bytearray | None:
    """The first block (superblock included) of the EROFS image ``path``; None if ``path``
    is not one (no magic, truncated, or a block size EROFS does not have). Raises OSError
    (FileNotFoundError included) if it cannot be read."""
    with open(path, "rb") as f:
        head = f.read(_SB_OFFSET + 128)
        if len(head) < _SB_OFFSET + 128 or struct.unpack_from("<I", head, _SB_OFFSET)[0] != _SB_MAGIC:
            return None
        bits = head[_SB_OFFSET + _OFF_BLKSZBITS]
        if not _MIN_BLKSZBITS <= bits <= _MAX_BLKSZBITS:
            return None
        f.seek(0)
        block = bytearray(f.read(1 << bits))
    return block if len(block) == 1 << bits and len(block) > _SB_OFFSET + 128 else None


def _read_head(meta: Path) -> bytearray:
    try:
        block = _read_block(meta)
    except FileNotFoundError as err:
        raise InvalidRequest(f"EROFS metadata image {meta} does not exist") from err
    if block is None:
        raise InvalidRequest(
            f"{meta} is not an EROFS image (bad superblock magic, unexpected block size or truncated)"
        )
    return block


def _slot_offset(block: bytearray, meta: Path) -> int | None:
    """Offset of the one device slot in the first block, None for a single-device image."""
    incompat = struct.unpack_from("<I", block, _SB_OFFSET + _OFF_FEATURE_INCOMPAT)[0]
    extra = struct.unpack_from("<H", block, _SB_OFFSET + _OFF_EXTRA_DEVICES)[0]
    if not incompat & _FEATURE_INCOMPAT_DEVICE_TABLE or extra == 0:
        return None
    if extra != 1:
        raise InvalidRequest(f"{meta} has {extra} extra devices; split layers have exactly one")
    off = int(struct.unpack_from("<H", block, _SB_OFFSET + _OFF_DEVT_SLOTOFF)[0]) * _DEVT_SLOT_SIZE
    if off < _SB_OFFSET + 128 or off + _DEVT_SLOT_SIZE > len(block):
        raise InvalidRequest(f"{meta}: device table at {off} is outside the superblock's block")
    return off


def is_split_image(meta: str | os.PathLike[str]) -> bool:
    """True if ``meta`` is an EROFS image whose data lives on one extra device."""
    return _slot_offset(_read_head(Path(meta)), Path(meta)) is not None


def read_split_info(meta: str | os.PathLike[str]) -> SplitInfo:
    """The blob digest and size recorded in a META image built by :func:`build_split`."""
    meta = Path(meta)
    block = _read_head(meta)
    off = _slot_offset(block, meta)
    if off is None:
        raise InvalidRequest(f"{meta} is a single-device EROFS image, not a split layer")
    return _split_info(block, off, meta)


def probe_split(path: str | os.PathLike[str]) -> SplitInfo | None:
    """What a stored layer blob is, from its first block (one small read, nothing else):
    the :class:`SplitInfo` of a split META built by :func:`build_split`, or None for anything
    else (a single-device EROFS image, a split layer's data blob, bytes that are no image).

    InvalidRequest for an image with extra devices that :func:`build_split` did not make
    (mounting it would need devices we do not know); OSError (FileNotFoundError included) if
    ``path`` cannot be read.
    """
    path = Path(path)
    block = _read_block(path)
    if block is None:
        return None
    off = _slot_offset(block, path)
    return None if off is None else _split_info(block, off, path)


def _split_info(block: bytearray, off: int, meta: Path) -> SplitInfo:
    tag = bytes(block[off : off + _TAG_LEN])
    if not _HEX64.fullmatch(tag):
        raise InvalidRequest(f"{meta}: device slot carries no blob digest (not built by build_split)")
    hexdigest = tag.decode("ascii")
    blocks = struct.unpack_from("<I", block, off + _TAG_LEN)[0]
    blksz = 1 << block[_SB_OFFSET + _OFF_BLKSZBITS]
    return SplitInfo(blob_digest="sha256:" + hexdigest, blob_size=blocks * blksz, block_size=blksz)


def _stamp_device_slot(meta: Path, blob_digest: str, blob_size: int) -> None:
    """Write the blob's digest and block count into META's device slot, fix the checksum."""
    with open(meta, "r+b") as f:
        block = _read_head(meta)
        off = _slot_offset(block, meta)
        if off is None:
            raise InfraFailure(f"{MKFS} wrote no device table into {meta}", reason=InfraReason.storage)
        blksz = 1 << block[_SB_OFFSET + _OFF_BLKSZBITS]
        if any(block[off : off + _DEVT_SLOT_SIZE]):
            # mkfs.erofs 1.5 leaves the slot zeroed; refuse a layout we do not know.
            raise InfraFailure(
                f"{meta}: device slot is not empty; cannot stamp the blob digest with this {MKFS}",
                reason=InfraReason.storage,
            )
        if blob_size % blksz:
            raise InfraFailure(
                f"{MKFS} wrote a blob of {blob_size} bytes, not whole blocks", reason=InfraReason.storage
            )
        hexdigest = blob_digest.removeprefix("sha256:").encode("ascii")
        block[off : off + _TAG_LEN] = hexdigest
        struct.pack_into("<I", block, off + _TAG_LEN, blob_size // blksz)
        compat = struct.unpack_from("<I", block, _SB_OFFSET + _OFF_FEATURE_COMPAT)[0]
        if compat & _FEATURE_COMPAT_SB_CHKSUM:
            struct.pack_into("<I", block, _SB_OFFSET + _OFF_CHECKSUM, _sb_checksum(block))
        f.seek(0)
        f.write(block)


def build_split(
    src_dir: str | os.PathLike[str],
    meta_out: str | os.PathLike[str],
    blob_out: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> SplitImage:
    """Build a split layer of ``src_dir``: metadata at ``meta_out``, file data at ``blob_out``.

    Same tree (content, modes, owners, mtimes, xattrs) and same ``chunk_size`` give the same
    bytes in both files. Ownership, modes, mtimes, xattrs, links, device nodes and overlayfs
    whiteouts are kept as in the source tree, as with :func:`dsec.images.erofs.build_erofs`.
    """
    src, meta, blob = Path(src_dir), Path(meta_out), Path(blob_out)
    if not src.is_dir():
        raise InvalidRequest(f"cannot build a layer from {src}: not a directory")
    if chunk_size & (chunk_size - 1) or not _MIN_CHUNK <= chunk_size <= _MAX_CHUNK:
        raise InvalidRequest(
            f"chunk_size must be a power of two between {_MIN_CHUNK} and {_MAX_CHUNK}, not {chunk_size}"
        )
    if os.path.abspath(meta) == os.path.abspath(blob):
        raise InvalidRequest("meta_out and blob_out must be different files")
    mkfs = shutil.which(MKFS)
    if mkfs is None:
        raise InfraFailure(f"{MKFS} not found: install erofs-utils", reason=InfraReason.storage)
    meta.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    # $SOURCE_DATE_EPOCH would make mkfs.erofs overwrite every file's mtime (see erofs.py).
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    cmd = [
        mkfs,
        "--quiet",
        "-Eforce-inode-extended",
        f"-U{LAYER_UUID}",
        f"--chunksize={chunk_size}",
        f"--blobdev={os.fspath(blob)}",
        os.fspath(meta),
        os.fspath(src),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, env=env, check=False)
        if proc.returncode != 0:
            stderr = proc.stderr.decode(errors="replace").strip()[-4000:]
            raise InfraFailure(
                f"{MKFS} failed with exit code {proc.returncode} building {src}: {stderr or '(no output)'}",
                reason=InfraReason.storage,
            )
        if not blob.is_file():  # a tree without regular files still gets an (empty) blob
            blob.touch()
        normalize_superblock(meta)
        blob_digest, blob_size = _sha256_file(blob)
        _stamp_device_slot(meta, blob_digest, blob_size)
        meta_digest, meta_size = _sha256_file(meta)
    except BaseException:
        meta.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise
    return SplitImage(
        meta=meta,
        blob=blob,
        meta_digest=meta_digest,
        blob_digest=blob_digest,
        meta_size=meta_size,
        blob_size=blob_size,
        chunk_size=chunk_size,
    )


def verify_blob(meta: str | os.PathLike[str], blob: str | os.PathLike[str]) -> None:
    """Hash the whole blob and compare with META's record. Reads every byte: not for the
    on-demand path, but for a store that has just fetched or received a blob."""
    info = read_split_info(meta)
    digest, size = _sha256_file(Path(blob))
    if (digest, size) != (info.blob_digest, info.blob_size):
        raise InfraFailure(
            f"blob {blob} ({digest}, {size} bytes) does not belong to {meta} "
            f"({info.blob_digest}, {info.blob_size} bytes)",
            reason=InfraReason.corrupt,
        )


def mount_split(
    meta: str | os.PathLike[str],
    blob: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    directio: bool = False,
    read_ahead_kb: int | None = None,
) -> None:
    """Mount a split layer read-only at ``target``: META and BLOB both file-backed, no loop device.

    ``blob`` may live on a remote (FUSE) filesystem; it is opened once by the kernel and read
    in place, page by page, as files are read. Its size is checked against META first (one
    stat); its content is trusted (see :func:`verify_blob`).

    ``directio`` reads the blob with direct I/O: the blob's filesystem then keeps no second copy
    of the pages in its own page cache and does no readahead of its own (EROFS's readahead on
    the layer's files still applies).

    ``read_ahead_kb`` sets the layer's readahead window (see :func:`set_read_ahead`); the
    kernel default is 128 KiB.
    """
    meta_abs, blob_abs = os.path.abspath(meta), os.path.abspath(blob)
    info = read_split_info(meta_abs)
    if any(c in blob_abs for c in ",\n\0"):
        raise InvalidRequest(f"blob path {blob_abs!r} contains a comma or newline (mount(2) option syntax)")
    try:
        st = os.stat(blob_abs)
    except FileNotFoundError as err:
        raise InfraFailure(
            f"layer blob {blob_abs} for {meta_abs} is missing", reason=InfraReason.storage
        ) from err
    except OSError as err:
        raise InfraFailure(f"cannot stat layer blob {blob_abs}: {err}", reason=InfraReason.storage) from err
    if not os.path.isfile(blob_abs):
        raise InvalidRequest(f"layer blob {blob_abs} is not a regular file")
    if st.st_size != info.blob_size:
        raise InfraFailure(
            f"layer blob {blob_abs} has {st.st_size} bytes, {meta_abs} expects {info.blob_size}",
            reason=InfraReason.storage,
        )
    options = f"device={blob_abs}" + (",directio" if directio else "")
    try:
        mount(meta_abs, target, "erofs", MS_RDONLY, options)
    except OSError as err:
        hint = ""
        if err.errno == errno.EINVAL and directio:
            hint = " (this kernel may lack the erofs 'directio' option, added in Linux 6.13)"
        raise InfraFailure(
            f"cannot mount split layer {meta_abs} + {blob_abs}: {err}{hint}", reason=InfraReason.storage
        ) from err
    if read_ahead_kb is not None:
        try:
            set_read_ahead(target, read_ahead_kb)
        except BaseException:
            umount(target, lazy=True)
            raise


# FS_IOC_GETFSSYSFSPATH = _IOR(0x15, 1, struct fs_sysfs_path { __u8 len; __u8 name[128]; })
_FS_IOC_GETFSSYSFSPATH = (2 << 30) | (129 << 16) | (0x15 << 8) | 1


def _bdi_name(mountpoint: str) -> str:
    entry = find_mount(mountpoint)
    if entry is None:
        raise InvalidRequest(f"{mountpoint} is not a mount point")
    if entry.fstype == "erofs":
        # A file-backed EROFS mount has a bdi of its own, named like its sysfs entry
        # ("erofs/erofs-506" -> bdi "erofs-506"); the VFS answers this ioctl (Linux >= 6.8).
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = fcntl.ioctl(fd, _FS_IOC_GETFSSYSFSPATH, bytes(129))
        except OSError as err:
            raise InfraFailure(
                f"cannot find the bdi of {mountpoint}: {err}", reason=InfraReason.storage
            ) from err
        finally:
            os.close(fd)
        return out[1 : 1 + out[0]].decode().rpartition("/")[2]
    # FUSE (and a filesystem on a whole disk): the bdi is named after the device number.
    st = os.stat(mountpoint)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def set_read_ahead(mountpoint: str | os.PathLike[str], kib: int) -> int:
    """Set the readahead window (KiB) of the filesystem mounted at ``mountpoint``; returns the
    previous value. For a split layer's mount (it has a bdi of its own) and for the blob
    store's mount (a FUSE filesystem: its window caps what one sequential read prefetches).

    The kernel copies the window into each file when it is opened: set the store's before
    mounting layers from it (the layer opens its blob at mount time)."""
    if kib < 0:
        raise InvalidRequest(f"read-ahead must be >= 0 KiB, not {kib}")
    path = f"/sys/class/bdi/{_bdi_name(os.fspath(mountpoint))}/read_ahead_kb"
    try:
        with open(path, "r+") as f:
            old = int(f.read())
            f.seek(0)
            f.write(str(kib))
    except OSError as err:
        raise InfraFailure(
            f"cannot set read-ahead of {mountpoint} via {path}: {err}", reason=InfraReason.storage
        ) from err
    return old


def unmount_split(target: str | os.PathLike[str], *, lazy: bool = False) -> None:
    """Unmount a layer mounted by :func:`mount_split`. ``lazy`` detaches a busy mount; the blob
    stays open (and its filesystem busy) until the last user of the layer is gone."""
    entry = find_mount(target)
    if entry is None:
        raise InvalidRequest(f"{target} is not a mount point")
    if entry.fstype != "erofs":
        raise InvalidRequest(f"{target} is a {entry.fstype} mount, not a split EROFS layer")
    try:
        umount(target, lazy=lazy)
    except OSError as err:
        raise InfraFailure(
            f"cannot unmount split layer at {target}: {err}", reason=InfraReason.storage
        ) from err
