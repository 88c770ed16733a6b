"""A host directory whose contents a sandbox wrote, read as host root without ever leaving it.

The edge reads a sandbox's writable layer (its overlay upper directory) and the layers a
sandbox committed with host privileges: to list what changed, to scrub a pack, to find the
initial user in an image. Every name in those trees is the agent's: a component may be a
symlink to ``/`` (``ln -s / /hostlink``), a directory may be swapped for a link while the edge
walks (when the sandbox is not frozen), an entry may be a device node. Joining strings onto the
host path and asking the kernel to resolve them follows all of that out of the tree.

:class:`HostTree` opens the tree's top once and resolves every path below it with
``openat2(2)``: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV``, so no component is ever a link, nothing climbs above the top, and nothing
crosses onto another mount. A link met on the way reads as "absent": in an overlay, a link in
an upper layer hides whatever a lower layer has under that name, so nothing below it is the
layer's own content either. Files are opened ``O_PATH`` first and their type checked on that
descriptor before any open that could have side effects (a device node, a FIFO).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from dsec.executor._openat2 import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    openat2,
)

_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

# What "not there" looks like when a path runs through a link (ELOOP), a file (ENOTDIR), off the
# tree or onto another mount (EXDEV), or simply does not exist.
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)


def _rel(path: str) -> str:
    """``/a/b``, ``a/b/`` or ``""`` as the relative form openat2 wants (``.`` for the top)."""
    rel = path.strip("/")
    if any(part == ".." for part in rel.split("/")):
        raise ValueError(f"{path!r} climbs out with '..'")
    return rel or "."


class HostTree:
    """A directory on the host opened once; every path is resolved beneath it, never through a
    symlink, never onto another file system. Paths are relative to the top (a leading ``/`` is
    the top itself). Use as a context manager, or call :meth:`close`."""

    def __init__(self, top: Path) -> None:
        # O_NOFOLLOW: the top itself may be a name the sandbox chose (a microVM's exported
        # ``upper``), and must not be a link either.
        self.top = top
        self.fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> HostTree:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- resolving ---------------------------------------------------------------------------

    def open(self, path: str, flags: int = os.O_PATH) -> int:
        """A descriptor of ``path`` (``O_NOFOLLOW``: a trailing link is opened as the link when
        ``O_PATH`` is given, refused otherwise). Raises OSError (ELOOP for a link on the way)."""
        return openat2(self.fd, _rel(path), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0, _RESOLVE)

    def _open_or_none(self, path: str, flags: int = os.O_PATH) -> int | None:
        """:meth:`open`, or None where the path reads as absent (a link on the way included)."""
        try:
            return self.open(path, flags)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise

    def lstat(self, path: str) -> os.stat_result | None:
        """The entry at ``path`` itself (a link is not followed), or None where there is none."""
        fd = self._open_or_none(path)
        if fd is None:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return self.lstat(path) is not None

    def is_dir(self, path: str) -> bool:
        st = self.lstat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def read_bytes(self, path: str, limit: int) -> bytes | None:
        """The first ``limit`` bytes of the regular file at ``path``; None for anything else
        (absent, a link, a directory, a device or FIFO, which are never opened for reading)."""
        pfd = self._open_or_none(path)
        if pfd is None:
            return None
        try:
            if not stat.S_ISREG(os.fstat(pfd).st_mode):
                return None
            # Re-opening through the O_PATH descriptor opens the very inode just checked, even
            # if the name has been swapped for something else since.
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        finally:
            os.close(pfd)
        with os.fdopen(fd, "rb") as f:
            return f.read(limit)

    def readlink(self, path: str) -> str:
        parent, name = self._split(path)
        pfd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            return os.readlink(name, dir_fd=pfd)
        finally:
            os.close(pfd)

    def getxattr(self, path: str, key: str) -> bytes | None:
        """Extended attribute ``key`` of the entry at ``path`` (not of a link's target)."""
        fd = self._open_or_none(path)
        if fd is None:
            return None
        try:
            # fgetxattr refuses O_PATH descriptors; the magic link names the same inode. A link
            # itself has no user-settable xattrs worth reading: skip it rather than follow.
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return None
            return os.getxattr(f"/proc/self/fd/{fd}", key)
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP):
                return None
            raise
        finally:
            os.close(fd)

    # -- listing and removing ------------------------------------------------------------------

    def scan(self, path: str) -> list[tuple[str, os.stat_result]]:
        """The entries of directory ``path`` with their own (not followed) status, sorted by
        name; [] if ``path`` is not a directory reached without links."""
        fd = self._open_or_none(path, os.O_RDONLY | os.O_DIRECTORY)
        if fd is None:
            return []
        out: list[tuple[str, os.stat_result]] = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        out.append((entry.name, entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # removed while listed
        finally:
            os.close(fd)
        return sorted(out, key=lambda e: e[0])

    def walk(self, path: str = "/") -> Iterator[tuple[str, list[tuple[str, os.stat_result]]]]:
        """Top-down ``(directory, entries)`` for ``path`` and every directory below it, each
        reopened beneath the top (so a directory swapped for a link while walking is skipped).
        Directory paths are relative (``""`` for the top). The caller may prune by removing
        entries from the list before the walk goes on."""
        start = _rel(path)
        stack = ["" if start == "." else start]
        while stack:
            current = stack.pop()
            entries = self.scan(current or ".")
            yield current, entries
            for name, st in reversed(entries):
                if stat.S_ISDIR(st.st_mode):
                    stack.append(f"{current}/{name}" if current else name)

    def remove(self, path: str) -> None:
        """Remove the entry at ``path`` (a whole directory tree, without following links)."""
        parent, name = self._split(path)
        pfd = self.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=pfd)  # the fd-based walk: it never follows a link
            else:
                os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(pfd)

    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        rel = _rel(path)
        if rel == ".":
            raise ValueError("the top of the tree has no parent")
        parent, _, name = rel.rpartition("/")
        return parent or ".", name
