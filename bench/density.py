"""How a node fills: sandboxes held at once, and what each costs, as the count grows.

    .venv/bin/python bench/density.py [--steps 0,500,1000,2000] [--batch 50] [--probe 40] [--perf DIR]

An embedded node (containers only, no swap) on a scratch data directory sharing `dsec up`'s
layer store. The node is filled in batches (`run_containers`), and every sandbox gets an open
shell session (`run_shell("true")`), as a trainer's would. At each step it prints, with the
core count:
  - creations/s of a probe of --probe creates at that fill, and the ratio to the empty node
    (fresh cgroups: the spares destroyed sandboxes leave, backends/container/spares.py, are
    dropped first);
  - replacements/s (the RL steady state): --probe/2 held sandboxes destroyed, then as many
    created in their place, timed together; with spare cgroups (the new ones run in the
    destroyed ones' cgroups) and without, twice each (with, without, without, with: means), each
    with its ratio to the empty node's; and the creates of those with spares alone (what a
    full node's creates run at: it creates as it destroys);
  - the machine's CPU per probe create (with its first command), and the part of it the
    host's own agents took: not DSec's, but on the VMs this was measured on, PID 1 is an agent
    whose cost grows with the node's network namespaces, and DAMON walks the layer pages every
    sandbox maps (docs/decisions.md); the rest, and its ratio to the empty node's, is what the
    creates themselves grew by;
  - run_shell("true") p50/p99 on --probe sandboxes, and the ratio to the empty node;
  - host memory per sandbox since the start: MemAvailable drop / count, and (overlapping
    views of it) what the sandboxes' cgroups are charged, kernel slab, the edge's own RSS;
  - processes, threads and file descriptors the node holds (the per-node limits that bind),
    and the edge's fds per held sandbox (RLIMIT_NOFILE caps the count: 20,000 here);
  - the Python objects the garbage collector tracks per held sandbox (this process's: the
    edge's, and the bench client's handles, a few per sandbox) and how long one full
    collection holds the event loop (what the edge's gen-2 collections cost at this fill).
Filling stops early, saying so, when MemAvailable falls under --mem-floor-gib (the machine is
shared).
At the end, every sandbox is destroyed at once: destroys/s, the MemAvailable that came back of
what the held sandboxes took, and the memory cgroups the kernel still holds (a cgroup removed
with pages still charged stays, dying, until memory runs short).
Before filling, on the empty node: the page cache grown by --sharing sandboxes reading the same
layer files (the node's clean page cache is dropped first, so the first read is real), and
the memory returned when --reclaim idle sandboxes holding 32 MiB each are paused (memory
pushed to the node's swap file).
With --perf DIR, `perf record -a -g` runs during each step's probe (its creates, then their first
commands): DIR/perf-<step>.data, and during each replacement run:
DIR/perf-<step>-replace-{with,without}-<i>.data.
The machine is shared and noisy: compare the ratios of one run.
The LS/BE latency inflation (an LS task next to best-effort load at 50% of the node, with and
without CPU classes) is bench/cpuclass.py's: `./setup.sh bench cpuclass`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _perf import recording
from _rl.host import wait_until
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs, _linux
from dsec.backends.container import cgroups, spares
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.container.spares import PER_BUCKET
from dsec.density.swap import SwapConfig
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.sdk.client import Sandbox

MiB = 1 << 20
GiB = 1 << 30
MEM_FLOOR = 3 * GiB  # --mem-floor-gib


class ShortOfMemory(Exception):
    pass


LABEL = {"bench": "density"}


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def own(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


NODE_PARENT = ""  # the bench node's parent cgroup (cgroups.parent_name), set by main


def charged() -> int:
    """What the bench node's sandboxes are charged (its parent cgroup: not another node's)."""
    try:
        return int((cgroups.CGROUP_ROOT / "memory" / NODE_PARENT / "memory.usage_in_bytes").read_text())
    except OSError:
        return 0


TICK = os.sysconf("SC_CLK_TCK")


def _ticks(pid: str) -> int:
    fields = _linux.stat_fields(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])


def cpu_seconds() -> tuple[float, float]:
    """CPU time the whole machine has spent busy, and the part of it the host's own agents
    spent, which are not DSec's: its PID 1 (on the VMs this was measured on, an agent whose cost
    grows with the node's network namespaces) and DAMON's kdamond threads (rmap walks over the
    layer pages every sandbox maps)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    kdamonds = [p for p in os.listdir("/proc") if p.isdigit() and _comm(p).startswith("kdamond")]
    host = sum(_ticks(p) for p in ["1", *kdamonds])
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK, host / TICK


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


def snapshot() -> dict[str, int]:
    m = meminfo()
    return {
        "available": m["MemAvailable"],
        "slab": m["Slab"],
        "charged": charged(),
        "edge_rss": own("VmRSS") * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
    }


async def fill(client: DSecClient, n: int, batch: int, made: list[Sandbox]) -> float:
    """Create ``n`` more sandboxes, each with an open session; returns creations per second."""
    args = DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=64, labels=LABEL)
    t = time.perf_counter()
    left = n
    while left > 0:
        if meminfo()["MemAvailable"] < MEM_FLOOR:
            raise ShortOfMemory(f"MemAvailable {meminfo()['MemAvailable'] / GiB:.1f} GiB at {len(made)} held")
        sizes = [min(batch, left - i * batch) for i in range(2) if left - i * batch > 0]
        for group in await asyncio.gather(*(client.run_containers(args, k, timeout=600) for k in sizes)):
            made.extend(group)
        left -= sum(sizes)
    rate = n / (time.perf_counter() - t) if n else 0.0
    fresh = made[len(made) - n :]
    for i in range(0, len(fresh), 64):
        await asyncio.gather(*(sb.run_shell("true") for sb in fresh[i : i + 64]))
    return rate


async def churn(
    client: DSecClient, n: int, batch: int, made: list[Sandbox], container: ContainerBackend, per_bucket: int
) -> tuple[float, float]:
    """Replace ``n`` held sandboxes, keeping up to ``per_bucket`` spare cgroup sets per bucket
    (the caller cleared the node's spares): destroy ``n``, then create ``n`` (each with a
    session). Returns replacements per second (the destroys and the creates timed) and creates
    per second (the creates alone: what a full node's creates run at)."""
    container.spares.per_bucket = per_bucket
    gone = random.sample(made, min(n, len(made)))
    made[:] = [sb for sb in made if sb not in gone]
    t = time.perf_counter()
    await asyncio.gather(*(sb.stop() for sb in gone))
    took = time.perf_counter() - t
    rate = await fill(client, len(gone), batch, made)
    return len(gone) / (took + len(gone) / rate), rate


async def exec_latency(made: list[Sandbox], probe: int) -> list[float]:
    lat = []
    for sb in random.sample(made, min(probe, len(made))):
        t = time.perf_counter()
        r = await sb.run_shell("true")
        lat.append(time.perf_counter() - t)
        assert r.exit_code == 0, r
    return lat


async def sharing(client: DSecClient, n: int) -> None:
    """n sandboxes read the same files of their base layer: how much the page cache grows."""
    args = DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=256)
    boxes = [await client.run_container(args) for _ in range(n)]
    read = "tar cf - /usr/lib/python3.11 /usr/lib/x86_64-linux-gnu 2>/dev/null | wc -c"
    try:
        # Clean page cache goes (node-wide, nothing is lost): the first reader reads from disk.
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        before = meminfo()["Cached"]
        nbytes = int((await boxes[0].run_shell(read, timeout=600)).stdout)
        first = meminfo()["Cached"] - before
        for sb in boxes[1:]:
            await sb.run_shell(read, timeout=600)
        total = meminfo()["Cached"] - before
        print(
            f"page cache: {n} sandboxes each read {nbytes / MiB:.0f} MiB of layer files; cache grew"
            f" {first / MiB:.0f} MiB for the first, {total / MiB:.0f} MiB for all"
            f" (sharing factor {n * first / max(total, 1):.1f}x: unshared would be {n * first / MiB:.0f} MiB)"
        )
    finally:
        for sb in boxes:
            await sb.stop()


HOG = "{ head -c 32M /dev/urandom; sleep 100000; } | sort -S 64M > /dev/null & echo started"


async def reclaim(client: DSecClient, n: int) -> None:
    """n sandboxes touch 32 MiB each and go idle; pausing them (the edge's reclaim) returns it."""
    labels = {"bench": "reclaim"}
    args = DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=128, labels=labels)
    boxes = await client.run_containers(args, n)
    try:
        await asyncio.gather(*(sb.run_shell(HOG) for sb in boxes))
        usage = [cgroups.memory_dir(sb.id) / "memory.usage_in_bytes" for sb in boxes]
        await wait_until(lambda: sum(int(c.read_text()) for c in usage) >= n * 30 * MiB, "the hogs' memory")
        held = sum(int(c.read_text()) for c in usage)
        before = meminfo()["MemAvailable"]
        t = time.perf_counter()
        await client.pause_all(labels)
        took = time.perf_counter() - t
        await wait_until(lambda: meminfo()["Writeback"] < MiB, "swap writes to finish", 120)
        after = meminfo()["MemAvailable"]
        left = sum(int(c.read_text()) for c in usage)
        print(
            f"reclaim: {n} idle sandboxes held {held / MiB:.0f} MiB; pausing them all took {took:.1f} s,"
            f" charged {left / MiB:.0f} MiB after ({1 - left / held:.1%} returned),"
            f" MemAvailable +{(after - before) / MiB:.0f} MiB"
        )
    finally:
        await client.stop_all(labels)


def memory_cgroups() -> int:
    """Memory cgroups the kernel holds, dying ones included."""
    for line in Path("/proc/cgroups").read_text().splitlines():
        if line.startswith("memory\t"):
            return int(line.split()[2])
    return 0


async def teardown(client: DSecClient, start: dict[str, int], n: int) -> None:
    """Destroy every sandbox at once: the rate, and what the node got back."""
    held, cgroups_held = snapshot(), memory_cgroups()
    t = time.perf_counter()
    await client.stop_all(LABEL)
    took = time.perf_counter() - t
    kept = len(spares.spare_dirs(NODE_PARENT)) // len(cgroups.v1_controllers())  # live, until the node closes
    # The kernel frees removed cgroups in the background: the count settles within seconds
    # (dying ones, kept by charged pages, never do: the count then says how many).
    with contextlib.suppress(TimeoutError):
        settled = cgroups_held - n + kept
        await wait_until(lambda: memory_cgroups() <= settled, "removed memory cgroups freed", 10)
    after = snapshot()
    taken = start["available"] - held["available"]
    back = after["available"] - held["available"]
    print(
        f"destroyed {n} in {took:.1f} s ({n / took:.0f}/s): MemAvailable back {back / MiB:.0f} of"
        f" {taken / MiB:.0f} MiB ({back / max(taken, 1):.0%}); memory cgroups {cgroups_held} held,"
        f" {memory_cgroups()} after (dying ones count, and {kept} spares)"
    )


def full_collection() -> tuple[int, float]:
    """Objects the collector tracks, and one full collection's time (the loop is held as long)."""
    t = time.perf_counter()
    gc.collect()
    return len(gc.get_objects()), time.perf_counter() - t


def node_limits() -> str:
    procs = sum(1 for p in os.listdir("/proc") if p.isdigit())
    fds = len(os.listdir("/proc/self/fd"))
    return f"host processes {procs}, edge threads {own('Threads')}, edge fds {fds}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="0,500,1000,2000")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--probe", type=int, default=40)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--sharing", type=int, default=20, help="sandboxes reading the same layer files")
    ap.add_argument("--reclaim", type=int, default=32, help="idle sandboxes whose memory is reclaimed")
    ap.add_argument("--perf", type=Path, default=None, help="perf record -a -g each probe here")
    ap.add_argument("--mem-floor-gib", type=float, default=3.0, help="stop filling below this MemAvailable")
    a = ap.parse_args()
    global MEM_FLOOR, NODE_PARENT
    MEM_FLOOR = int(a.mem_floor_gib * GiB)
    steps = sorted({int(s) for s in a.steps.split(",")})
    scratch = Path(tempfile.mkdtemp(prefix="dsec-bench-density-"))
    NODE_PARENT = cgroups.parent_name("bench", scratch)
    node = EmbeddedNode(
        NodeConfig(
            data_dir=scratch,
            layer_dir=a.layers,
            port=0,
            node="bench",
            config_file=scratch / "config.json",
            edge={
                "swap": SwapConfig("file", 2048, scratch / "swap"),
                "max_sandboxes": 20_000,
                "memory_reserve_mb": 256,
            },
        )
    )
    await node.start()
    print(f"cores {os.cpu_count()}  steps {steps}  probe {a.probe}")
    made: list[Sandbox] = []
    base_rate = base_exec = base_churn = base_fresh = base_spared = base_ours = base_gc = 0.0
    container = node.backend
    assert isinstance(container, ContainerBackend)
    try:
        async with DSecClient(node.url, node.api_key) as client:
            await fill(client, 1, 1, made)  # warm: the layer mounted
            if a.sharing:
                await sharing(client, a.sharing)
            if a.reclaim:
                await reclaim(client, a.reclaim)
            start = snapshot()
            start_objects, _ = full_collection()
            for step in steps:
                try:
                    if step > len(made):
                        await fill(client, step - len(made) - a.probe, a.batch, made)
                    container.spares.clear()  # fresh cgroups: the churn probe has the spares
                    busy0, init0 = cpu_seconds()  # (a listing of /proc: before and after the probe)
                    async with recording(a.perf, str(step)):  # the probe: creates at this fill
                        rate = await fill(client, a.probe, a.batch, made)
                    busy1, init1 = cpu_seconds()
                    cpu, host_init = (busy1 - busy0) / a.probe * 1e3, (init1 - init0) / a.probe * 1e3
                    lat = await exec_latency(made, a.probe)
                    # With, without, without, with: neither has the other's aftermath alone.
                    taken, runs = container.spares.taken, defaultdict(list)
                    for i, per_bucket in enumerate((PER_BUCKET, 0, 0, PER_BUCKET)):
                        with_or_not = "with" if per_bucket else "without"
                        container.spares.clear()  # (a listing of every bucket: not recorded)
                        async with recording(a.perf, f"{step}-replace-{with_or_not}-{i}"):
                            r = await churn(client, a.probe // 2, a.batch, made, container, per_bucket)
                        runs[per_bucket].append(r)
                    container.spares.per_bucket = PER_BUCKET
                    taken = container.spares.taken - taken
                    replaced, fresh = (statistics.mean(r for r, _ in runs[k]) for k in (PER_BUCKET, 0))
                    in_spares = statistics.mean(c for _, c in runs[PER_BUCKET])
                except ShortOfMemory as exc:
                    print(f"stopped filling: {exc} (floor {a.mem_floor_gib} GiB)")
                    break
                base_rate, base_exec = base_rate or rate, base_exec or pct(lat, 50)
                base_churn, base_fresh = base_churn or replaced, base_fresh or fresh
                base_spared = base_spared or in_spares
                base_ours = base_ours or cpu - host_init
                objects, pause = full_collection()
                base_gc = base_gc or pause
                now, n = snapshot(), len(made) - 1
                per = {
                    k: (start[k] - now[k] if k == "available" else now[k] - start[k]) / max(n, 1) / MiB
                    for k in now
                    if k != "fds"
                }
                fds = (now["fds"] - start["fds"]) / max(n, 1)
                print(
                    f"{len(made):6d} held  creates {rate:6.1f}/s ({rate / base_rate:4.2f}x empty)"
                    f"  run_shell p50 {pct(lat, 50) * 1e3:6.2f} ms p99 {pct(lat, 99) * 1e3:6.2f} ms"
                    f" ({pct(lat, 50) / base_exec:4.2f}x empty)"
                )
                print(
                    f"        machine CPU per create (with its first command): {cpu:5.1f} ms, of which the"
                    f" host's PID 1 and kdamond {host_init:5.1f} ms; the rest {cpu - host_init:5.1f} ms"
                    f" ({(cpu - host_init) / base_ours:4.2f}x empty)"
                )
                print(
                    f"        replacements (destroy, then create): {replaced:6.1f}/s with spare cgroups"
                    f" ({replaced / base_churn:4.2f}x empty; {taken} of {a.probe} creates in spares),"
                    f" {fresh:6.1f}/s without ({fresh / base_fresh:4.2f}x empty; {replaced / fresh:4.2f}x);"
                    f" their creates alone {in_spares:6.1f}/s ({in_spares / base_spared:4.2f}x empty)"
                )
                print(
                    f"        per sandbox: MemAvailable {-per['available']:+6.2f} MiB; of which (overlapping)"
                    f" charged to its cgroup {per['charged']:5.2f}, kernel slab {per['slab']:5.2f},"
                    f" edge RSS {per['edge_rss']:5.2f} MiB, edge fds {fds:4.2f};  {node_limits()}"
                )
                per_box = (objects - start_objects) / max(n, 1)
                print(
                    f"        Python objects tracked {objects} ({per_box:5.1f} per sandbox);"
                    f" a full collection {pause * 1e3:6.1f} ms ({pause / base_gc:5.2f}x empty)"
                )
            await teardown(client, start, len(made))
    finally:
        await node.close(stop_sandboxes=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
