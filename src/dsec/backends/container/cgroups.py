"""cgroup v1 housekeeping for container sandboxes.

crun creates and limits each sandbox's cgroups; this module covers what it does not: making a
hybrid host acceptable to crun, reading OOM kills, and removing what a crash left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from pathlib import Path

from dsec import _linux
from dsec.protocol.errors import InfraFailure

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIFIED = CGROUP_ROOT / "unified"
_CPUSET = CGROUP_ROOT / "cpuset"
PARENT = "dsec"
# A sandbox's cgroup is dsec/<bucket>/<id>, not dsec/<id>: creating a cpuset walks every sibling
# (cpuset_css_online with clone_children; crun's own cpus write walks them too, and rebuilds the
# scheduler domains): perf at 8,000 held sandboxes, ~3 ms of each create, now over ~125 siblings.
BUCKETS = 64


# Sandboxes whose cgroups are not in their ID's bucket: they took a destroyed sandbox's spare
# cgroups from another (spares.py). Found again by a scan when an edge starts (:func:`adopt`).
_placed: dict[str, str] = {}


def rel(sandbox_id: str) -> str:
    """The sandbox's cgroup path below every hierarchy's root (``dsec/<bucket>/<id>``: the
    bucket its ID hashes to, unless it was placed in another); a sandbox made before buckets
    (``dsec/<id>``, still running after an edge upgrade) keeps its."""
    bucket = _placed.get(sandbox_id)
    if bucket is not None:
        return f"{bucket}/{sandbox_id}"
    if (CGROUP_ROOT / "memory" / PARENT / sandbox_id).is_dir():
        return f"{PARENT}/{sandbox_id}"
    return f"{hashed_bucket(sandbox_id)}/{sandbox_id}"


def hashed_bucket(sandbox_id: str) -> str:
    """``dsec/<bucket>`` of the sandbox's ID."""
    bucket = int.from_bytes(hashlib.sha256(sandbox_id.encode()).digest()[:4], "big") % BUCKETS
    return f"{PARENT}/{bucket:02x}"


def place(sandbox_id: str, bucket: str) -> None:
    """Have the sandbox's cgroups be in ``bucket`` (``dsec/<bucket>``) rather than its ID's."""
    if bucket == hashed_bucket(sandbox_id):
        _placed.pop(sandbox_id, None)
    else:
        _placed[sandbox_id] = bucket


def forget(sandbox_id: str) -> None:
    """The sandbox is gone: its placement too."""
    _placed.pop(sandbox_id, None)


def adopt() -> int:
    """Find the sandboxes an earlier edge placed outside their ID's bucket (one listing of
    each bucket of the memory hierarchy); how many."""
    found = 0
    with contextlib.suppress(OSError):
        for bucket in (CGROUP_ROOT / "memory" / PARENT).iterdir():
            if not bucket.is_dir() or len(bucket.name) != 2:
                continue
            where = f"{PARENT}/{bucket.name}"
            for d in bucket.iterdir():
                if d.is_dir() and where != hashed_bucket(d.name):
                    _placed[d.name] = where
                    found += 1
    return found


def sandbox_dir(controller: str, sandbox_id: str) -> Path:
    """The sandbox's cgroup directory in ``controller``'s hierarchy (e.g. ``"memory"``)."""
    return CGROUP_ROOT / controller / rel(sandbox_id)


def fix_hybrid_layout() -> list[str]:
    """Give every controller still attached to the cgroup2 hierarchy a v1 hierarchy of its own.

    crun 1.8 refuses hybrid hosts where cgroup2 holds any controller ("cgroups in hybrid mode
    not supported"); on these machines that is ``hugetlb``. Mounting a v1 hierarchy for it
    moves it out of cgroup2. Returns the controllers moved; idempotent.
    """
    controllers = UNIFIED / "cgroup.controllers"
    if not controllers.exists() or not (CGROUP_ROOT / "memory").is_dir():
        return []
    moved = []
    for name in controllers.read_text().split():
        target = CGROUP_ROOT / name
        target.mkdir(exist_ok=True)
        _linux.mount("cgroup", str(target), "cgroup", _linux.MS_NOSUID | _linux.MS_NODEV, name)
        moved.append(name)
    return moved


def prepare_cpuset_parent() -> bool:
    """Have the kernel give each new sandbox cpuset its parent's CPUs and memory nodes
    (``cgroup.clone_children``); True if set. crun writes both into every new cpuset, and a
    write that changes them checks every sibling and rebuilds the scheduler domains, which walk
    every cpuset: perf at 3,000 held sandboxes, ~3 ms of each create. Once the kernel has copied
    them, crun's write is the same value, which the kernel returns from at once."""
    root = CGROUP_ROOT / "cpuset"
    parent = root / PARENT
    if not (root / "cpuset.cpus").exists():
        return False
    try:
        parent.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # a parent made here starts empty
            if not (parent / name).read_text().strip():
                (parent / name).write_text((root / name).read_text())
        (parent / "cgroup.clone_children").write_text("1")
    except OSError:
        return False
    return True


def prepare_buckets() -> None:
    """Make the buckets below ``dsec`` in every hierarchy now, while the node starts: a cpuset
    bucket made by crun with the first sandbox in it costs that create a cpus write and a
    rebuild of the scheduler domains. Made after :func:`prepare_cpuset_parent`, so each cpuset
    bucket copies its parent's CPUs and passes the copying on to its sandboxes."""
    for c in hierarchies():
        for bucket in range(BUCKETS):
            with contextlib.suppress(FileExistsError):
                (c / PARENT / f"{bucket:02x}").mkdir(parents=True)


def v1_controllers() -> list[Path]:
    out = []
    for entry in CGROUP_ROOT.iterdir():
        if entry.name != "unified" and (entry / "cgroup.procs").exists() and not entry.is_symlink():
            out.append(entry)
    return out


def hierarchies() -> list[Path]:
    """Every hierarchy crun makes a sandbox cgroup in: the v1 controllers and, on a hybrid
    host, the cgroup2 tree."""
    return [*v1_controllers(), *([UNIFIED] if (UNIFIED / "cgroup.procs").exists() else [])]


def sandbox_dirs(sandbox_id: str) -> list[Path]:
    path = rel(sandbox_id)
    return [c / path for c in hierarchies() if (c / path).is_dir()]


def memory_dir(sandbox_id: str) -> Path:
    return sandbox_dir("memory", sandbox_id)


def pids(sandbox_id: str) -> list[int]:
    try:
        return [int(p) for p in (memory_dir(sandbox_id) / "cgroup.procs").read_text().split()]
    except OSError:
        return []


async def set_frozen(sandbox_id: str, frozen: bool, *, timeout_s: float = 10.0) -> None:
    """Freeze or thaw the sandbox's freezer cgroup and wait until the kernel says it is so.

    Written directly rather than through ``crun pause``: idempotent (an edge that restarts
    mid-pause re-applies the journaled state), and no process start.
    """
    state = sandbox_dir("freezer", sandbox_id) / "freezer.state"
    want = "FROZEN" if frozen else "THAWED"
    try:
        state.write_text(want)
        deadline = time.monotonic() + timeout_s
        # FREEZING until every task stopped; usually done within the write itself.
        while state.read_text().strip() != want:
            if time.monotonic() > deadline:
                raise InfraFailure(f"{sandbox_id} did not reach {want} in {timeout_s}s", reason="runtime")
            await asyncio.sleep(0.001)
    except OSError as exc:
        raise InfraFailure(f"freezer of {sandbox_id}: {exc}", reason="runtime") from exc


def oom_kills(sandbox_id: str) -> int:
    path = memory_dir(sandbox_id) / "memory.oom_control"
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except OSError:
        pass
    return 0


def remove(sandbox_id: str) -> None:
    """Kill whatever is left in the sandbox's cgroups (after a crash of crun) and remove them,
    with the cgroup2 children its commands had (command_cgroup.CommandCgroup) first."""
    for d in sandbox_dirs(sandbox_id):
        with contextlib.suppress(OSError):
            for sub in [c for c in d.iterdir() if c.is_dir()]:
                with contextlib.suppress(OSError):
                    for pid in (sub / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), 9)
                with contextlib.suppress(OSError):
                    sub.rmdir()
        with contextlib.suppress(OSError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
        with contextlib.suppress(OSError):
            rmdir(d)


def rmdir(d: Path) -> None:
    """Remove the cgroup directory ``d`` (no processes left in it). A cpuset's CPUs are emptied
    first: the kernel rebuilds the scheduler domains when a v1 cpuset that has CPUs and
    balances load goes offline, and the rebuild walks every cpuset on the node (perf of 8,000
    destroyed at once: 14% of all samples). 320 of 8,000 cpusets in 64 buckets removed: ~1 ms
    of machine CPU each as they were, ~0.15 ms emptied first (docs/decisions.md)."""
    if d.is_relative_to(_CPUSET):
        with contextlib.suppress(OSError):  # ENOSPC while a task is in it: rmdir says EBUSY
            (d / "cpuset.cpus").write_text("\n")
    d.rmdir()


def remove_parents() -> None:
    """Remove the empty ``dsec`` parent cgroups and their buckets (when the edge stops with no
    sandboxes left; a bucket is not removed when its last sandbox goes: a create may be making
    its next one in it at that moment)."""
    for c in hierarchies():
        with contextlib.suppress(OSError):
            for bucket in (c / PARENT).iterdir():
                if bucket.is_dir() and len(bucket.name) == 2:
                    with contextlib.suppress(OSError):
                        rmdir(bucket)
        with contextlib.suppress(OSError):
            (c / PARENT).rmdir()
