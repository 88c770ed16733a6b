"""Turning what a sandbox changed (its overlay upper directory) into a layer.

Only the upper directory is packed: the new layer is the diff, whiteouts and opaque markers
included, so it composes over the layers it was built on. Build residue is removed from the
upper directory first, which reverts those paths to what the lower layers hold (removing an
upper entry never deletes lower content), so answers or caches left by a build do not leak
into the image.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
from pathlib import Path

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


def _matches(root: Path, pattern: str) -> list[Path]:
    """Entries under ``root`` matching ``pattern`` component by component, never via symlinks."""
    parts = [p for p in pattern.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise InvalidRequest(f"scrub pattern {pattern!r} must be a relative path without . or ..")
    current = [root]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = []
        for base in current:
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                if fnmatch.fnmatchcase(name, part):
                    path = base / name
                    # Walk into real directories only: a symlink planted by the build must not
                    # steer the scrub outside the upper directory.
                    if last or (path.is_dir() and not path.is_symlink()):
                        nxt.append(path)
        current = nxt
    return current


def scrub(upper: Path, patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Remove matching entries from ``upper``; returns what was removed (relative paths)."""
    removed = []
    for pattern in patterns:
        for path in _matches(upper, pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(str(path.relative_to(upper)))
    return sorted(removed)
