"""Turning what a sandbox changed (its overlay upper directory) into a layer.

Only the upper directory is packed: the new layer is the diff, whiteouts and opaque markers
included, so it composes over the layers it was built on. Build residue is removed from the
upper directory first, which reverts those paths to what the lower layers hold (removing an
upper entry never deletes lower content), so answers or caches left by a build do not leak
into the image.
"""

from __future__ import annotations

import fnmatch
import stat
from pathlib import Path

from dsec.images.hosttree import HostTree
from dsec.protocol.errors import InvalidRequest

# Paths (relative to the sandbox root, fnmatch patterns per component) that never belong in
# a layer: caches, shell and REPL histories, temp files, logs of the build itself, and the
# mount point of the node's tools.
DEFAULT_SCRUB = (
    ".dsec",
    "tmp/*",
    "var/tmp/*",
    "var/cache/apt/*",
    "var/lib/apt/lists/*",
    "var/log/*",
    "root/.cache",
    "root/.bash_history",
    "root/.python_history",
    "root/.wget-hsts",
    "root/.lesshst",
    "home/*/.cache",
    "home/*/.bash_history",
    "home/*/.python_history",
)


def _matches(tree: HostTree, pattern: str) -> list[str]:
    """Entries of ``tree`` matching ``pattern`` component by component, never via symlinks."""
    parts = [p for p in pattern.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise InvalidRequest(f"scrub pattern {pattern!r} must be a relative path without . or ..")
    current = [""]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = []
        for base in current:
            for name, st in tree.scan(base or "."):
                # Walk into real directories only: a symlink planted by the build must not
                # steer the scrub outside the upper directory (scan itself never follows one).
                if fnmatch.fnmatchcase(name, part) and (last or stat.S_ISDIR(st.st_mode)):
                    nxt.append(f"{base}/{name}" if base else name)
        current = nxt
    return current


def scrub(upper: Path, patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Remove matching entries from ``upper``; returns what was removed (relative paths)."""
    removed = []
    with HostTree(upper) as tree:
        for pattern in patterns:
            for rel in _matches(tree, pattern):
                tree.remove(rel)
                removed.append(rel)
    return sorted(removed)
