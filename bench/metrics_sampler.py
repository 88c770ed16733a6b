"""What the edge's metrics sampler (dsec.edge.metrics) costs at many sandboxes.

    sudo .venv/bin/python bench/metrics_sampler.py [--sandboxes 1000 4000] [--ticks 5]

Makes that many empty sandbox cgroups (memory and cpuacct, cgroup v1) under a parent of its
own, records standing for running container sandboxes, and times the sampler's tick over them
(the reads a real tick does: cpuacct.usage, memory.usage_in_bytes, memory.stat), then the
memory a full ring holds. Everything made is removed however the bench ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass

from dsec.backends.container import cgroups
from dsec.edge import metrics
from dsec.edge.journal import Record
from dsec.protocol.models import ContainerSpec, SandboxState

PARENT = f"dsec-bench-metrics-{os.getpid()}"
HIERARCHIES = ("memory", "cpuacct")


@dataclass
class Held:
    record: Record


def make(n: int) -> dict[str, Held]:
    live = {}
    for h in HIERARCHIES:
        (cgroups.CGROUP_ROOT / h / PARENT / "00").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        sid = f"sb-bench-1-{i:06d}"
        for h in HIERARCHIES:
            (cgroups.CGROUP_ROOT / h / PARENT / "00" / sid).mkdir(exist_ok=True)
        cgroups.place(sid, f"{PARENT}/00")
        rec = Record(sid, SandboxState.running, "container", ContainerSpec(image="x:1"), [], {})
        live[sid] = Held(rec)
    return live


def remove() -> None:
    for h in HIERARCHIES:
        bucket = cgroups.CGROUP_ROOT / h / PARENT / "00"
        with contextlib.suppress(OSError):
            for d in bucket.iterdir():
                if d.is_dir():
                    d.rmdir()
        for d in (bucket, bucket.parent):
            with contextlib.suppress(OSError):
                d.rmdir()


async def measure(n: int, ticks: int) -> None:
    live = make(n)
    sampler = metrics.MetricsSampler(lambda: live, lambda rec: None)  # type: ignore[arg-type,return-value]
    await sampler.tick()  # the series are made here: not what a steady tick costs
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(ticks):
        await sampler.tick()
    cpu, wall = (time.process_time() - cpu0) / ticks, (time.perf_counter() - wall0) / ticks
    share = cpu / metrics.INTERVAL_S * 100
    print(
        f"  {n:6d} sandboxes: a tick {cpu * 1e3:7.1f} ms CPU ({cpu / n * 1e6:5.1f} us each), "
        f"{wall * 1e3:7.1f} ms wall; {share:4.1f} % of one core at one tick per {metrics.INTERVAL_S:g} s"
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--ticks", type=int, default=5)
    a = ap.parse_args()
    if not (cgroups.CGROUP_ROOT / "memory").is_dir():
        sys.exit("needs the cgroup v1 memory hierarchy (/sys/fs/cgroup/memory)")
    print(f"cores {os.cpu_count()}  ring {metrics.CAPACITY} samples x {metrics.INTERVAL_S:g} s")
    try:
        for n in a.sandboxes:
            await measure(n, a.ticks)
    finally:
        remove()
    full = metrics._Series(base=time.time(), cpu_count=2, mem_total=1 << 30, disk_total=0)
    for i in range(metrics.CAPACITY):
        full.push(metrics._Reading(full.base + i, 0, 0, 0, 0), 0.0)
    ring = full.rows.buffer_info()[1] * full.rows.itemsize
    print(f"  a full ring: {ring} bytes of samples (+ ~{sys.getsizeof(full.rows) - ring} of array)")


if __name__ == "__main__":
    asyncio.run(main())
