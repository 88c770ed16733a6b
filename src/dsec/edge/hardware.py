"""What this node offers, as placement sees it in the edge's stats (``Hardware.unmet`` matches it)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

_ARCH = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def detect(labels: dict[str, str]) -> dict[str, Any]:
    machine = platform.machine().lower()
    return {
        "arch": _ARCH.get(machine, machine),
        "cpus": os.cpu_count() or 1,
        "memory_mib": _memory_mib(),
        "gpus": sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)),
        "labels": dict(labels),
    }


def _memory_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0
