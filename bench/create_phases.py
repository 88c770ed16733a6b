"""Where a create's time goes as a node fills: phases of one create at each fill level.

    .venv/bin/python bench/create_phases.py [--steps 0,3000] [--probe 20] [--perf DIR]

An embedded node (as bench/density.py's) is filled to each step with sandboxes holding a
session; then --probe sandboxes are created one at a time, each timed in phases (the edge runs
in this process, so its functions are wrapped):
  - api: the client's whole create, HTTP and apiserver included;
  - edge: Edge.create; backend: ContainerBackend.create; crun: `crun run --detach` from fork
    to exit (namespaces, cgroups, mounts, pivot, init started); session: the first run_shell;
and, outside the edge, the kernel primitives a create uses, timed directly:
  - cpu: CPU time of the edge and its reaped children (crun, ...) per create and session;
  - cgroup: mkdir + rmdir of one cgroup in every v1 hierarchy under the node's parent;
  - quota: one write of cpu.cfs_quota_us to a fresh cpu cgroup under the node's parent (the
    kernel checks every cpu cgroup of the node on each such write);
  - exec: fork + exec of `true` from this process, which is the edge's: its file table grows
    with the held sessions (2 fds each), and the child closes them all; the edge's own spawns go
    through a spawner with a small one (native/spawner.py), so read what follows against it;
  - netns/ipcns/mntns/pidns: `unshare` of that namespace alone (fork + exec of true included);
  - tmpfs: mount + umount of a tmpfs in a private mount namespace.
With --perf DIR, `perf record -a -g` runs during each step's probe (DIR/perf-<step>.data).
Medians; compare the steps of one run (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _perf import recording
from _stats import pct
from density import LABEL, MEM_FLOOR, fill, meminfo
from dsec import DSecClient, DSecContainerRunArgs
from dsec.backends.container import cgroups
from dsec.native import rootfs
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.sdk.client import Sandbox

GiB = 1 << 30
CGROUPS = Path("/sys/fs/cgroup")
phases: dict[str, list[float]] = defaultdict(list)


def wrap(owner: Any, name: str, phase: str) -> None:
    orig = getattr(owner, name)

    async def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return await orig(*args, **kwargs)
        finally:
            phases[phase].append(time.perf_counter() - t)

    setattr(owner, name, timed)


def time_crun() -> None:
    """`crun run` from fork to exit, through dsec-rootfs (its private mount namespace): wraps
    ``rootfs.run``, which the backend starts it with."""
    real = rootfs.run

    async def run_timed(helper: Path, overlay: str, root: Path, argv: list[str], *a: Any, **kw: Any) -> int:
        t = time.perf_counter()
        rc = await real(helper, overlay, root, argv, *a, **kw)
        if "run" in argv and "--detach" in argv:
            phases["crun"].append(time.perf_counter() - t)
        return rc

    rootfs.run = run_timed  # type: ignore[assignment]


def primitives(reps: int, parent: str) -> dict[str, float]:
    """Under the bench node's own parent cgroup (``parent``), beside its sandboxes."""
    hier = [c for c in CGROUPS.iterdir() if (c / parent).is_dir()]
    out: dict[str, list[float]] = defaultdict(list)
    for i in range(reps):
        t = time.perf_counter()
        for c in hier:
            (c / parent / f"probe-{i}").mkdir()
        for c in hier:
            (c / parent / f"probe-{i}").rmdir()
        out["cgroup"].append(time.perf_counter() - t)
        quota = CGROUPS / "cpu" / parent / f"probe-q{i}"
        quota.mkdir()
        try:
            t = time.perf_counter()
            (quota / "cpu.cfs_quota_us").write_text("100000")
            out["quota"].append(time.perf_counter() - t)
        finally:
            quota.rmdir()
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        out["exec"].append(time.perf_counter() - t)
        for ns in ("net", "ipc", "mount", "pid"):
            t = time.perf_counter()
            subprocess.run(["unshare", f"--{ns}", "--fork", "true"], check=True)
            out[ns + "ns"].append(time.perf_counter() - t)
        t = time.perf_counter()
        subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs t /mnt && umount /mnt"], check=True)
        out["tmpfs"].append(time.perf_counter() - t)
    return {k: pct(v, 50) for k, v in out.items()}


async def probe(client: DSecClient, n: int, made: list[Sandbox]) -> None:
    args = DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=64, labels=LABEL)
    for _ in range(n):
        t = time.perf_counter()
        sb = await client.run_container(args)
        phases["api"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.run_shell("true")
        phases["session"].append(time.perf_counter() - t)
        made.append(sb)


def slab_mib() -> float:
    return meminfo()["Slab"] / (1 << 20)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="0,3000")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--probe", type=int, default=20)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--perf", type=Path, default=None, help="perf record -a -g each probe here")
    ap.add_argument("--data-dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args()
    steps = sorted({int(s) for s in a.steps.split(",")})
    scratch = a.data_dir or Path(tempfile.mkdtemp(prefix="dsec-bench-phases-"))
    node = EmbeddedNode(
        NodeConfig(
            data_dir=scratch,
            layer_dir=a.layers,
            port=0,
            node="bench",
            config_file=scratch / "config.json",
            edge={"max_sandboxes": 20_000, "memory_reserve_mb": 256},
        )
    )
    await node.start()
    edge = node.edge
    wrap(edge, "create", "edge")
    wrap(edge.backends["container"], "create", "backend")
    time_crun()
    order = ["api", "edge", "backend", "crun", "session", "cpu"]
    print(f"cores {os.cpu_count()}  steps {steps}  probe {a.probe} (sequential creates; ms, p50)")
    made: list[Sandbox] = []
    base: dict[str, float] = {}
    try:
        async with DSecClient(node.url, node.api_key) as client:
            await fill(client, 1, 1, made)  # warm: the layer mounted
            for step in steps:
                if step > len(made):
                    if meminfo()["MemAvailable"] < MEM_FLOOR + GiB:
                        print("stopped: memory")
                        break
                    t = time.perf_counter()
                    rate = await fill(client, step - len(made), a.batch, made)
                    print(f"filled to {len(made)} in {time.perf_counter() - t:.0f} s ({rate:.1f}/s)")
                phases.clear()
                async with recording(a.perf, str(step)):
                    cpu = os.times()
                    await probe(client, a.probe, made)
                    spent = os.times()
                # CPU (edge + its reaped children: crun, dsec-enter) per create and session:
                # steadier than wall time on a shared machine.
                phases["cpu"] = [
                    (spent.user + spent.system + spent.children_user + spent.children_system)
                    - (cpu.user + cpu.system + cpu.children_user + cpu.children_system)
                ]
                phases["cpu"][0] /= a.probe
                got = {k: pct(phases[k], 50) for k in order}
                got.update(await asyncio.to_thread(primitives, 10, cgroups.parent_name("bench", scratch)))
                base = base or got
                cells = "  ".join(f"{k} {v * 1e3:6.1f} ({v / base[k]:4.2f}x)" for k, v in got.items())
                print(f"{len(made):6d} held  slab {slab_mib():7.0f} MiB  {cells}", flush=True)
            await client.stop_all(LABEL)
    finally:
        await node.close(stop_sandboxes=True)
        if a.data_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
