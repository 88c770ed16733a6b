"""Thin ctypes wrappers over mount(2)/umount2(2) and a /proc/self/mountinfo reader.

We call the syscalls directly because util-linux ``mount`` turns an EROFS image *file* into a
loop device behind our back; only mount(2) with the file path as source gets the kernel's
file-backed mode (no loop device, page cache shared straight from the backing file).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

from dsec._linux import MNT_DETACH, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY, mount, umount

__all__ = ["MNT_DETACH", "MS_NODEV", "MS_NOEXEC", "MS_NOSUID", "MS_RDONLY", "mount", "umount"]

_MOUNTINFO = "/proc/self/mountinfo"


def mount_erofs(image: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Mount an EROFS image file read-only, file-backed (needs Linux >= 6.12)."""
    mount(os.path.abspath(image), target, "erofs", MS_RDONLY)


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (see proc(5))."""

    mount_id: int
    parent_id: int
    device: str
    root: str
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str


_ESCAPE_RE = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    # The kernel octal-escapes space, tab, newline and backslash in paths.
    return os.fsdecode(_ESCAPE_RE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def read_mountinfo(path: str = _MOUNTINFO) -> list[MountEntry]:
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    entries = []
    for line in lines:
        fields = line.split(b" ")
        # Optional fields (shared:N, master:N ...) vary in number and end at a lone "-".
        sep = fields.index(b"-", 6)
        entries.append(
            MountEntry(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                device=fields[2].decode(),
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=fields[5].decode(),
                fstype=fields[sep + 1].decode(),
                source=_unescape(fields[sep + 2]),
                super_options=_unescape(fields[sep + 3]) if len(fields) > sep + 3 else "",
            )
        )
    return entries


def _canonical(path: str | os.PathLike[str]) -> str:
    # mountinfo shows resolved paths, so compare against the resolved form of ours.
    return os.path.realpath(path)


def find_mount(path: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount whose mount point is exactly ``path``, or None."""
    want = _canonical(path)
    found = None
    for entry in read_mountinfo():
        if entry.mount_point == want:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def is_mountpoint(path: str | os.PathLike[str]) -> bool:
    return find_mount(path) is not None


def mounts_under(path: str | os.PathLike[str]) -> list[MountEntry]:
    """Mounts at or below ``path``, deepest (and most recently stacked) first: unmount order."""
    base = _canonical(path)
    prefix = base.rstrip("/") + "/"
    found = [e for e in read_mountinfo() if e.mount_point == base or e.mount_point.startswith(prefix)]
    order = {e.mount_id: i for i, e in enumerate(found)}
    return sorted(found, key=lambda e: (e.mount_point.count("/"), order[e.mount_id]), reverse=True)


def unmount_tree(path: str | os.PathLike[str]) -> list[str]:
    """Lazily detach every mount at or below ``path``; returns what it detached.

    Used before deleting a directory that a tool (debootstrap, a crashed test) may have left
    mounts in: ``rmtree`` would otherwise walk into /proc or /sys of the host.
    """
    done = []
    for entry in mounts_under(path):
        try:
            umount(entry.mount_point, lazy=True)
        except OSError as err:
            if err.errno != errno.EINVAL:  # already gone with a parent's detach
                raise
        done.append(entry.mount_point)
    return done


def is_loop_backed(entry: MountEntry) -> bool:
    return entry.source.startswith("/dev/loop")
