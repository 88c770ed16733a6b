"""Deletions in a layer: OCI whiteout files <-> overlayfs whiteouts and opaque directories.

An OCI layer tarball says "delete ``dir/name`` from the layers below" with an empty file
``dir/.wh.name``, and "hide everything below in ``dir``" with ``dir/.wh..wh..opq``
(image-spec, layer.md). Overlayfs, which composes our EROFS layers, says the same with a
character device 0:0 named ``name`` and with the xattr ``trusted.overlay.opaque=y`` on ``dir``.
:func:`oci_to_overlay` rewrites an extracted layer tree from the first form to the second, in
place, before it becomes an EROFS image; :func:`overlay_to_oci` goes back (for exporting a layer).

Three rules need care because overlayfs cannot state the OCI ones literally:

* a whiteout applies only to the layers *below*: ``.wh.name`` next to a ``name`` of the same
  layer keeps ``name``. If that ``name`` is a directory, it must still hide the lower
  directory's contents, so it becomes opaque; a non-directory hides the lower entry anyway.
* other ``.wh..wh.*`` names are aufs bookkeeping (hard-link directories) and are dropped;
* whiteouts inside an opaque directory are dropped: they hide nothing more, and overlayfs
  lists a whiteout in a directory it does not merge with lower ones as a name that cannot be
  looked up (``ls`` shows ``c?????????``). The same happens to a whiteout in a directory that
  no lower layer has; that cannot be known per layer, and layers built by docker never have
  one (their whiteouts name what the layers below hold).

A layer may not smuggle in overlayfs' own metadata: every ``trusted.overlay.*`` xattr found in
the archive is removed before conversion (overlayfs would otherwise honour, say, a
``trusted.overlay.redirect`` planted by whoever built the tarball). Directory mtimes are
restored after their entries change, so the resulting image stays reproducible.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from dsec.protocol.errors import InvalidRequest

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
AUFS_META_PREFIX = ".wh..wh."
OVERLAY_XATTR_PREFIX = "trusted.overlay."
OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_DEV = os.makedev(0, 0)


def is_whiteout(st: os.stat_result) -> bool:
    """An overlayfs whiteout: a character device with device number 0:0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT_DEV


def is_opaque(path: str | os.PathLike[str]) -> bool:
    """Whether the directory carries ``trusted.overlay.opaque=y``."""
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def set_opaque(path: str | os.PathLike[str]) -> None:
    os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)


def make_whiteout(path: str | os.PathLike[str], like: os.stat_result | None = None) -> None:
    """Create an overlayfs whiteout at ``path``, owned and dated like ``like`` (else root, 0)."""
    os.mknod(path, stat.S_IFCHR, WHITEOUT_DEV)  # mode 0, as overlayfs itself creates them
    uid, gid, mtime_ns = (like.st_uid, like.st_gid, like.st_mtime_ns) if like else (0, 0, 0)
    os.chown(path, uid, gid, follow_symlinks=False)
    os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def strip_overlay_xattrs(path: str | os.PathLike[str]) -> bool:
    """Remove every ``trusted.overlay.*`` xattr from ``path``; True if there was one."""
    found = False
    for key in os.listxattr(path, follow_symlinks=False):
        if key.startswith(OVERLAY_XATTR_PREFIX):
            os.removexattr(path, key, follow_symlinks=False)
            found = True
    return found


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _restore_times(path: str, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def oci_to_overlay(root: Path) -> int:
    """Convert the OCI whiteouts under ``root`` (an extracted layer) in place.

    Returns the number of whiteouts and opaque markers converted. Raises
    :class:`InvalidRequest` for a whiteout that names nothing (``.wh.``, ``.wh..``).

    Whiteouts inside an opaque directory (or below one) are dropped: the opaque directory
    already hides everything below it, and overlayfs lists a whiteout in a directory it does
    not merge as an entry that then cannot be looked up (``ls`` shows ``c?????????``).
    """
    converted = 0
    strip_overlay_xattrs(root)
    stack = [(os.fspath(root), False)]
    while stack:
        directory, under_opaque = stack.pop()
        dir_st = os.lstat(directory)
        changed = False
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        names = {e.name for e in entries}
        # First what the archive brought, so that the markers set below are the only ones left.
        for entry in entries:
            if not entry.name.startswith(WHITEOUT_PREFIX):
                strip_overlay_xattrs(entry.path)
        opaque = under_opaque or OPAQUE_MARKER in names
        # Directories that a whiteout of this layer names stay, as opaque directories.
        reopened = set()
        for entry in entries:
            name = entry.name
            path = entry.path
            if name == OPAQUE_MARKER:
                _remove(path)
                set_opaque(directory)
                changed = True
                converted += 1
            elif name.startswith(AUFS_META_PREFIX):
                _remove(path)
                changed = True
            elif name.startswith(WHITEOUT_PREFIX):
                target = name[len(WHITEOUT_PREFIX) :]
                if target in ("", ".", ".."):
                    raise InvalidRequest(f"invalid whiteout {name!r} in layer: it names no file")
                marker_st = os.lstat(path)
                _remove(path)
                changed = True
                converted += 1
                target_path = os.path.join(directory, target)
                if target in names:
                    # The same layer also has the entry: it stays (a whiteout only hides what
                    # is below). A directory must still hide the lower one's contents.
                    if stat.S_ISDIR(os.lstat(target_path).st_mode):
                        set_opaque(target_path)
                        reopened.add(target)
                elif not opaque:
                    make_whiteout(target_path, marker_st)
        for entry in entries:
            if not entry.name.startswith(WHITEOUT_PREFIX) and entry.is_dir(follow_symlinks=False):
                stack.append((entry.path, opaque or entry.name in reopened))
        if changed:
            _restore_times(directory, dir_st)
    return converted


def overlay_to_oci(root: Path) -> int:
    """The reverse of :func:`oci_to_overlay`: whiteout devices and opaque xattrs become
    ``.wh.`` files. Returns the number converted."""
    converted = 0
    stack = [os.fspath(root)]
    while stack:
        directory = stack.pop()
        dir_st = os.lstat(directory)
        changed = False
        if is_opaque(directory):
            os.removexattr(directory, OPAQUE_XATTR, follow_symlinks=False)
            _create_marker(os.path.join(directory, OPAQUE_MARKER), dir_st)
            changed = True
            converted += 1
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.name == OPAQUE_MARKER and changed:
                continue  # the one just created
            if entry.name.startswith(WHITEOUT_PREFIX):
                raise InvalidRequest(
                    f"{entry.path}: a file named {entry.name!r} cannot be expressed in an OCI layer"
                )
            st = entry.stat(follow_symlinks=False)
            if is_whiteout(st):
                os.unlink(entry.path)
                _create_marker(os.path.join(directory, WHITEOUT_PREFIX + entry.name), st)
                changed = True
                converted += 1
            elif stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
        if changed:
            _restore_times(directory, dir_st)
    return converted


def _create_marker(path: str, like: os.stat_result) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.close(fd)
    os.chown(path, like.st_uid, like.st_gid, follow_symlinks=False)
    os.utime(path, ns=(like.st_mtime_ns, like.st_mtime_ns), follow_symlinks=False)
