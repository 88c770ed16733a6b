"""How much of a file this node's page cache holds: ``cachestat(2)`` (Linux >= 6.5).

What a split layer's data blob (:mod:`dsec.images.ondemand`) has in the page cache is what
this node fetched from the shared store and still holds: the kernel reads the blob through its
page cache, so every byte that crossed the wire is a page of it (directio mounts excepted).
``cachestat`` answers for a whole file in one syscall, without mapping it (``mincore`` would
need an mmap and a byte per page), and also counts the pages evicted since (their shadow
entries: a lower bound, the kernel drops shadows under memory pressure).
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# cachestat is 451 in the generic table both x86-64 and arm64 use.
_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class CacheUse:
    """Bytes of one file: in the page cache now, and evicted from it (shadow entries left)."""

    cached: int
    evicted: int


def supported() -> bool:
    return _NR_CACHESTAT is not None


def cache_use(path: Path) -> CacheUse | None:
    """``path``'s pages in this node's page cache; None if the file is gone or the kernel has
    no cachestat (the caller reports nothing rather than a zero that would read as 'cold')."""
    if _NR_CACHESTAT is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return fd_cache_use(fd)
    finally:
        os.close(fd)


def fd_cache_use(fd: int) -> CacheUse | None:
    """As :func:`cache_use`, for an open file."""
    if _NR_CACHESTAT is None:
        return None
    rng, st = _Range(0, 0), _Stat()
    if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return None  # ENOSYS (an older kernel), EOPNOTSUPP (hugetlbfs): nothing to report
    return CacheUse(cached=st.nr_cache * _PAGE, evicted=st.nr_evicted * _PAGE)
