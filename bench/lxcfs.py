"""What LXCFS (sandboxes that see their own CPUs and memory) costs at density, with a baseline
in the same run.

    .venv/bin/python bench/lxcfs.py [--steps 0,200,1000] [--reads 300] [--idle-s 10]

Two embedded nodes on scratch data directories, one after the other (--off-first: the baseline
first; the second finds the kernel's caches grown by the first): one as shipped (its
LXCFS daemon's files bound over each sandbox's /proc/{cpuinfo,meminfo,stat,uptime,loadavg} and
/sys/devices/system/cpu/online, backends/container/nodefs.py) and one with LXCFS off (the
kernel's own files, what sandboxes saw before). Each is filled to every step with
debian:bookworm sandboxes (64 MiB, 1 core) held with an open shell session. At each step:
  - per read of each file, in one probe sandbox (a Python loop, --reads reads): p50/p99, both
    nodes, and the ratio;
  - the LXCFS daemon's RSS and its growth per held sandbox, and its CPU time over --idle-s s
    of an idle node, after every held sandbox read each file once (LXCFS keeps per-cgroup CPU
    views, and its load-average thread then walks every such cgroup's tasks every 5 s);
  - MemAvailable per held sandbox on each node;
  - creates/s while filling (batches of 50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.backends.container import nodefs
from dsec.sdk.client import Sandbox

FILES = ("/proc/meminfo", "/proc/cpuinfo", "/proc/stat", "/proc/uptime", "/proc/loadavg")
ONLINE = "/sys/devices/system/cpu/online"  # only under LXCFS: the sandbox's /sys is empty without
PROBE = """
import json, sys, time
out = {}
for name in sys.argv[2:]:
    times = []
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        with open(name, "rb") as f:
            f.read()
        times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out))
"""
ARGS = DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=64, cpu_cores_limit=1)


@contextmanager
def lxcfs_off() -> Iterator[None]:
    """The node's LXCFS never starts: sandboxes get the kernel's files."""
    start = nodefs.LxcFs.start

    def off(self: nodefs.LxcFs) -> None:
        self.why_not = "off for the baseline"

    nodefs.LxcFs.start = off  # type: ignore[method-assign]
    try:
        yield
    finally:
        nodefs.LxcFs.start = start  # type: ignore[method-assign]


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable")


def daemon_stats(pid: int) -> tuple[int, float]:
    """(RSS KiB, user+system CPU seconds) of the LXCFS daemon."""
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def reads(sb: Sandbox, n: int, files: tuple[str, ...]) -> dict[str, list[float]]:
    out = await sb.exec(["python3", "-c", PROBE, str(n), *files], timeout=600)
    if out.exit_code != 0:
        raise RuntimeError(out.stderr)
    parsed: dict[str, list[float]] = json.loads(out.stdout)
    return parsed


async def fill(client: DSecClient, held: list[Sandbox], to: int) -> float:
    """Creates/s of filling ``held`` up to ``to`` sandboxes."""
    want = to - len(held)
    if want <= 0:
        return float("nan")
    t0 = time.monotonic()
    while len(held) < to:
        fresh = await client.run_containers(ARGS, min(50, to - len(held)), timeout=600)
        await asyncio.gather(*(sb.run_shell("true") for sb in fresh))
        held += fresh
    return want / (time.monotonic() - t0)


async def run_node(
    label: str, layers: Path, steps: list[int], n: int, idle_s: float
) -> dict[int, dict[str, object]]:
    results: dict[int, dict[str, object]] = {}
    async with scratch_node(f"lxcfs-{label}", layers) as node, DSecClient(node.url, node.api_key) as client:
        probe = await client.run_container(ARGS)
        lxcfs = node.backend.nodefs.lxcfs  # type: ignore[attr-defined]
        pid = lxcfs._daemon() if lxcfs.path else None
        files = (*FILES, ONLINE) if pid else FILES
        base_mem = mem_available_kib()
        held: list[Sandbox] = []
        for step in steps:
            rate = await fill(client, held, step)
            row: dict[str, object] = {"creates_per_s": rate}
            row["mem_kib_per_sb"] = (base_mem - mem_available_kib()) / step if step else float("nan")
            for i in range(0, len(held), 64):  # every sandbox a reader: what LXCFS keeps per cgroup
                await asyncio.gather(*(sb.exec(["cat", *files], timeout=60) for sb in held[i : i + 64]))
            if pid:
                _, cpu0 = daemon_stats(pid)
                await asyncio.sleep(idle_s)  # the measured interval itself, not a wait for something
                rss, cpu1 = daemon_stats(pid)
                row["rss_kib"], row["cpu_s_per_s"] = rss, (cpu1 - cpu0) / idle_s
            row["reads"] = await reads(probe, n, files)
            results[step] = row
            print(f"{label}: {step} held done", flush=True)
    return results


async def main(steps: list[int], n: int, idle_s: float, layers: Path, off_first: bool) -> None:
    # The node filled second finds the kernel's caches grown by the first: --off-first swaps them.
    if off_first:
        with lxcfs_off():
            off = await run_node("off", layers, steps, n, idle_s)
    on = await run_node("on", layers, steps, n, idle_s)
    if not off_first:
        with lxcfs_off():
            off = await run_node("off", layers, steps, n, idle_s)
    print(f"\n{os.cpu_count()} cores; {n} reads per file per step; microseconds per read; LXCFS on vs off")
    for step in steps:
        a, b = on[step], off[step]
        rss = a.get("rss_kib")
        per = ""
        if step and rss is not None:
            per = f", {(int(rss) - int(on[steps[0]]['rss_kib'])) / step:.1f} KiB/sandbox over step {steps[0]}"
        print(
            f"\n{step} held: creates/s on {a['creates_per_s']:.1f} off {b['creates_per_s']:.1f}; "
            f"MemAvailable per sandbox on {a['mem_kib_per_sb']:.0f} KiB off {b['mem_kib_per_sb']:.0f} KiB; "
            f"lxcfs RSS {rss} KiB{per}, CPU {a.get('cpu_s_per_s', 0):.4f} s/s idle"
        )
        print(f"  {'file':32} {'on p50':>8} {'p99':>8} {'off p50':>8} {'p99':>8} {'on/off p50':>11}")
        ra, rb = a["reads"], b["reads"]
        assert isinstance(ra, dict) and isinstance(rb, dict)
        for name in (*FILES, ONLINE):
            xa, xb = ra.get(name, []), rb.get(name, [])
            ratio = pct(xa, 50) / pct(xb, 50) if xa and xb else float("nan")
            print(
                f"  {name:32} {pct(xa, 50) * 1e6:8.0f} {pct(xa, 99) * 1e6:8.0f} "
                f"{pct(xb, 50) * 1e6:8.0f} {pct(xb, 99) * 1e6:8.0f} {ratio:10.1f}x"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="0,200,1000")
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    parser.add_argument("--off-first", action="store_true", help="fill the node without LXCFS first")
    a = parser.parse_args()
    asyncio.run(main([int(s) for s in a.steps.split(",")], a.reads, a.idle_s, a.layers, a.off_first))
