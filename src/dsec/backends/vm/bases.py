"""Full VMs' base images built from layers, and their collection.

A base is named by a hash of (layers, disk size), which cannot be turned back into the layers,
so each ``<key>.qcow2`` has a sidecar ``<key>.json`` saying what it was built from and when it
was last used (a create took it, or a collection found a VM on it). The layer gc asks every
edge what it uses; the full-VM backend answers that question's ``unmount_idle`` round by
:meth:`Bases.collect`: a base no VM boots from (running, paused, or a fork's saved disk) goes
once it has been unused for a grace period, or at once when one of its layers left the store
(it could never be asked for again under that name).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("dsec.vm.bases")

# Rebuilding a base costs a mkfs over the layers' union and a qcow2 conversion (tens of seconds
# for a Debian image here); an hour unused is long enough that a job's next wave finds it.
GRACE_S = 3600.0
_TEMPORARIES = (".raw.tmp", ".qcow2.tmp", ".merged", ".json.tmp")


@dataclass
class BaseInfo:
    layers: list[str]
    disk_mb: int
    created_at: float
    last_used: float


class Bases:
    """The directory of bases (``<data>/vm/bases``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def key(digests: list[str], disk_mb: int) -> str:
        return hashlib.sha256(repr((digests, disk_mb)).encode()).hexdigest()[:24]

    def image(self, key: str) -> Path:
        return self.root / f"{key}.qcow2"

    def sidecar(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def read(self, key: str) -> BaseInfo | None:
        try:
            raw = json.loads(self.sidecar(key).read_text())
            return BaseInfo(
                layers=[str(d) for d in raw["layers"]],
                disk_mb=int(raw["disk_mb"]),
                created_at=float(raw["created_at"]),
                last_used=float(raw["last_used"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none yet (a base from before sidecars), or unreadable: judged by age

    def used(self, key: str, digests: list[str], disk_mb: int, now: float | None = None) -> None:
        """Record that base ``key`` (of these layers) was used now; written by rename."""
        now = time.time() if now is None else now
        old = self.read(key)
        info = BaseInfo(list(digests), disk_mb, old.created_at if old else now, now)
        fd, part = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".json.tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(asdict(info), fh)
            os.replace(part, self.sidecar(key))
        finally:
            Path(part).unlink(missing_ok=True)

    def collect(
        self,
        in_use: Iterable[str],
        layer_exists: Callable[[str], bool] | None,
        *,
        grace_s: float = GRACE_S,
        now: float | None = None,
    ) -> list[str]:
        """Remove the bases not in ``in_use`` that are unused for ``grace_s`` or whose layers
        are gone (``layer_exists`` False for one of them); returns the removed keys. A base in
        use has its last use moved to now, so its grace starts when its last VM stops."""
        now = time.time() if now is None else now
        keep = set(in_use)
        removed = []
        for image in sorted(self.root.glob("*.qcow2")) if self.root.is_dir() else []:
            key = image.stem
            info = self.read(key)
            if key in keep:
                if info is not None:
                    self.used(key, info.layers, info.disk_mb, now)
                continue
            try:
                last = info.last_used if info is not None else image.stat().st_mtime
            except FileNotFoundError:
                continue
            gone = info is not None and layer_exists is not None and not all(map(layer_exists, info.layers))
            if not gone and now - last < grace_s:
                continue
            image.unlink(missing_ok=True)
            self.sidecar(key).unlink(missing_ok=True)
            removed.append(key)
        self._sweep(keep, now, grace_s)
        if removed:
            log.info("removed %d unused VM base images: %s", len(removed), removed)
        return removed

    def _sweep(self, keep: set[str], now: float, grace_s: float) -> None:
        """Sidecars without their image, and a crashed build's leftovers (none of a key being
        built: those are in ``keep``)."""
        for path in list(self.root.iterdir()) if self.root.is_dir() else []:
            key = path.name.split(".")[0] or path.name.split(".")[1]
            orphan = path.suffix == ".json" and not path.name.startswith(".")
            if orphan and self.image(key).exists():
                continue
            if not orphan and not path.name.endswith(_TEMPORARIES):
                continue
            try:
                if key in keep or now - path.stat().st_mtime < grace_s:
                    continue
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink()
            except OSError:
                continue


def qcow2_backing(path: Path) -> str | None:
    """The backing file named in a qcow2 header (None: none, or not a qcow2): the chain of a VM's
    disk down to its base, for VMs whose handle predates the ``base`` entry and for forks."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(20)
            if len(head) < 20 or head[:4] != b"QFI\xfb":
                return None
            offset, size = struct.unpack(">QI", head[8:20])
            if not offset or not size or size > 4096:
                return None
            fh.seek(offset)
            return fh.read(size).decode(errors="replace")
    except OSError:
        return None


def base_of(disk: Path, bases: Path, depth: int = 4) -> str | None:
    """The key of the base under ``bases`` that ``disk`` is (or is stacked on), if any."""
    current: Path | None = disk
    for _ in range(depth):
        if current is None:
            return None
        if current.parent == bases and current.suffix == ".qcow2":
            return current.stem
        backing = qcow2_backing(current)
        current = None if backing is None else (current.parent / backing)
    return None
