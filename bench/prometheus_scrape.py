"""What a Prometheus scrape of an edge's ``/metrics`` costs at many sandboxes.

    .venv/bin/python bench/prometheus_scrape.py [--sandboxes 8000] [--scrapes 200] [--jobs 0 100]

Builds the edge's metrics (dsec.observe.edge_metrics) over a stand-in edge holding that many
sandboxes (records as the journal keeps them, spread over 50 projects, 400 jobs, both
runtimes, a tenth paused, each with a sampler reading), fills the event histograms as a busy
node would, then times what one scrape does: the collectors' walk and the text exposition
(``ProcessMetrics.scrape``; aiohttp's own handling of the GET is not included). It prints
p50/p99 CPU per scrape, the share of one core at one scrape per 5 s, and the same for an
empty registry (the library's floor) and for the event families alone (no walk).
No root needed: nothing is created outside the process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from _stats import pct
from dsec.edge.journal import Record
from dsec.edge.pausing import PauseTotals
from dsec.images.mounts import OnDemandUse
from dsec.observe.edge_metrics import EdgeCollector, EdgeMetrics
from dsec.observe.metrics import MetricsOptions
from dsec.protocol.models import JOB_LABEL, PROJECT_LABEL, ContainerSpec, SandboxState

SCRAPE_INTERVAL_S = 5.0


@dataclass
class _Held:
    record: Record


@dataclass
class _Config:
    max_sandboxes: int = 10_000


class _Sampler:
    def __init__(self, n: int) -> None:
        self.readings = [(random.randint(20, 400) << 20, random.randint(0, 64) << 20) for _ in range(n)]

    def last_memory(self) -> Iterator[tuple[int, int]]:
        return iter(self.readings)


class _Mounts:
    def mounted(self) -> dict[str, int]:
        return {f"sha256:{i:064x}": 200 for i in range(40)}

    def ondemand_use(self) -> OnDemandUse:
        return OnDemandUse(layers=0, data_bytes=0, cached_bytes=0, evicted_bytes=0)


class _Ksm:
    def stats(self) -> dict[str, int | bool]:
        return {"running": True, "saved_bytes": 1 << 30}


class _Egress:
    def dns_answers(self) -> dict[str, int]:
        return {"granted": 120_000, "denied": 3_000}

    def firewall_counts(self) -> dict[str, int]:
        return {}  # no egress table: the collector leaves its families out

    def name_checks(self) -> dict[tuple[str, str], int]:
        return {}  # no name check proxy either


@dataclass
class _Creating:
    under_way: int = 3


@dataclass
class SimEdge:
    """The fields of :class:`dsec.edge.edge.Edge` the collector reads
    (:class:`dsec.observe.edge_metrics.MeteredEdge`)."""

    live: dict[str, _Held]
    metrics: _Sampler
    config: _Config = field(default_factory=_Config)
    mounts: _Mounts = field(default_factory=_Mounts)
    ksm: _Ksm = field(default_factory=_Ksm)
    egress: _Egress = field(default_factory=_Egress)
    pause_totals: PauseTotals = field(default_factory=PauseTotals)
    pools: dict[str, Any] = field(default_factory=dict)
    fenced: str = ""
    drain_fence: str = ""
    creating: _Creating = field(default_factory=_Creating)

    def committed(self) -> tuple[int, float]:
        mem, cpu = 0, 0.0
        for held in self.live.values():
            if held.record.state is SandboxState.running:
                mem += held.record.spec.memory_limit_mb << 20
                cpu += held.record.spec.cpu_cores_limit
        return mem, cpu


def sim_edge(n: int) -> SimEdge:
    rng = random.Random(7)
    specs = [
        ContainerSpec.model_construct(  # reserved labels: the apiserver's to set, not validated here
            image="base:1",
            runtime="gvisor" if i % 5 == 0 else "crun",
            labels={PROJECT_LABEL: f"root/p{i % 50}", JOB_LABEL: f"job-{i % 400}"},
        )
        for i in range(1000)
    ]
    live = {}
    now = time.time()
    for i in range(n):
        sid = f"sb-bench-1-{i:020d}"
        paused = rng.random() < 0.1
        rec = Record(
            sid,
            SandboxState.paused if paused else SandboxState.running,
            "container",
            specs[i % len(specs)],
            [],
            {},
        )
        rec.paused_at = now - rng.random() * 7200 if paused else None
        live[sid] = _Held(rec)
    return SimEdge(live, _Sampler(n))


def busy(m: EdgeMetrics) -> None:
    """Every event family with the label values a busy node has."""
    for phase in ("admission", "layer_mount", "runtime_start", "first_output"):
        m.create_phase.labels(phase).observe(0.05)
    for kind in ("exec", "run_shell"):
        for outcome in ("ok", "nonzero", "timeout", "oom"):
            m.commands.labels(kind, outcome).observe(0.01)
    for reason in ("user", "idle_ttl", "max_lifetime", "lease_expired", "deadline", "exited", "other"):
        m.stops.labels(reason).inc()
    for lang in ("python", "bash", "c", "cpp"):
        for status in ("ok", "runtime_error", "timeout", "compile_error"):
            m.fncalls.labels(lang, status).observe(0.1)
    for op in ("pause", "resume"):
        m.pause_seconds.labels(op).observe(0.2)
    for route in range(50):
        for status in ("200", "201", "404", "409", "503"):
            m.requests.labels(f"/edge/v1/route{route}", "POST", status).inc()
        m.request_seconds.labels(f"/edge/v1/route{route}", "POST").observe(0.01)
    m.journal_write.observe(0.0005)


async def timed(scrape: Any, scrapes: int) -> tuple[list[float], int]:
    size = len(await scrape())  # warm: the first scrape builds the label children
    cpu: list[float] = []
    for _ in range(scrapes):
        t0 = time.process_time()
        await scrape()
        cpu.append(time.process_time() - t0)
    return cpu, size


def line(name: str, cpu: list[float], size: int) -> str:
    p50, p99 = pct(cpu, 50), pct(cpu, 99)
    share = p50 / SCRAPE_INTERVAL_S * 100
    return (
        f"  {name:34s} p50 {p50 * 1e3:8.3f} ms  p99 {p99 * 1e3:8.3f} ms CPU per scrape,"
        f" {share:6.3f} % of a core at 1 per {SCRAPE_INTERVAL_S:g} s, {size / 1024:6.1f} KiB"
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, nargs="+", default=[8000])
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--jobs", type=int, nargs="+", default=[0, 100], help="DSEC_METRICS_JOBS values")
    a = ap.parse_args()
    print(f"cores {os.cpu_count()}  scrapes {a.scrapes} each")
    empty = CollectorRegistry()

    async def floor() -> bytes:
        return generate_latest(empty)

    base_cpu, size = await timed(floor, a.scrapes)
    print(line("empty registry (baseline)", base_cpu, size))
    events = EdgeMetrics(MetricsOptions())
    busy(events)
    ev_cpu, size = await timed(events.scrape, a.scrapes)
    print(line("event families + process, no walk", ev_cpu, size))
    for n in a.sandboxes:
        edge = sim_edge(n)
        for jobs in a.jobs:
            m = EdgeMetrics(MetricsOptions(jobs=jobs))
            m.registry.register(EdgeCollector(edge, m.options))  # type: ignore[arg-type]
            busy(m)
            cpu, size = await timed(m.scrape, a.scrapes)
            name = f"{n} sandboxes, jobs={jobs}"
            print(line(name, cpu, size) + f"  ({pct(cpu, 50) / max(pct(base_cpu, 50), 1e-9):.0f}x baseline)")


if __name__ == "__main__":
    asyncio.run(main())
