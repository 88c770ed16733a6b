"""The cgroups a destroyed sandbox leaves to the next create (cgroup v1).

Making a sandbox's cgroups costs the kernel more the fuller the node is: a new memory cgroup
allocates per-shrinker state for every filesystem instance on the host (5 per sandbox), the
first write of its CPU quota checks every cpu cgroup of the node (``tg_set_cfs_bandwidth``:
~4.5 ms at 8,000 held sandboxes, 0.1 ms empty), a new cpuset walks its siblings; removing them
offlines and frees the same again. An RL node at density mostly replaces sandboxes: one ends,
the next starts. So, when a destroyed sandbox's cgroups are fit (nothing runs in them, its
memory cgroup charges almost nothing once reclaimed, its freezer is thawed), they are renamed
to a spare name in their bucket (cgroup v1 renames a cgroup within its parent; cgroup2 does
not, so the hybrid host's unified directory, which has no controllers, is made afresh), and
the next create renames them to its own ID before crun runs.
crun finds them made and writes the new sandbox's limits into them; its CPU quota only when it
differs from the one the spare kept (the config then leaves it out: no walk).

What a spare carries over is the kernel's accounting, not the sandbox's: counters such as
``memory.oom_control``'s kills (the executor counts kills as a difference, before and after a
command) and at most :data:`MAX_LEFT_CHARGED` of kernel objects still charged. Sandboxes never
see their cgroup files (``/sys`` is an empty directory inside), so nothing they could write
there reaches the next one. Spares are only a cache: the edge removes them when it starts and
when it closes, and keeps at most ``per_bucket`` in each of the 64 buckets. A create takes its
ID's bucket's spare, or else any bucket's (placing the sandbox there: cgroup v1 renames only
within a parent, and IDs fall in buckets at random, so a bucket's own would rarely be there).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from collections import Counter, defaultdict
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.density import memory

log = logging.getLogger("dsec.backends.container")

PER_BUCKET = 4  # x 64 buckets: at most 256 spare sets, each an empty cgroup per hierarchy
PREFIX = "spare-"  # sandbox IDs never start so (protocol.ids: "sb-...")
MAX_LEFT_CHARGED = 1 << 20  # bytes of kernel objects a spare's memory cgroup may still be charged


class SpareCgroups:
    """Spare sets of v1 cgroups, per bucket of the node's parent cgroup, known to this edge only
    (a restart removes them)."""

    def __init__(self, parent: str, per_bucket: int = PER_BUCKET) -> None:
        self.parent = parent
        self.per_bucket = per_bucket
        self._free: dict[str, list[str]] = defaultdict(list)
        # Names no other edge's spares have (tests run several nodes on one host).
        self._names = (f"{PREFIX}{secrets.token_hex(4)}-{i}" for i in itertools.count())
        self.taken = self.missed = self.kept = 0  # creates that had a spare, that had none; kept
        self.unfit: Counter[str] = Counter()  # destroyed sandboxes' cgroups not kept, by why

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def take(self, sandbox_id: str) -> int | None:
        """Give the new sandbox a spare set of cgroups, its ID's bucket's if it has one, else
        another bucket's (it is then placed there: :func:`cgroups.place`); the CPU quota
        (microseconds per period) the spare keeps. None when there was no spare, or it could not
        be taken whole (what was renamed is the sandbox's then, crun makes the rest)."""
        bucket = cgroups.hashed_bucket(sandbox_id, self.parent)
        if not self._free.get(bucket):
            bucket = max(self._free, key=lambda b: len(self._free[b]), default=bucket)
            if not self._free.get(bucket):
                self.missed += 1
                return None
        spare = self._free[bucket].pop()
        self.taken += 1
        cgroups.place(sandbox_id, bucket)
        hierarchies = cgroups.v1_controllers()
        for i, h in enumerate(hierarchies):
            try:
                (h / bucket / spare).rename(h / bucket / sandbox_id)
            except OSError as exc:
                log.warning("spare cgroups %s of %s: %s; dropped", spare, bucket, exc)
                _remove(hierarchies[i:], f"{bucket}/{spare}")
                if i == 0:
                    cgroups.forget(sandbox_id)  # none of it is the sandbox's
                return None
        try:
            return int((cgroups.CGROUP_ROOT / "cpu" / bucket / sandbox_id / "cpu.cfs_quota_us").read_text())
        except (OSError, ValueError):
            return None

    def give(self, sandbox_id: str) -> bool:
        """Keep the destroyed sandbox's cgroups as a spare of its bucket, if it has room and they
        are fit; True if kept. Call once its processes have ended and its memory was reclaimed;
        whatever is not kept, the caller removes as before."""
        rel = cgroups.rel(sandbox_id)
        where = _split(rel)
        if where is None or not where[0].startswith(f"{self.parent}/"):
            return False  # made before buckets, or under the legacy shared parent
        if len(self._free[where[0]]) >= self.per_bucket:
            return False
        unfit = _unfit(rel)
        if unfit is not None:
            self.unfit[unfit] += 1
            return False
        bucket, name = where
        spare = next(self._names)
        done: list[Path] = []
        for h in cgroups.v1_controllers():
            try:
                (h / bucket / name).rename(h / bucket / spare)
            except OSError:
                _remove(done, f"{bucket}/{spare}")
                return False
            done.append(h)
        self._free[bucket].append(spare)
        self.kept += 1
        return True

    def clear(self) -> int:
        """Remove every spare set in the node's parent, this edge's and any an earlier one left."""
        self._free.clear()
        removed = 0
        for h in cgroups.v1_controllers():
            with contextlib.suppress(OSError):
                for bucket in (h / self.parent).iterdir():
                    with contextlib.suppress(OSError):
                        for d in bucket.glob(f"{PREFIX}*"):
                            with contextlib.suppress(OSError):
                                cgroups.rmdir(d)
                                removed += 1
        return removed


def spare_dirs(parent: str) -> list[Path]:
    """Every spare cgroup directory in the node's parent (for tests and diagnostics)."""
    return sorted(p for h in cgroups.v1_controllers() for p in h.glob(f"{parent}/*/{PREFIX}*"))


def _split(rel: str) -> tuple[str, str] | None:
    """``<parent>/<bucket>/<id>`` as (``<parent>/<bucket>``, ``<id>``); None for a sandbox made
    before buckets (``dsec/<id>``), whose cgroups are not kept."""
    parent, _, name = rel.rpartition("/")
    return (parent, name) if parent.count("/") == 1 else None


def _unfit(rel: str) -> str | None:
    """Why the cgroups cannot serve another sandbox; None if they can (then made ready to)."""
    mem = cgroups.CGROUP_ROOT / "memory" / rel
    try:
        if (mem / "cgroup.procs").read_text().strip():
            return "processes"
        if (cgroups.CGROUP_ROOT / "freezer" / rel / "freezer.state").read_text().strip() != "THAWED":
            return "frozen"
    except OSError:
        return "gone"
    if memory.usage_bytes(mem) > MAX_LEFT_CHARGED:
        return "charged"
    for counter in ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes", "memory.failcnt"):
        with contextlib.suppress(OSError):
            (mem / counter).write_text("0")  # the next sandbox's peaks and failures, not these
    return None


def _remove(hierarchies: list[Path], rel: str) -> None:
    for h in hierarchies:
        with contextlib.suppress(OSError):
            cgroups.rmdir(h / rel)
