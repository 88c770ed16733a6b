"""Publishing a complete file under a name only if the name is free, on any POSIX filesystem.

``link(2)``, else ``renameat2(RENAME_NOREPLACE)``, else an ``O_EXCL`` claim file around
``rename(2)``; plus the temporary-name token and the directory fsync that go with publishing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import time
from pathlib import Path

from dsec.protocol.errors import InfraFailure, InfraReason

log = logging.getLogger("dsec.images.blobstore")  # the package's logger, as before the split

# A claim file (last-resort exclusive publication) older than this is from a crashed writer.
_STALE_CLAIM_S = 60.0
_CLAIM_WAIT_S = 120.0


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
                raise InfraFailure(
                    f"timed out waiting for the claim {claim}", reason=InfraReason.storage
                ) from None
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
