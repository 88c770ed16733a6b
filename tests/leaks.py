"""What a sandbox can leave behind on the host, counted so tests can compare before and after."""

from __future__ import annotations

import os
from pathlib import Path


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def snapshot(data_dir: Path) -> dict[str, object]:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    netns = set()
    for pid in pids:
        try:
            netns.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            pass
    sandbox_procs = [p for p in pids if b"/.dsec/" in _cmdline(p) or _cmdline(p).startswith(b"crun")]
    workdirs = data_dir / "sandboxes"
    # Layer mounts under <data_dir>/mnt stay mounted on purpose (one per layer per node, shared
    # by every sandbox); everything else a sandbox mounts must be gone with it.
    layer_mounts = str(data_dir / "mnt") + "/"
    mounts = [line for line in Path("/proc/self/mounts").read_text().splitlines() if layer_mounts not in line]
    return {
        "mounts": len(mounts),
        "cgroups": sorted(
            str(p)
            for p in [
                *Path("/sys/fs/cgroup").glob("*/dsec/sb-*"),
                *Path("/sys/fs/cgroup").glob("*/dsec/*/sb-*"),
            ]
        ),
        "netns": len(netns),
        "sandbox_processes": len(sandbox_procs),
        "workdirs": sorted(p.name for p in workdirs.iterdir()) if workdirs.is_dir() else [],
    }
