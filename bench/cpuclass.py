"""A latency-sensitive task next to best-effort load, with and without CPU classes.

    .venv/bin/python bench/cpuclass.py [--steps 60] [--load-cores 1]

An embedded node (containers only) on a scratch data directory sharing `dsec up`'s layer store.
The LS sandbox runs a fixed CPU-bound step (a shell loop, ~tens of ms) again and again through
`run_shell`; its per-step latency p50/p99 is measured three times in the same run:
  - alone (the baseline);
  - next to load sandboxes that spin on ``--load-cores`` cores (default 1 = 50% of this 2-core
    node), the load in the same class as the task (no classes: what an unprotected node does);
  - next to the same load in the best-effort class (SCHED_IDLE, cpu.shares 2).
It prints each with its inflation over the baseline. The machine is shared and noisy: compare
the ratios of one run, not runs with each other.

The first line also says whether core scheduling was on (the container backend's
``core_scheduling`` capability, and why not): with it, each LS sandbox (the task, and each
same-class load sandbox) has a cookie of its own, so on an SMT CPU the task never shares a
physical core with the load; without it (this project's hosts: no CONFIG_SCHED_CORE, no SMT)
the figures are those of SCHED_IDLE and cpu.shares alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Literal

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.density import coresched
from dsec.sdk.client import Sandbox

STEP = "i=0; while [ $i -lt 40000 ]; do i=$((i+1)); done"  # CPU only, in the session's shell
SPIN = "while :; do :; done"


async def steps(task: Sandbox, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        r = await task.run_shell(STEP)
        assert r.exit_code == 0, r
        lat.append(time.perf_counter() - t)
    return lat


async def under_load(
    client: DSecClient, task: Sandbox, n: int, cores: int, cls: Literal["ls", "be"]
) -> list[float]:
    load = [
        await client.run_container(
            DSecContainerRunArgs(container_image="debian:bookworm", cpu_cores_limit=1, cpu_class=cls)
        )
        for _ in range(cores)
    ]
    try:
        spinners = [asyncio.ensure_future(sb.run_shell(SPIN, timeout=3600)) for sb in load]
        await asyncio.sleep(1.0)  # let the spinners reach full speed (a warm-up, not a sync)
        lat = await steps(task, n)
        for s in spinners:
            s.cancel()
        return lat
    finally:
        for sb in load:
            await sb.stop()


def line(name: str, lat: list[float], base: list[float] | None) -> str:
    p50, p99 = pct(lat, 50) * 1e3, pct(lat, 99) * 1e3
    ratio = "" if base is None else f"  inflation p50 {p50 / (pct(base, 50) * 1e3) - 1:+.1%}"
    return f"  {name:<40} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms{ratio}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--load-cores", type=int, default=1)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    share = a.load_cores / cores
    print(f"cores {cores}  load {a.load_cores} core(s) = {share:.0%} of the node  steps {a.steps}")
    # The embedded node's backend decides with this same probe (one per process).
    core = coresched.node_support()
    state = "on (a cookie per LS sandbox)" if core.available else f"off ({core.why_not})"
    print(f"core scheduling: {state}")
    async with scratch_node("cpuclass", a.layers) as node:
        async with DSecClient(node.url, node.api_key) as client:
            task = await client.run_container(DSecContainerRunArgs(container_image="debian:bookworm"))
            await steps(task, 5)  # warm
            base = await steps(task, a.steps)
            same = await under_load(client, task, a.steps, a.load_cores, "ls")
            be = await under_load(client, task, a.steps, a.load_cores, "be")
            await task.stop()
        print(line("LS task alone (baseline)", base, None))
        print(line("next to load of the same class", same, base))
        print(line("next to best-effort load (classes)", be, base))


if __name__ == "__main__":
    asyncio.run(main())
