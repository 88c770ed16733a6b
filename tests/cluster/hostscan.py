"""What this test's cluster could leave on the host, found by attribution rather than by count.

``tests/leaks.py`` counts what one data directory's node owns; these find what is provably
ours (under the test's directory, in its
namespaces, of its nodes), so a leak is named, and another suite running at the same time
cannot be mistaken for one.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from dsec._linux import umount
from dsec.backends.container import cgroups
from dsec.images.mount import mounts_under

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _pids() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def netns_inode(path: str | os.PathLike[str]) -> int:
    return os.stat(path).st_ino


def processes_in_netns(inodes: Iterable[int]) -> list[int]:
    wanted = set(inodes)
    found = []
    for pid in _pids():
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in wanted:
                found.append(pid)
        except OSError:
            pass  # exited meanwhile
    return found


def processes_mentioning(path: Path) -> list[str]:
    """Processes whose command line names ``path`` (edges, and crun with its state root)."""
    needle = f"{path}/"  # not a sibling whose name merely starts the same
    return [f"{pid} {line}" for pid in _pids() if needle in (line := cmdline(pid))]


def sandbox_cgroups(nodes: Iterable[str]) -> list[str]:
    return sorted(str(p) for node in nodes for p in CGROUP_ROOT.glob(f"*/dsec*/*/sb-{node}-*"))


def node_parents(node: str, data_dir: Path) -> list[str]:
    """The parent cgroups of node ``node`` on ``data_dir`` still there, in every hierarchy (a
    node that stopped with no sandbox left removes them all)."""
    parent = cgroups.parent_name(node, data_dir)
    return sorted(str(c / parent) for c in cgroups.hierarchies() if (c / parent).is_dir())


def sandbox_processes() -> set[str]:
    """Sandbox processes (and crun runs) of every node, named, for a readable difference."""
    out = set()
    for pid in _pids():
        line = cmdline(pid)
        if "/.dsec/" in line or line.startswith("crun"):
            out.add(f"{pid} {line}")
    return out


def mount_table() -> set[str]:
    return set(Path("/proc/self/mounts").read_text().splitlines())


def end_leftovers(below: Path, parents: Iterable[str]) -> None:
    """What nodes with data directories under ``below`` left: their processes (LXCFS), their
    mounts and their cgroup ``parents``; ended so that a failing test leaves nothing."""
    for found in processes_mentioning(below):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(found.split()[0]), signal.SIGKILL)
    for m in reversed(mounts_under(below)):
        with contextlib.suppress(OSError):
            umount(m.mount_point, lazy=True)
    for parent in parents:
        cgroups.remove_parents(parent)
