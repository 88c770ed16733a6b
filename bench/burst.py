"""A burst of creates against a home cluster sized for half of them (issue 33).

    .venv/bin/python bench/burst.py [--creates 2000] [--quick] [--rate 200] [--provider-delay 2]

No real sandbox runs: every node is a simulated edge (bench/_controlplane/simedge.py) whose
create takes ``--edge-latency`` seconds, behind a real apiserver (HTTP, auth, IAM on SQLite,
placement, quota) in this process. The home cluster has two nodes holding ``creates / 2``
sandboxes together. Three runs, each on a fresh set-up, send the same burst (open loop at
``--rate`` creates per second; a create's latency runs from its scheduled send, so queueing
counts):

  1. home only: what the cluster sized for the median does with the peak (the baseline);
  2. with an overflow target: a second cluster (its own apiserver over HTTP, with room for the
     whole burst) that takes creates once home passes the threshold (0.8);
  3. overflow and scale-out: also a node provider (apiserver/scaling.py) whose node takes
     ``--provider-delay`` seconds to start, holds ``creates / 4`` and joins the home cluster
     (at most two); the policy starts one after ``--sustain`` seconds past the threshold.

Printed with the core count: completed creates, p50/p99 create latency (and each p50 as a
ratio of the same run's home-only p50), the share sent to overflow and to provider nodes, and
how long scale-out took (threshold crossed -> node asked for -> node serving -> first
sandbox on it). Limits: on 2 cores the load generator, both apiservers and the simulated edges
share the CPUs; the edges' work is a sleep, and the home apiserver reaches its edges in memory
(the overflow cluster over real HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from collections import ChainMap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from _controlplane.simedge import SimulatedEdgeLink, simulated_edges
from _stats import pct
from dsec.apiserver.app import ApiServer
from dsec.apiserver.overflow import Overflow, OverflowConfig, OverflowTarget
from dsec.apiserver.scaling import FencingWatcher, Scaler, ScalingConfig
from dsec.edge.link import EdgeLink
from dsec.iam import open_iam_store
from dsec.images.store import LayerStore
from dsec.node.provider import NodeRequest, ProvidedNode
from dsec.placement.placement import Placement
from dsec.protocol.http import listen
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec, CreateRequest

IMAGE = "tiny:1"
THRESHOLD = 0.8


class DelayedProvider:
    """A NodeProvider whose node is a simulated edge that joins ``links`` after ``delay_s``."""

    def __init__(self, links: dict[str, EdgeLink], capacity: int, delay_s: float, latency_s: float) -> None:
        self.links, self.capacity, self.delay_s, self.latency_s = links, capacity, delay_s, latency_s
        self.nodes: dict[str, ProvidedNode] = {}

    async def start(self, request: NodeRequest) -> ProvidedNode:
        assert request.name is not None
        await asyncio.sleep(self.delay_s)  # the VM's boot: the bench's stand-in for it
        self.links[request.name] = SimulatedEdgeLink(request.name, 1, self.capacity, latency_s=self.latency_s)
        self.nodes[request.name] = node = ProvidedNode(request.name, request.labels, "running")
        return node

    async def stop(self, name: str) -> ProvidedNode:
        del self.links[name]
        self.nodes[name].state = "stopped"
        return self.nodes[name]

    async def list(self) -> list[ProvidedNode]:
        return list(self.nodes.values())

    async def close(self) -> None:
        pass


@dataclass
class Cluster:
    api: ApiServer
    watcher: FencingWatcher
    links: dict[str, EdgeLink]
    runner: web.AppRunner
    url: str
    extra: list[Any] = field(default_factory=list)  # overflow, scaler: closed with it

    async def close(self) -> None:
        for thing in self.extra:
            await thing.close()
        await self.runner.cleanup()
        await self.api.tenancy.close()
        await self.watcher.close()
        await self.api.iam.close()


async def _cluster(
    tmp: Path, name: str, edges: dict[str, SimulatedEdgeLink], overflow: OverflowConfig | None = None
) -> tuple[Cluster, str, str]:
    """An apiserver over ``edges`` on HTTP; (cluster, admin key, key of project root/burst)."""
    iam = await open_iam_store(str(tmp / f"{name}.sqlite"))
    admin = await iam.issue_key(admin=True)
    await iam.create_project("root", "burst")
    burst = await iam.issue_key("root/burst")
    store = LayerStore(tmp / f"{name}-layers")
    src = tmp / f"{name}-tiny"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    store.import_path(src, IMAGE)
    store.mark_public(IMAGE)
    links: dict[str, EdgeLink] = dict(edges)
    watcher = FencingWatcher(links, interval_s=0.25)
    placement = Placement(watcher)
    bursts = None if overflow is None else Overflow(overflow, placement)
    # Overflow links join the routes' mapping (list, bulk, quota), as node/cluster.py joins them.
    routes = links if bursts is None else ChainMap(links, bursts.links)
    api = ApiServer(routes, placement, store, iam, overflow=bursts)
    await watcher.start()
    runner, url = await listen(api.app(), "127.0.0.1", 0)
    cluster = Cluster(api, watcher, links, runner, url)
    if bursts is not None:
        await bursts.start()
        cluster.extra.append(bursts)
    return cluster, admin, burst


@dataclass
class Result:
    label: str
    offered: int
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    where: dict[str, int] = field(default_factory=dict)  # home, overflow, provider
    wall_s: float = 0.0
    scale: dict[str, float] = field(default_factory=dict)

    def row(self, base_p50: float) -> str:
        done = len(self.latencies)
        p50, p99 = pct(self.latencies, 50), pct(self.latencies, 99)
        shares = "  ".join(f"{k} {v / max(1, done):4.0%}" for k, v in sorted(self.where.items()))
        return (
            f"{self.label:<26} {done:>5}/{self.offered:<5} p50 {p50 * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"
            f"  p50 ratio {p50 / base_p50:5.2f}x  | {shares}"
        )


async def _burst(url: str, key: str, n: int, rate: float, result: Result, provider_nodes: set[str]) -> None:
    body = CreateRequest(spec=ContainerSpec(image=IMAGE), timeout=60).model_dump_json()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            try:
                async with session.post(f"{url}/v1/sandboxes", data=body, headers=headers) as resp:
                    answer = await resp.json()
                    if resp.status != 201:
                        kind = str(answer.get("error", {}).get("code", resp.status))
                        result.errors[kind] = result.errors.get(kind, 0) + 1
                        return
            except Exception as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                return
            result.latencies.append(time.perf_counter() - at)
            sid = SandboxId.parse(answer["id"])
            where = "overflow" if sid.cluster else "provider" if sid.node in provider_nodes else "home"
            result.where[where] = result.where.get(where, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(one(start + i / rate) for i in range(n)))
        result.wall_s = time.perf_counter() - start


async def run(label: str, a: argparse.Namespace, tmp: Path, overflow: bool, scale: bool) -> Result:
    n = a.creates
    result = Result(label, n)
    away = None
    bursts = None
    if overflow:
        away, _, away_burst_key = await _cluster(
            tmp, f"{label}-away", simulated_edges("a", 2, n, latency_s=a.edge_latency)
        )
        target = OverflowTarget(name="west", url=away.url, api_key=away_burst_key, max_sandboxes=2 * n)
        bursts = OverflowConfig(threshold=THRESHOLD, poll_interval_s=0.5, targets=[target])
    home, admin, _ = await _cluster(
        tmp, f"{label}-home", simulated_edges("h", 2, n // 4, latency_s=a.edge_latency), bursts
    )
    provider_nodes: set[str] = set()
    monitor: asyncio.Task[None] | None = None
    scaler = None
    if scale:
        provider = DelayedProvider(home.links, n // 4, a.provider_delay, a.edge_latency)
        cfg = ScalingConfig(
            threshold=THRESHOLD,
            sustain_s=a.sustain,
            idle_s=600,
            max_nodes=2,
            interval_s=0.1,
            name_prefix="burst",
        )
        scaler = Scaler(cfg, provider, home.watcher, home.api.placement, home.links)
        await scaler.start()
        home.extra.insert(0, scaler)
        provider_nodes = {f"burst-{i}" for i in range(1, 3)}
        monitor = asyncio.create_task(_watch_scale_out(scaler, home.links, result))
    try:
        await _burst(home.url, admin, n, a.rate, result, provider_nodes)
    finally:
        if monitor is not None:
            monitor.cancel()
        await home.close()
        if away is not None:
            await away.close()
    if scaler is not None:
        t0 = result.scale.get("threshold_at")
        for at, what, _node in scaler.events:
            key = {"start": "asked_s", "running": "serving_s"}.get(what)
            if key and t0 is not None and key not in result.scale:
                result.scale[key] = at - t0
    return result


async def _watch_scale_out(scaler: Scaler, links: dict[str, EdgeLink], result: Result) -> None:
    """When utilisation first reached the threshold, and when a provider node first held one."""
    while True:
        now = time.monotonic()
        if "threshold_at" not in result.scale and scaler.utilisation() >= THRESHOLD:
            result.scale["threshold_at"] = now
        t0 = result.scale.get("threshold_at")
        if t0 is not None and "first_sandbox_s" not in result.scale:
            if any(getattr(links.get(n), "running", 0) for n in scaler.nodes):
                result.scale["first_sandbox_s"] = now - t0
        await asyncio.sleep(0.02)  # a sampler: 20 ms is the resolution of the scale-out figures


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--creates", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help="200 creates at 40/s, node start 0.5 s")
    p.add_argument("--rate", type=float, default=200.0, help="creates per second (open loop)")
    p.add_argument(
        "--edge-latency", type=float, default=0.05, help="seconds a simulated edge takes to create"
    )
    p.add_argument("--provider-delay", type=float, help="seconds a provider node takes to start (2)")
    p.add_argument("--sustain", type=float, default=1.0, help="seconds past the threshold before scale-out")
    p.add_argument("--json", type=Path, help="write the figures here too")
    a = p.parse_args()
    if a.quick:
        a.creates, a.rate = 200, 40.0
    if a.provider_delay is None:
        a.provider_delay = 0.5 if a.quick else 2.0
    logging.disable(logging.WARNING)  # 503s past capacity are the point here, not news
    if not 8 <= a.creates <= 100_000 or not 0 < a.rate <= 10_000:
        p.error("--creates 8-100000, --rate above 0 and at most 10000")
    print(
        f"cores {os.cpu_count()}  python {sys.version.split()[0]}  load average {os.getloadavg()[0]:.2f}\n"
        f"burst of {a.creates} creates at {a.rate:.0f}/s; home holds {2 * (a.creates // 4)};"
        f" edge create {a.edge_latency * 1000:.0f} ms; provider node start {a.provider_delay:.1f} s,"
        f" sustain {a.sustain:.1f} s, threshold {THRESHOLD}"
    )
    with tempfile.TemporaryDirectory(prefix="dsec-bench-burst-") as tmp:
        runs = [
            await run("home only (baseline)", a, Path(tmp), overflow=False, scale=False),
            await run("overflow", a, Path(tmp), overflow=True, scale=False),
            await run("overflow + scale-out", a, Path(tmp), overflow=True, scale=True),
        ]
    base = pct(runs[0].latencies, 50)
    print()
    for r in runs:
        print(r.row(base))
        if r.errors:
            print(f"{'':<26} refused/failed: {r.errors}")
    s = runs[2].scale
    if "threshold_at" in s:
        fmt = lambda k: f"{s[k]:.2f} s" if k in s else "never"  # noqa: E731
        print(
            f"\nscale-out: threshold crossed -> node asked for {fmt('asked_s')} -> serving"
            f" {fmt('serving_s')} -> first sandbox on it {fmt('first_sandbox_s')}"
        )
    print(
        "limits: load generator, both apiservers and the simulated edges share these cores; an edge's"
        "\ncreate is a sleep; home reaches its edges in memory, the overflow cluster over HTTP."
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "cores": os.cpu_count(),
                    "args": {k: str(v) for k, v in vars(a).items()},
                    "runs": [
                        {
                            "label": r.label,
                            "completed": len(r.latencies),
                            "offered": r.offered,
                            "p50_ms": pct(r.latencies, 50) * 1000,
                            "p99_ms": pct(r.latencies, 99) * 1000,
                            "p50_ratio_to_baseline": pct(r.latencies, 50) / base,
                            "where": r.where,
                            "errors": r.errors,
                            "wall_s": r.wall_s,
                            "scale_out_s": {k: v for k, v in r.scale.items() if k != "threshold_at"},
                        }
                        for r in runs
                    ],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    asyncio.run(main())
