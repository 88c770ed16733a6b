"""The control plane at the original's scale: 160 nodes, 380,000 sandboxes, >= 5,000 creates/s.

    .venv/bin/python bench/controlplane.py [--quick] [--apiservers 1] [--quota] [--json out.json]

No real sandbox runs: nodes are simulated edges (bench/_controlplane/simedge.py) that admit
up to 3,200 sandboxes each (the original's stable point per node) and keep an entry per live
sandbox. Prints, with the core count and p50/p99, each figure beside a baseline from the
same run:
  A. placement alone (real Placement + Watcher, simulated time): load imbalance (busiest node
     / mean) after placing 380,000 sandboxes on 160 nodes while 4 apiservers, each with its own
     watcher polling every second and its own in-flight overlay, place 5,000 creates/s that
     take 40 ms each on their node. Power of k=2 (the default) and k=3 vs random (k=1), plus
     a what-if overlay that is not in src; and `Placement.choose` decisions per second.
  B. the real create path over HTTP (auth, placement, IAM reserve, edge link) of --apiservers
     processes, from a load generator in this process: an open-loop ladder of arrival rates,
     each held for a few seconds; the figure is the highest rate served with p99 < 100 ms.
     Baseline: the same ladder on GET /v1/sandboxes/{id} (same server, auth, routing by ID,
     one edge call; no IAM write, no placement). Then each at saturation (closed loop), where
     a create's wall time goes step by step, and a cProfile of the apiserver's event loop.
  C. apiserver memory per 100,000 live sandboxes (RSS after gc, in a process of its own,
     through the create handler without HTTP) vs the edges' own growth for as many.

Limits, said again in the output: on 2 cores the load generator and every apiserver share the
CPUs, so B is a floor; the edge link is in memory (the apiserver's HTTP client to its edges,
and the watcher's 160 polls a second, cost a real cluster more); with --apiservers N > 1 each
process simulates its own 160 nodes (in-memory edges cannot be shared across processes), so
only A says anything about imbalance across apiservers. IAM is SQLite in a scratch directory
unless --iam names a store; --quota puts a finite quota on the project the load bills to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from _controlplane.apiproc import ServerConfig
from _controlplane.createpath import SPAWN, best, phase_http, setup_iam
from _controlplane.loadgen import Run
from _controlplane.memory import MemoryConfig, measure
from _controlplane.placesim import PlaceResult, simulate
from _stats import pct
from dsec.protocol.models import ContainerSpec, CreateRequest

TARGET_CREATES = 5000


# ---------------------------------------------------------------- A: placement


def phase_placement(a: argparse.Namespace) -> list[PlaceResult]:
    print(
        f"\n== A. placement: {a.sandboxes:,} sandboxes on {a.nodes} nodes (capacity {a.capacity:,}),"
        f" {a.place_apiservers} apiservers, {a.place_rate:,}/s, poll every {a.poll_s:g} s,"
        f" create {a.place_create_ms:g} ms (simulated time)"
    )
    configs = [(k, "stock") for k in a.k] + ([(2, "since-poll")] if a.what_if else [])
    results = []
    marks = "imbalance at 10% / 50% / 100%"
    print(f"  {'placement':<26} {marks:>32}  max/mean/min node  choose p50/p99  refused")
    for k, variant in configs:
        r = asyncio.run(
            simulate(
                k=k,
                variant=variant,
                sandboxes=a.sandboxes,
                nodes=a.nodes,
                capacity=a.capacity,
                apiservers=a.place_apiservers,
                rate=a.place_rate,
                poll_s=a.poll_s,
                create_s=a.place_create_ms / 1000,
                seed=a.seed,
            )
        )
        name = {1: "random (k=1)"}.get(k, f"power of k={k}") + ("" if variant == "stock" else " what-if*")
        marks = " / ".join(f"{v:.4f}" for _, v in sorted(r.imbalance.items()))
        print(
            f"  {name:<26} {marks:>32}  {r.max_node:,}/{r.mean_node:,.0f}/{r.min_node:,}"
            f"  {pct(r.choose_s, 50) * 1e6:5.1f}/{pct(r.choose_s, 99) * 1e6:5.1f} us  {r.rejected:7,}"
        )
        results.append(r)
    if a.what_if:
        print("  * not in src: the overlay keeps every create placed since the last poll, not just those")
        print("    in flight (the stock overlay forgets a create when its edge answers; the snapshot")
        print("    learns of it only at the next poll)")
    return results


# ---------------------------------------------------------------- C: memory


def phase_memory(a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    n = 10_000 if a.quick else a.memory_sandboxes
    print(f"\n== C. apiserver memory: {n:,} live sandboxes through the create handler (no HTTP)")
    iam_url = a.iam or str(scratch / "iam-memory.sqlite")
    project, key, _ = asyncio.run(setup_iam(iam_url, a.quota))
    body = CreateRequest(spec=ContainerSpec(image="debian:bookworm"), project=project).model_dump_json()
    server = ServerConfig(
        iam_url,
        nodes=a.nodes,
        capacity=a.capacity,
        wire=not a.no_wire,
        poll_s=a.poll_s,
        reconcile=False,  # its lists are transient, one node's at a time
        stages=False,  # the stage timings would be per-sandbox state of the bench's own
    )
    cfg = MemoryConfig(server, key, body.encode(), sandboxes=n, traced=min(n, 5_000))
    with ProcessPoolExecutor(max_workers=1, mp_context=SPAWN) as pool:
        m = pool.submit(measure, cfg).result()
    per = 100_000 / n
    s0, created, read = m["rss_alone_mib"]
    e0, e_created = m["rss_with_edges_mib"]
    m["apiserver_mib_per_100k"] = (created - s0) * per
    m["project_cache_mib_per_100k"] = (read - created) * per
    m["edges_mib_per_100k"] = ((e_created - e0) - (created - s0)) * per
    print(f"  RSS, settled: {s0:.1f} MiB (apiserver, {a.nodes} simulated edges, interpreter)")
    print(f"  {'RSS growth per 100k live':<44} {'apiserver':>10} {'edges (baseline)':>17}")
    api, edges = m["apiserver_mib_per_100k"], m["edges_mib_per_100k"]
    print(f"  {'  after the creates':<44} {api:10.2f} {edges:17.2f} MiB")
    print(f"  {'  + one GET of each (fills the project cache)':<44} {m['project_cache_mib_per_100k']:10.2f}")
    print(f"  project cache: {m['project_cache_entries']:,} entries (bounded at 100,000)")
    first, steady = m["reconcile_passes"]
    print(
        f"  quota reconcile, one pass over {a.nodes} nodes with {steady['live']:,} live: steady"
        f" {steady['wall_s']:.2f} s wall ({steady['loop_cpu_s']:.2f} s CPU on the event loop); releasing"
        f" {m['sandboxes'] + 2000:,} gone: {first['wall_s']:.2f} s ({first['loop_cpu_s']:.2f} s)"
    )
    h0, h_created, h_read = m["heap_mib"]
    print(
        f"  Python heap (tracemalloc), round 1 again with {m['traced']:,}: the apiserver holds"
        f" {h_created - h0:.2f} MiB after the creates, {h_read - h0:.2f} MiB after the GETs, allocated in:"
    )
    held = sorted(m["heap_held_by_file"].items(), key=lambda kv: -abs(kv[1]))[:5]
    for where, size in held:
        print(f"    {size / 2**20:9.2f} MiB  {where}")
    print("  (bounded: sandboxes.py's project cache, 100,000 entries; pydantic-core's cache of JSON strings)")
    return m


# ---------------------------------------------------------------- main


def plain(v: Any) -> Any:
    if isinstance(v, Run):
        return v.as_json()
    return [plain(x) for x in v] if isinstance(v, list) else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: 1/10 of the placements, short steps")
    ap.add_argument("--apiservers", type=int, default=1, help="apiserver processes in phase B")
    ap.add_argument("--iam", help="IAM store URL (postgresql://... or a path); default: SQLite in scratch")
    ap.add_argument("--quota", action="store_true", help="bill the load to a project with a finite quota")
    ap.add_argument("--nodes", type=int, default=160, help="simulated nodes (per apiserver in B)")
    ap.add_argument("--capacity", type=int, default=3200, help="sandboxes per node")
    ap.add_argument("--sandboxes", type=int, default=380_000, help="phase A placements")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="phase A: powers of k to compare")
    ap.add_argument(
        "--no-what-if", dest="what_if", action="store_false", help="phase A: skip the what-if row"
    )
    ap.add_argument("--place-apiservers", type=int, default=4, help="phase A: placing instances")
    ap.add_argument("--place-rate", type=int, default=TARGET_CREATES, help="phase A: creates per second")
    ap.add_argument(
        "--place-create-ms", type=float, default=40.0, help="phase A: a create's time on its node"
    )
    ap.add_argument("--poll-s", type=float, default=1.0, help="watcher poll interval")
    ap.add_argument("--edge-latency-ms", type=float, default=0.0, help="phase B: simulated edge create time")
    ap.add_argument("--no-wire", action="store_true", help="phase B/C: skip the edge link's JSON round trip")
    ap.add_argument("--no-reconcile", action="store_true", help="phase B: no quota reconcile loop")
    ap.add_argument("--connections", type=int, default=256, help="phase B open loop: keep-alive connections")
    ap.add_argument("--saturation-conns", type=int, default=64, help="phase B closed loop: connections")
    ap.add_argument("--step-s", type=float, default=4.0, help="phase B: seconds per load step")
    ap.add_argument("--batch", type=int, default=100, help="phase B: sandboxes per batch create request")
    ap.add_argument("--batch-conns", type=int, default=2, help="phase B: connections sending batches")
    ap.add_argument("--no-profile", action="store_true", help="phase B: skip the cProfile run")
    ap.add_argument("--memory-sandboxes", type=int, default=100_000, help="phase C: live sandboxes")
    ap.add_argument("--phases", default="ABC", help="which phases to run, e.g. B or AC")
    ap.add_argument("--seed", type=int, default=1, help="phase A: random seed")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args()
    if a.quick:
        a.sandboxes //= 10
    cores = os.cpu_count()
    print(f"cores {cores}  python {sys.version.split()[0]}  load average {os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {"cores": cores, "args": {k: str(v) for k, v in vars(a).items()}}
    t_start = time.monotonic()
    place: list[PlaceResult] = []
    if "A" in a.phases:
        place = phase_placement(a)
        results["placement"] = [r.as_json() for r in place]
    with tempfile.TemporaryDirectory(prefix="dsec-bench-cp-") as tmp:
        scratch = Path(tmp)
        http: dict[str, Any] = {}
        if "B" in a.phases:
            iam_url = a.iam or str(scratch / "iam.sqlite")
            project, key, quota = asyncio.run(setup_iam(iam_url, a.quota))
            store = "PostgreSQL" if iam_url.startswith("postgres") else "SQLite"
            print(f"\nIAM store: {store} ({iam_url}); project {project}: {quota}")
            http = asyncio.run(phase_http(a, iam_url, project, key))
            results["http"] = {"iam": store, "quota": quota, **{k: plain(v) for k, v in http.items()}}
        memory = phase_memory(a, scratch) if "C" in a.phases else None
        results["memory"] = memory
    summary(a, place, http, memory)
    print(f"(took {time.monotonic() - t_start:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


def summary(
    a: argparse.Namespace, place: list[PlaceResult], http: dict[str, Any], mem: dict[str, Any] | None
) -> None:
    print(f"\n== summary (cores {os.cpu_count()}; targets from SPEC: >= 5,000 creates/s, imbalance <= 1.1)")
    if http:
        c, g = best(http["create_steps"]), best(http["get_steps"])
        cr, gr = (c.offered or 0) if c else 0, (g.offered or 0) if g else 0
        ratio = f"{cr / gr:5.2f}x" if gr else "  n/a"
        print(
            f"{'creates/s with p99 < 100 ms':<36} dsec {cr:8,.0f}/s   floor (GET by ID) {gr:8,.0f}/s"
            f"   ratio {ratio}   target >= {TARGET_CREATES:,}/s"
        )
        if c:
            p50, p99 = pct(c.latencies, 50) * 1000, pct(c.latencies, 99) * 1000
            print(f"{'  at that rate':<36} p50 {p50:.2f} ms  p99 {p99:.2f} ms")
        cs, gs = http["create_saturation"], http["get_saturation"]
        print(
            f"{'saturation (closed loop)':<36} dsec {cs.achieved:8,.0f}/s   floor (GET by ID)"
            f" {gs.achieved:8,.0f}/s   ratio {cs.achieved / max(gs.achieved, 1):5.2f}x"
            f"   create p50 {pct(cs.latencies, 50) * 1000:.1f} p99 {pct(cs.latencies, 99) * 1000:.1f} ms"
        )
        if "batch" in http:
            b = http["batch"]
            rate = b.achieved * a.batch
            print(
                f"{'sandboxes/s in batches of ' + str(a.batch):<36} dsec {rate:8,.0f}/s   floor (GET by ID)"
                f" {gs.achieved:8,.0f} req/s   request p99 {pct(b.latencies, 99) * 1000:.1f} ms"
                f"   target >= {TARGET_CREATES:,}/s"
            )
        cpu = cs.server_cpu_s / max(cs.done, 1) * 1e6
        per_core = f"{1e6 / cpu:,.0f} creates/s per core"
        print(f"{'apiserver CPU per create':<36} {cpu:8.0f} us (all its threads) = {per_core}")
    by = {(r.k, r.variant): r for r in place}
    if (2, "stock") in by and (1, "stock") in by:
        k2, k1 = by[(2, "stock")], by[(1, "stock")]
        i2, i1 = k2.imbalance[k2.placed], k1.imbalance[k1.placed]
        label = f"imbalance after {k2.placed:,} (max/mean)"
        print(
            f"{label:<36} k=2 {i2:8.4f}    random (k=1) {i1:8.4f}"
            f"   excess ratio {(i2 - 1) / max(i1 - 1, 1e-9):5.2f}x   target <= 1.1"
        )
        print(
            f"{'placement decisions/s (choose)':<36} {1 / (sum(k2.choose_s) / len(k2.choose_s)):8,.0f}/s"
            f"   p50 {pct(k2.choose_s, 50) * 1e6:.1f} us  p99 {pct(k2.choose_s, 99) * 1e6:.1f} us"
        )
    if mem:
        api, edges = mem["apiserver_mib_per_100k"], mem["edges_mib_per_100k"]
        rough = (
            f"  (from {mem['sandboxes']:,}: rough, RSS moves in pages)" if mem["sandboxes"] < 100_000 else ""
        )
        print(
            f"{'apiserver MiB per 100k live (RSS)':<36} dsec {api:8.2f}      edges (baseline) {edges:8.2f}"
            f"   ratio {api / edges:5.3f}x   target ~0{rough}"
        )
        h0, h_created, _ = mem["heap_mib"]
        held = f"{h_created - h0:.2f} MiB after {mem['traced']:,} creates (bounded caches)"
        print(f"{'  Python heap it holds':<36} {held}")
    print(
        "limits: load generator and apiservers share these cores; edges are simulated in memory (no HTTP\n"
        "to edges, no 160 polls/s over the network); with --apiservers > 1 each process has its own 160\n"
        "simulated nodes, so cross-apiserver imbalance comes from phase A only."
    )


if __name__ == "__main__":
    main()
