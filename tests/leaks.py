"""What a sandbox can leave behind on the host, counted so tests can compare before and after.

Only what is the test node's counts: another node on the machine (a `dsec up` beside the suite,
another suite on another data directory) keeps its own sandboxes, pool and mounts, and nothing
it does changes these counts. Another node's is what sits in another node's parent cgroup
(``dsec-<node>-<hash>``, or the legacy shared ``dsec``), a crun run on another state root, or a
mount below another node's data directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsec.backends.container import cgroups

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def own_parents(data_dir: Path) -> list[str]:
    """The parent cgroups of the node(s) on ``data_dir`` (whatever their node name)."""
    suffix = "-" + cgroups.data_dir_digest(data_dir)
    return [p for p in cgroups.parents() if p.endswith(suffix)]


def _memory_cgroup(pid: str) -> str:
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return path
    except (OSError, ValueError):
        pass
    return ""


def _is_another_nodes(pid: str, data_dir: Path, own: list[str]) -> bool:
    path = _memory_cgroup(pid)
    top = path.split("/")[1] if path.count("/") >= 1 else ""
    if top == cgroups.LEGACY_PARENT or top.startswith(cgroups.LEGACY_PARENT + "-"):
        return top not in own
    argv = _cmdline(pid).split(b"\0")
    return bool(argv) and argv[0].endswith(b"crun") and f"{data_dir}/".encode() not in b" ".join(argv)


def _under_another_data_dir(mount_point: str, data_dir: Path) -> bool:
    """A mount below a directory laid out as a node's data directory that is not ``data_dir``."""
    path = Path(mount_point)
    if path.is_relative_to(data_dir):
        return False
    return any((a / "sandboxes").is_dir() and (a / "run").is_dir() for a in path.parents if a != Path("/"))


def snapshot(data_dir: Path) -> dict[str, object]:
    data_dir = data_dir.resolve()
    own = own_parents(data_dir)
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    ours = [p for p in pids if not _is_another_nodes(p, data_dir, own)]
    netns = set()
    for pid in ours:
        try:
            netns.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            pass
    sandbox_procs = [
        p for p in ours if b"/.dsec/" in (c := _cmdline(p)) or c.split(b"\0")[0].endswith(b"crun")
    ]
    workdirs = data_dir / "sandboxes"
    # Layer mounts under <data_dir>/mnt stay mounted on purpose (one per layer per node, shared
    # by every sandbox); everything else a sandbox mounts must be gone with it.
    layer_mounts = str(data_dir / "mnt") + "/"
    mounts = [
        line
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if layer_mounts not in line and not _under_another_data_dir(line.split()[1], data_dir)
    ]
    return {
        "mounts": len(mounts),
        "cgroups": sorted(
            str(p)
            for parent in own
            for p in [*CGROUP_ROOT.glob(f"*/{parent}/sb-*"), *CGROUP_ROOT.glob(f"*/{parent}/*/sb-*")]
        ),
        "netns": len(netns),
        "sandbox_processes": len(sandbox_procs),
        "workdirs": sorted(p.name for p in workdirs.iterdir()) if workdirs.is_dir() else [],
    }
