"""What a layer may not carry in from outside: device nodes and file capabilities.

A layer is mounted into other sandboxes, so anything in it that grants more than its bytes
do must not come from a project's upload or commit:

* a device node (``mknod c 8 0`` of the host's disk, ``/dev/mem``) opens the host's device
  wherever the sandbox's mount allows device access; a sandbox gets its own /dev from the
  runtime, so a layer never needs one. The one exception is the character device 0/0, which
  overlayfs reads as a whiteout (a deletion in an upper layer): it opens nothing.
* a ``security.capability`` xattr makes a program gain capabilities when any later sandbox
  runs it (a file-capability escalation planted for the next tenant).

Both are stripped, not refused: images from ``docker save`` routinely carry /dev nodes, and
refusing them would refuse ordinary images for no gain. What was stripped is logged.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

CAPABILITY_XATTR = "security.capability"


def is_whiteout(kind: int, rdev: int) -> bool:
    """Whether a device node of file type ``kind`` (S_IFCHR/S_IFBLK) is an overlay whiteout."""
    return kind == stat.S_IFCHR and rdev == os.makedev(0, 0)


@contextmanager
def stripped_tree(root: Path) -> Iterator[list[str]]:
    """Strip ``root`` (:func:`strip_unsafe_tree`) and hold it while the caller reads it.

    Stripping changes a directory's mtime for a moment (a name removed, then the time put
    back); a second import of the same tree reading it in that moment would build another
    digest. An exclusive lock on the directory, across threads and processes, keeps a reader
    out until the tree is stripped and read whole.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield strip_unsafe_tree(root)
    finally:
        os.close(fd)  # releases the lock


def strip_unsafe_tree(root: Path) -> list[str]:
    """Remove device nodes (whiteouts kept) and file capabilities below ``root``, in place.

    ``root`` may share inodes with a running sandbox (a commit's staging copy is made of
    hard links): a name is unlinked, never the inode changed, and a file whose capability
    must go is first replaced by a private copy. Returns the paths stripped, relative to root.
    """
    stripped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        parent = os.lstat(dirpath)
        changed = False
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            try:
                st = os.lstat(path)
                kind = stat.S_IFMT(st.st_mode)
                if kind in (stat.S_IFCHR, stat.S_IFBLK) and not is_whiteout(kind, st.st_rdev):
                    os.unlink(path)
                elif kind in (stat.S_IFREG, stat.S_IFDIR) and _has_capability(path):
                    if kind == stat.S_IFREG and st.st_nlink > 1:
                        _unshare(path, st)
                    os.removexattr(path, CAPABILITY_XATTR, follow_symlinks=False)
                else:
                    continue
            except OSError as err:
                if isinstance(err, FileNotFoundError) or err.errno == errno.ENODATA:
                    continue  # another import of the same tree stripped it first
                raise
            changed = True
            stripped.append(os.fspath(path.relative_to(root)))
        if changed:
            # A removed name changes the directory's mtime, which is part of the layer's
            # digest: the same tree must still give the same layer.
            os.utime(dirpath, ns=(parent.st_atime_ns, parent.st_mtime_ns), follow_symlinks=False)
    if stripped:
        log.warning("stripped %d device nodes or file capabilities: %s", len(stripped), stripped[:20])
    return stripped


def _has_capability(path: Path) -> bool:
    try:
        return CAPABILITY_XATTR in os.listxattr(path, follow_symlinks=False)
    except OSError:
        return False


def _unshare(path: Path, st: os.stat_result) -> None:
    """Replace ``path`` by a copy of its own (same bytes, owner, mode, times and xattrs)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".unshare-")
    os.close(fd)
    try:
        shutil.copyfile(path, tmp, follow_symlinks=False)
        for key in os.listxattr(path, follow_symlinks=False):
            os.setxattr(tmp, key, os.getxattr(path, key, follow_symlinks=False))
        os.chown(tmp, st.st_uid, st.st_gid)
        os.chmod(tmp, stat.S_IMODE(st.st_mode))  # after chown, which clears setuid
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
