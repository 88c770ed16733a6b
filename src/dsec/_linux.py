"""Thin ctypes wrappers for the few Linux syscalls Python 3.11 lacks (mount, umount2, unshare,
Landlock's version query), and reading a process's start time (how a PID is told apart from a
later one that reuses it).

They are safe to call between fork and exec (a ``preexec_fn``): no allocation beyond ctypes
argument conversion, no locks. util-linux ``mount`` is never used: for an EROFS image file it
silently sets up a loop device, while mount(2) with the file path gets the file-backed mode.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int
_libc.unshare.argtypes = [ctypes.c_int]
_libc.unshare.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
_NR_LANDLOCK_CREATE_RULESET = {"x86_64": 444, "aarch64": 444}
LANDLOCK_CREATE_RULESET_VERSION = 1

PathArg = str | os.PathLike[str]


def _fail(what: str, path: PathArg | None = None) -> None:
    err = ctypes.get_errno()
    where = None if path is None else os.fspath(path)
    raise OSError(err, f"{what}: {os.strerror(err)}", where)


def mount(
    source: PathArg | None, target: PathArg, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    """mount(2); raises :class:`OSError` carrying the errno and its text."""
    rc = _libc.mount(
        None if source is None else os.fsencode(source),
        os.fsencode(target),
        None if fstype is None else fstype.encode(),
        flags,
        None if data is None else data.encode(),
    )
    if rc != 0:
        _fail(f"mount -t {fstype} {source} on {os.fspath(target)}", target)


def umount(target: PathArg, lazy: bool = False) -> None:
    """umount2(2); ``lazy`` detaches now and lets the kernel finish when the last user leaves."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        _fail(f"umount {os.fspath(target)}", target)


def unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        _fail("unshare")


def private_mount_namespace() -> None:
    """Move the calling process into a fresh mount namespace that propagates nothing back."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` from its third field on (after the parenthesised command name, which
    may hold spaces): [0] state, [1] ppid, [11] utime, [12] stime, [19] starttime; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if gone or a zombie."""
    fields = stat_fields(pid)
    # A zombie is as good as gone.
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or not among the LSMs."""
    nr = _NR_LANDLOCK_CREATE_RULESET.get(os.uname().machine)
    if nr is None:
        return 0
    abi = _libc.syscall(
        ctypes.c_long(nr), None, ctypes.c_size_t(0), ctypes.c_uint(LANDLOCK_CREATE_RULESET_VERSION)
    )
    return max(0, int(abi))
