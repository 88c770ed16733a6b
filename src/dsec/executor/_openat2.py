"""A minimal ctypes binding of Linux ``openat2(2)`` (Python 3.11 has no ``os.openat2``).

Only what :mod:`dsec.executor.files` needs: one function that returns a file descriptor or raises
:class:`OSError` with the kernel's errno, and the ``RESOLVE_*`` flags of ``struct open_how``.
"""

from __future__ import annotations

import ctypes
import errno
import os

# openat2 was added in Linux 5.6 with the same number on every architecture that uses the unified
# syscall table (x86_64, i386, arm, arm64, riscv, powerpc, s390, loongarch...).
SYS_OPENAT2 = 437

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
RESOLVE_CACHED = 0x20

# The kernel answers EAGAIN when a rename raced with ".." resolution under RESOLVE_IN_ROOT or
# RESOLVE_BENEATH; retrying is the documented response.
_EAGAIN_RETRIES = 16


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """Call ``openat2(dirfd, path, {flags, mode, resolve}, sizeof)``; return the new fd.

    Raises :class:`OSError` carrying the kernel's errno (``ENOSYS`` before Linux 5.6). EINTR is
    retried, and so is EAGAIN a bounded number of times.
    """
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError("embedded null byte")
    how = _OpenHow(flags, mode, resolve)
    eagain = 0
    while True:
        fd = int(_syscall(SYS_OPENAT2, dirfd, raw, ctypes.addressof(how), ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.EAGAIN and eagain < _EAGAIN_RETRIES:
            eagain += 1
            continue
        raise OSError(err, os.strerror(err), os.fsdecode(raw))
