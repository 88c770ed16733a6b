"""A container sandbox sees its own CPU and memory limits (issue 28), not the node's: LXCFS's
files over /proc's and /sys's views (backends/container/nodefs.py), and OMP_NUM_THREADS for
nproc, which counts the CPUs it may run on. `make -j$(nproc)`, JVMs, Node and Python pools
size themselves from these."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dsec import Sandbox
from tests.conftest import Sandboxes

VIEWS = r"""
import json, os, subprocess
def run(*argv):
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
mem = next(l.split() for l in run("free", "-m").splitlines() if l.startswith("Mem:"))
print(json.dumps({
    "cpu_count": os.cpu_count(),
    "nproc": int(run("nproc")),
    "free_total_mib": int(mem[1]),
    "meminfo_kib": int(open("/proc/meminfo").readline().split()[1]),
    "cpuinfo": sum(l.startswith("processor") for l in open("/proc/cpuinfo")),
    "stat_cpus": sum(l[:3] == "cpu" and l[3].isdigit() for l in open("/proc/stat")),
    "online": open("/sys/devices/system/cpu/online").read().strip(),
    "uptime": float(open("/proc/uptime").read().split()[0]),
    "loadavg_fields": len(open("/proc/loadavg").read().split()),
}))
"""


async def views(sandbox: Sandbox) -> dict[str, object]:
    out = await sandbox.exec(["python3", "-c", VIEWS], timeout=60)
    assert out.exit_code == 0, out.stderr
    return dict(json.loads(out.stdout))


def host_uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


async def test_a_sandbox_sees_its_own_cpus_and_memory(make_sandbox: Sandboxes) -> None:
    """1 core and 512 MiB: os.cpu_count(), nproc, free -m, /proc/cpuinfo, /proc/stat and
    /sys/devices/system/cpu/online say so; /proc/uptime counts from the sandbox's start."""
    sb = await make_sandbox(cpu_cores_limit=1, memory_limit_mb=512)
    before = host_uptime()
    seen = await views(sb)
    assert seen == {
        "cpu_count": 1,
        "nproc": 1,
        "free_total_mib": 512,
        "meminfo_kib": 512 * 1024,
        "cpuinfo": 1,
        "stat_cpus": 1,
        "online": "0",
        "uptime": seen["uptime"],
        "loadavg_fields": 5,
    }
    assert isinstance(seen["uptime"], float) and seen["uptime"] < before  # not the node's


async def test_a_fraction_of_a_core_rounds_up(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(cpu_cores_limit=0.5, memory_limit_mb=300)
    seen = await views(sb)
    assert (seen["cpu_count"], seen["nproc"], seen["cpuinfo"], seen["free_total_mib"]) == (1, 1, 1, 300)


async def test_a_sandbox_limited_to_the_node_sees_the_node(make_sandbox: Sandboxes) -> None:
    """With the node's cores and memory as its limits a sandbox sees the node's numbers (and
    no OMP_NUM_THREADS that a program would take for a limit)."""
    cores = os.cpu_count() or 1
    total_kib = int(Path("/proc/meminfo").read_text().split()[1])
    sb = await make_sandbox(cpu_cores_limit=cores, memory_limit_mb=total_kib // 1024)
    seen = await views(sb)
    assert (seen["cpu_count"], seen["nproc"], seen["cpuinfo"], seen["stat_cpus"]) == (cores,) * 4
    assert seen["free_total_mib"] == total_kib // 1024
    env = await sb.exec(["sh", "-c", "echo ${OMP_NUM_THREADS-unset}"], timeout=60)
    assert env.stdout.strip() == "unset"


async def test_the_default_base_has_the_tools_a_task_reaches_for(sandbox: Sandbox) -> None:
    """procps (ps, free), curl with CA certificates, pip and venv are in debian:bookworm."""
    script = (
        "set -e; ps -e -o pid=,comm= | grep -q dsec-init; free -m | grep -q '^Mem:'; "
        "curl --version | head -1; test -s /etc/ssl/certs/ca-certificates.crt; "
        "python3 -m venv /tmp/venv; /tmp/venv/bin/python -m pip --version"
    )
    out = await sandbox.run_shell(script, timeout=120)
    assert out.exit_code == 0, out.stdout + out.stderr
    assert out.stdout.startswith("curl ") and "/tmp/venv/lib/python3" in out.stdout, out.stdout
