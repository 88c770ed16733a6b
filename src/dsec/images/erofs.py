"""Build EROFS layer images with ``mkfs.erofs``, byte-for-byte reproducibly.

A layer's identity is the sha256 of its image, so the same tree must always give the same bytes.
mkfs.erofs 1.5 leaves exactly two varying things in an image: the filesystem UUID (we pin it with
``-U``) and the superblock ``build_time`` (the wall clock). Its only knobs for the latter, ``-T``
and ``$SOURCE_DATE_EPOCH``, also overwrite every file's mtime with that value, which would erase
the mtimes that build tools (make, pip's caches, git's index) depend on. So we let mkfs run
normally and then zero ``build_time`` in the superblock ourselves, recomputing its checksum.

That patch is safe because we also pass ``-Eforce-inode-extended``: every inode then carries its
own mtime, and ``build_time`` (which compact inodes inherit as their mtime) is read by nothing.
Extended inodes cost 32 bytes more only for files whose mtime equals the build time, i.e. none.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

MKFS = "mkfs.erofs"

# One UUID for all layers keeps images reproducible. Overlayfs only compares lower-layer UUIDs
# for index=on/nfs_export=on, which we do not use; it then just disables those features.
LAYER_UUID = "d5ec0000-e40f-4a1e-8000-000000000001"

_SB_OFFSET = 1024
_SB_MAGIC = 0xE0F5E1E2
_FEATURE_COMPAT_SB_CHKSUM = 0x1
# struct erofs_super_block (include/erofs_fs.h): offsets relative to _SB_OFFSET
_OFF_CHECKSUM = 4
_OFF_FEATURE_COMPAT = 8
_OFF_BLKSZBITS = 12
_OFF_BUILD_TIME = 24  # __le64 build_time, then __le32 build_time_nsec


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _erofs_crc32c(data: bytes) -> int:
    # The kernel's crc32c(~0, ...): Castagnoli, seed ~0, no final inversion.
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def _sb_checksum(block: bytearray) -> int:
    region = bytearray(block[_SB_OFFSET:])
    region[_OFF_CHECKSUM : _OFF_CHECKSUM + 4] = b"\0\0\0\0"
    return _erofs_crc32c(bytes(region))


def normalize_superblock(image: Path) -> None:
    """Zero ``build_time`` in place and fix the superblock checksum (see the module doc)."""
    with open(image, "r+b") as f:
        head = bytearray(f.read(_SB_OFFSET + 128))
        if len(head) < _SB_OFFSET + 128 or struct.unpack_from("<I", head, _SB_OFFSET)[0] != _SB_MAGIC:
            raise InfraFailure(
                f"{image} is not an EROFS image (bad superblock magic)", reason=InfraReason.storage
            )
        blksz = 1 << head[_SB_OFFSET + _OFF_BLKSZBITS]
        f.seek(0)
        block = bytearray(f.read(blksz))
        if len(block) != blksz or blksz <= _SB_OFFSET:
            raise InfraFailure(f"{image}: unexpected EROFS block size {blksz}", reason=InfraReason.storage)
        has_csum = struct.unpack_from("<I", block, _SB_OFFSET + _OFF_FEATURE_COMPAT)[0]
        has_csum &= _FEATURE_COMPAT_SB_CHKSUM
        if has_csum:
            stored = struct.unpack_from("<I", block, _SB_OFFSET + _OFF_CHECKSUM)[0]
            # Refuse to patch a layout we do not understand (a future mkfs.erofs) rather than
            # write an image the kernel would reject.
            if _sb_checksum(block) != stored:
                raise InfraFailure(
                    f"{image}: superblock checksum does not match the expected layout; "
                    f"cannot make the image reproducible with this {MKFS}",
                    reason=InfraReason.storage,
                )
        struct.pack_into("<QI", block, _SB_OFFSET + _OFF_BUILD_TIME, 0, 0)
        if has_csum:
            struct.pack_into("<I", block, _SB_OFFSET + _OFF_CHECKSUM, _sb_checksum(block))
        f.seek(0)
        f.write(block)


def build_erofs(src_dir: Path, out_file: Path, *, compression: str = "lz4") -> None:
    """Build a reproducible EROFS image of ``src_dir`` at ``out_file``.

    Ownership, modes, mtimes, xattrs, symlinks, hard links, device nodes and overlayfs
    whiteouts (0:0 character devices) are kept as they are in the source tree.
    """
    if not src_dir.is_dir():
        raise InvalidRequest(f"cannot build a layer from {src_dir}: not a directory")
    mkfs = shutil.which(MKFS)
    if mkfs is None:
        raise InfraFailure(f"{MKFS} not found: install erofs-utils", reason=InfraReason.storage)
    out_file.unlink(missing_ok=True)
    # $SOURCE_DATE_EPOCH would make mkfs.erofs overwrite every file's mtime.
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    cmd = [
        mkfs,
        "--quiet",
        f"-z{compression}",
        "-Eforce-inode-extended",
        f"-U{LAYER_UUID}",
        os.fspath(out_file),
        os.fspath(src_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, env=env, check=False)
    if proc.returncode != 0:
        out_file.unlink(missing_ok=True)
        stderr = proc.stderr.decode(errors="replace").strip()[-4000:]
        raise InfraFailure(
            f"{MKFS} failed with exit code {proc.returncode} building {src_dir}: {stderr or '(no output)'}",
            reason=InfraReason.storage,
        )
    normalize_superblock(out_file)
