"""Memory and CPU of a process, from /proc."""

from __future__ import annotations

import gc
import os
from pathlib import Path


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def settled_rss_mib() -> float:
    """This process's resident memory after a full collection (garbage is not state)."""
    gc.collect()
    return rss_mib()


def cpu_seconds(pid: int) -> float:
    """User + system time of a process, all its threads, so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """(the main thread's, every other thread's) CPU time: the event loop runs on the main one."""
    main = 0.0
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        total += s
        if task.name == str(pid):
            main = s
    return main, total - main
