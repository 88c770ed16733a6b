"""What a sandbox changed relative to its layers, read from its writable layer on the host.

The upper directory and the lower layers are trees the agent wrote (a committed layer is a
lower of every fork made from it), walked here as host root. Each is opened as a
:class:`~dsec.images.hosttree.HostTree`, so ``under=/hostlink/root`` with ``/hostlink -> /``
lists nothing (a link hides what lies below its name in an overlay, so nothing there is a
change of the layer) instead of the host's files. A link's target is read here too
(``readlink`` beneath the tree, the link itself never followed), so no one needs a tool inside
the sandbox for it. Names are the file system's bytes (surrogateescape ``str``; the wire
carries them exactly). The listing is bounded: a sandbox can make millions of entries, and
the edge holds the whole answer in memory.
"""

from __future__ import annotations

import os
import stat
from contextlib import ExitStack
from pathlib import Path

from dsec.executor._paths import _check_path as check_path
from dsec.images.hosttree import HostTree
from dsec.protocol.errors import InvalidReason, InvalidRequest
from dsec.protocol.models import Change, ChangeKind, FileType

NODE_TOOLS = ".dsec"  # the node's read-only tool mount point: never part of a sandbox's state
MAX_CHANGES = 200_000
"""Most entries one listing returns; past it the caller is told to narrow ``under``."""

_OPAQUE = "trusted.overlay.opaque"


def check_under(under: str) -> str:
    """``under`` as a normalised absolute sandbox path, or InvalidRequest."""
    check_path(under, "under")  # a string, not empty, no NUL, at most PATH_MAX
    if not under.startswith("/") or ".." in under.split("/"):
        raise InvalidRequest(f"under={under[:200]!r}: give an absolute path without '..'")
    return "/" + "/".join(p for p in under.split("/") if p and p != ".")


def _ftype(mode: int) -> FileType:
    if stat.S_ISDIR(mode):
        return FileType.dir
    if stat.S_ISREG(mode):
        return FileType.file
    if stat.S_ISLNK(mode):
        return FileType.symlink
    return FileType.other


def walk_changes(upper: Path, lowers: list[Path], under: str = "/") -> list[Change]:
    """Every entry of ``upper`` below sandbox path ``under`` as an added, modified or deleted
    path, sorted (a deletion before a re-addition of the same path)."""
    under = check_under(under)
    out: list[Change] = []
    if under.split("/")[1] == NODE_TOOLS:
        return out
    with ExitStack() as stack:
        top = stack.enter_context(HostTree(upper))
        below = [stack.enter_context(HostTree(lower)) for lower in lowers]
        for rel_dir, entries in top.walk(under):
            if not rel_dir:
                # The node's tools at the top are neither listed nor walked into.
                entries[:] = [(n, s) for n, s in entries if n != NODE_TOOLS]
            if len(out) + len(entries) > MAX_CHANGES:
                raise InvalidRequest(
                    f"more than {MAX_CHANGES} changes below {under}: list a narrower under=",
                    reason=InvalidReason.too_large,
                )
            for name, st in entries:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                out.extend(_classify(top, below, rel, st))
    return sorted(out, key=lambda c: (c.path, c.kind != ChangeKind.deleted))


def _classify(top: HostTree, below: list[HostTree], rel: str, st: os.stat_result) -> list[Change]:
    path = "/" + rel
    in_lower = any(tree.exists(rel) for tree in below)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout
        return [Change(path=path, kind=ChangeKind.deleted, type=FileType.other)]
    if stat.S_ISDIR(st.st_mode):
        if in_lower and top.getxattr(rel, _OPAQUE) == b"y":
            # Replaced as a whole ("rm -rf d; mkdir d"): gone, then made again.
            return [
                Change(path=path, kind=ChangeKind.deleted, type=FileType.dir),
                Change(path=path, kind=ChangeKind.added, type=FileType.dir),
            ]
        return [] if in_lower else [Change(path=path, kind=ChangeKind.added, type=FileType.dir)]
    kind = ChangeKind.modified if in_lower else ChangeKind.added
    ftype = _ftype(st.st_mode)
    return [
        Change(
            path=path, kind=kind, type=ftype, target=_target(top, rel) if ftype is FileType.symlink else None
        )
    ]


def _target(top: HostTree, rel: str) -> str | None:
    """A link's target as stored, read here on the host (never followed, no tool run in the
    sandbox): the grader recreates links from this. None if it vanished meanwhile."""
    try:
        return top.readlink(rel)
    except OSError:
        return None
