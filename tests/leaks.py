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
    runtime = argv[0].endswith(b"crun") or argv[0].rsplit(b"/", 1)[-1].startswith(b"runsc")
    return runtime and f"{data_dir}/".encode() not in b" ".join(argv)


def _parent(pid: str) -> str:
    try:  # the field after the command name, which may hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return "0"


def _others(pids: list[str], data_dir: Path, own: list[str]) -> set[str]:
    """Another node's processes, and everything they started: a runtime on another state root
    (crun, or runsc and its gofer, e.g. another node's gVisor probe at start) forks children
    whose command lines name no root and that are in no sandbox cgroup yet."""
    parent = {p: _parent(p) for p in pids}
    found: dict[str, bool] = {}

    def another(pid: str) -> bool:
        chain = []
        while pid in parent and pid not in found:
            chain.append(pid)
            if _is_another_nodes(pid, data_dir, own):
                found[pid] = True
                break
            pid = parent[pid]
        verdict = found.get(pid, False)
        for p in chain:
            found[p] = verdict
        return verdict

    return {p for p in pids if another(p)}


def _is_data_dir(path: Path) -> bool:
    """Laid out as a node's data directory: its ``run`` directory and its sandboxes, runtime or
    edge state (a node starting, or one that never held a sandbox, has no ``sandboxes`` yet
    while its runtime tmpfs and LXCFS are already mounted)."""
    return (path / "run").is_dir() and any((path / d).is_dir() for d in ("sandboxes", "runtime", "edge"))


def _another_nodes_mount(line: str, data_dir: Path) -> bool:
    """A mount below a directory laid out as a node's data directory that is not ``data_dir``,
    or one only a node makes (its runtime tmpfs, its LXCFS) anywhere else: a node left behind
    by another run keeps those while pytest's clean-up of old temporary directories renames
    and empties the directories around them."""
    source, mount_point, fstype = line.split()[:3]
    path = Path(mount_point)
    if path.is_relative_to(data_dir):
        return False
    if source == "dsec-runtime" or fstype == "fuse.lxcfs":
        return True
    return any(_is_data_dir(a) for a in path.parents if a != Path("/"))


def snapshot(data_dir: Path) -> dict[str, object]:
    data_dir = data_dir.resolve()
    own = own_parents(data_dir)
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    others = _others(pids, data_dir, own)
    ours = [p for p in pids if p not in others]
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
        if layer_mounts not in line and not _another_nodes_mount(line, data_dir)
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
