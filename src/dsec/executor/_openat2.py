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


# Kernel file systems whose files are views of the kernel, not data: the file API opens files
# with the edge's host privileges, so it must never read or write one on a sandbox's behalf
# (a planted symlink to /proc/1/stack or /proc/kmsg would show what the sandbox itself may not
# read, or block an edge thread forever). <linux/magic.h>
KERNEL_FS_MAGIC = {
    0x9FA0: "proc",
    0x62656572: "sysfs",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x27E0EB: "cgroup",
    0x63677270: "cgroup2",
    0xCAFE4A11: "bpf",
    0x62656570: "configfs",
    0xDE5E81E4: "efivarfs",
    0x6165676C: "pstore",
    0xF97CFF8C: "selinuxfs",
    0x1CD1: "devpts",
    0x42494E4D: "binfmt_misc",
    0x19800202: "mqueue",
    0x6E736673: "nsfs",
    0x65735543: "fusectl",
    0x6C6F6F70: "binderfs",
}


def fs_type(fd: int) -> int:
    """The ``f_type`` of the file system holding ``fd`` (``fstatfs(2)``)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64; f_type first
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
