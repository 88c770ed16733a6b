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
from dsec.protocol.errors import InfraFailure, InfraReason

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIFIED = CGROUP_ROOT / "unified"
_CPUSET = CGROUP_ROOT / "cpuset"
_MEMORY = CGROUP_ROOT / "memory"
# Every node's sandboxes sit under a parent of its own, named after the node and its data
# directory (:func:`parent_name`), so two nodes on one host never count, clear or remove each
# other's cgroups. Edges before that shared one parent, ``dsec``: their sandboxes are still
# found there (:func:`adopt`, :func:`rel`) and left to end there.
LEGACY_PARENT = "dsec"
# A sandbox's cgroup is <parent>/<bucket>/<id>, not <parent>/<id>: creating a cpuset walks every
# sibling (cpuset_css_online with clone_children; crun's own cpus write walks them too, and
# rebuilds the scheduler domains): perf at 8,000 held sandboxes, ~3 ms of each create, now over
# ~125 siblings.
BUCKETS = 64


# Where each sandbox this process knows has its cgroups (``<parent>/<bucket>``): set by the
# create that makes them (:func:`place`) and by the scan of an edge that starts (:func:`adopt`).
_placed: dict[str, str] = {}
# The parent of each node that runs in this process, by node name ("": a backend told no name):
# where an ID nobody placed is looked for first.
_node_parents: dict[str, str] = {}


def parent_name(node: str | None, data_dir: Path) -> str:
    """The node's parent cgroup: ``dsec-<node>-<8 hex of its data directory>`` (``dsec-<hex>``
    for a backend that is told no node name). Node names are at most 40 characters
    (protocol.ids), so this stays far below the 255 a cgroup name may have; two nodes named alike
    on two data directories differ by the hash."""
    digest = data_dir_digest(data_dir)
    return f"{LEGACY_PARENT}-{node}-{digest}" if node else f"{LEGACY_PARENT}-{digest}"


def data_dir_digest(data_dir: Path) -> str:
    """8 hex characters of the data directory's resolved path: what tells apart two nodes named
    alike on one host in every host-wide name they make."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]


def register_parent(node: str | None, parent: str) -> None:
    """``node``'s sandboxes are under ``parent`` (for IDs looked up before they were placed)."""
    _node_parents[node or ""] = parent


def _node_of(sandbox_id: str) -> str:
    """The node part of ``sb-<node>-<epoch>-<tag>`` (empty for any other form)."""
    head = sandbox_id.rsplit("-", 2)[0]
    return head[3:] if head.startswith("sb-") and sandbox_id.count("-") >= 3 else ""


def rel(sandbox_id: str) -> str:
    """The sandbox's cgroup path below every hierarchy's root (``<parent>/<bucket>/<id>``:
    where it was placed or adopted, else found by a look into each node's parent; a sandbox
    made before buckets, ``dsec/<id>``, still running after an edge upgrade, keeps its)."""
    where = _placed.get(sandbox_id)
    if where is not None:
        return f"{where}/{sandbox_id}"
    if (_MEMORY / LEGACY_PARENT / sandbox_id).is_dir():
        return f"{LEGACY_PARENT}/{sandbox_id}"
    bucket = _bucket(sandbox_id)
    own = _node_parents.get(_node_of(sandbox_id)) or _node_parents.get("")
    for parent in [p for p in (own,) if p] + [p for p in parents() if p != own]:
        if (_MEMORY / parent / bucket / sandbox_id).is_dir():
            return f"{parent}/{bucket}/{sandbox_id}"
    return f"{own or LEGACY_PARENT}/{bucket}/{sandbox_id}"


def parents() -> list[str]:
    """Every node's parent on this host (the legacy shared one included), from the memory
    hierarchy."""
    try:
        return sorted(
            d.name
            for d in _MEMORY.iterdir()
            if (d.name == LEGACY_PARENT or d.name.startswith(LEGACY_PARENT + "-")) and d.is_dir()
        )
    except OSError:
        return []


def _bucket(sandbox_id: str) -> str:
    return f"{int.from_bytes(hashlib.sha256(sandbox_id.encode()).digest()[:4], 'big') % BUCKETS:02x}"


def hashed_bucket(sandbox_id: str, parent: str) -> str:
    """``<parent>/<bucket>`` of the sandbox's ID."""
    return f"{parent}/{_bucket(sandbox_id)}"


def place(sandbox_id: str, bucket: str) -> None:
    """The sandbox's cgroups are (to be) in ``bucket`` (``<parent>/<bucket>``)."""
    _placed[sandbox_id] = bucket


def is_placed(sandbox_id: str) -> bool:
    return sandbox_id in _placed


def forget(sandbox_id: str) -> None:
    """The sandbox is gone: its placement too."""
    _placed.pop(sandbox_id, None)


def adopt(parent: str, node: str | None) -> int:
    """Learn where the sandboxes an earlier edge of this node left run: every one in the node's
    parent (one listing of each bucket of the memory hierarchy), and, of the legacy shared
    parent, those whose ID names ``node``. How many."""
    found = 0
    with contextlib.suppress(OSError):
        for bucket in (_MEMORY / parent).iterdir():
            if bucket.is_dir() and len(bucket.name) == 2:
                for d in bucket.iterdir():
                    if d.is_dir() and d.name.startswith("sb-"):
                        _placed[d.name] = f"{parent}/{bucket.name}"
                        found += 1
    if not node:
        return found
    with contextlib.suppress(OSError):
        for entry in (_MEMORY / LEGACY_PARENT).iterdir():
            if not entry.is_dir():
                continue
            if len(entry.name) == 2:
                for d in entry.iterdir():
                    if d.is_dir() and _node_of(d.name) == node:
                        _placed[d.name] = f"{LEGACY_PARENT}/{entry.name}"
                        found += 1
            elif _node_of(entry.name) == node:
                _placed[entry.name] = LEGACY_PARENT
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


def prepare_cpuset_parent(parent: str) -> bool:
    """Have the kernel give each new sandbox cpuset its parent's CPUs and memory nodes
    (``cgroup.clone_children``); True if set. crun writes both into every new cpuset, and a
    write that changes them checks every sibling and rebuilds the scheduler domains, which walk
    every cpuset: perf at 3,000 held sandboxes, ~3 ms of each create. Once the kernel has copied
    them, crun's write is the same value, which the kernel returns from at once."""
    root = CGROUP_ROOT / "cpuset"
    made = root / parent
    if not (root / "cpuset.cpus").exists():
        return False
    try:
        made.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # a parent made here starts empty
            if not (made / name).read_text().strip():
                (made / name).write_text((root / name).read_text())
        (made / "cgroup.clone_children").write_text("1")
    except OSError:
        return False
    return True


def prepare_buckets(parent: str) -> None:
    """Make the buckets below ``parent`` in every hierarchy now, while the node starts: a cpuset
    bucket made by crun with the first sandbox in it costs that create a cpus write and a
    rebuild of the scheduler domains. Made after :func:`prepare_cpuset_parent`, so each cpuset
    bucket copies its parent's CPUs and passes the copying on to its sandboxes."""
    for c in hierarchies():
        for bucket in range(BUCKETS):
            with contextlib.suppress(FileExistsError):
                (c / parent / f"{bucket:02x}").mkdir(parents=True)


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
    mid-pause re-applies the journaled state), and no process start. A freeze that cannot
    complete is thawed back before the error: a sandbox is never left half frozen.
    """
    state = sandbox_dir("freezer", sandbox_id) / "freezer.state"
    try:
        if not frozen:
            state.write_text("THAWED")  # the v1 freezer thaws within the write
            return
        deadline = time.monotonic() + timeout_s
        attempt = 0
        # The v1 freezer asks each task to freeze once per write of FROZEN. A task that was
        # running at that moment and then stopped under ptrace (gVisor's ptrace platform,
        # strace, gdb) never reaches the refrigerator: the cgroup stays FREEZING. Writing
        # FROZEN again freezes it where it stopped (measured: a strace'd loop left a single
        # write stuck 80 times in 100, rewrites 0 in 100); an occasional thaw lets tasks that
        # keep forking settle, as runc's freezer does.
        while True:
            state.write_text("FROZEN")
            if state.read_text().strip() == "FROZEN":
                return
            attempt += 1
            if time.monotonic() > deadline:
                state.write_text("THAWED")
                raise InfraFailure(
                    f"{sandbox_id} did not freeze in {timeout_s}s (its processes kept running)",
                    reason=InfraReason.runtime,
                )
            if attempt % 50 == 0:
                state.write_text("THAWED")
                await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(0.001)
    except OSError as exc:
        raise InfraFailure(f"freezer of {sandbox_id}: {exc}", reason=InfraReason.runtime) from exc


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


def remove_parents(parent: str) -> None:
    """Remove the node's empty parent cgroups and their buckets (when the edge stops with no
    sandboxes left; a bucket is not removed when its last sandbox goes: a create may be making
    its next one in it at that moment). The legacy shared parent is another node's as much as
    this one's: left."""
    for c in hierarchies():
        with contextlib.suppress(OSError):
            for bucket in (c / parent).iterdir():
                if bucket.is_dir() and len(bucket.name) == 2:
                    with contextlib.suppress(OSError):
                        rmdir(bucket)
        with contextlib.suppress(OSError):
            (c / parent).rmdir()
