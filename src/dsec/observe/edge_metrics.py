"""An edge's metrics: its sandboxes, memory and density read at scrape time, and its events.

:class:`EdgeCollector` walks the edge's sandbox table once per scrape (the tally keeps
counts per backend and project, not per state and runtime, and a scrape every 5 s costs one
walk: ``bench/prometheus_scrape.py`` measures it at 8,000 sandboxes). Everything else it
reports is a field the edge keeps anyway: the pause totals, the sampler's last readings, the
layer mounts' reference counts, ksmd's counter, /proc/meminfo; or one cheap read of the
kernel's: the split layers' data blobs in the page cache (one ``cachestat`` each: what on-demand
layers fetched from the shared store) and the egress table's counters (one ``nft -j`` run,
awaited by :meth:`EdgeMetrics.scrape` before the collector runs: grants and denials of the
sandboxes' firewall), with its name check's (HAProxy's ``show stat`` on its admin socket, at
the same time: :mod:`.egress_metrics`).

The hooks (:class:`EdgeMetrics` methods) are called by the edge where each event happens:
a create's phases in ``creating``, refusals in ``admission``, reclaims in ``reclaim``, pause
and resume in ``pausing``, exec and ``run_shell`` in ``commands``, FnCall calls in the pool.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.density.memory import mem_available_bytes, mem_total_bytes
from dsec.density.swap import free_swap_bytes
from dsec.observe.egress_metrics import name_checks
from dsec.observe.metrics import LATENCY_BUCKETS, OTHER, MetricsOptions, ProcessMetrics, top
from dsec.protocol.errors import DSecError
from dsec.protocol.fncall import FnResult
from dsec.protocol.models import DEFAULT_PROJECT, JOB_LABEL, PROJECT_LABEL, ContainerSpec, SandboxState

if TYPE_CHECKING:
    from dsec.density.ksm import Ksm
    from dsec.images.mounts import LayerMounts
    from dsec.netpolicy.policy import EgressPolicy

GiB = 1 << 30
# Where a sandbox's memory falls (its anonymous memory at the sampler's last reading).
MEMORY_BUCKETS = tuple(float(mb << 20) for mb in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
# How long paused sandboxes have been paused: the "stuck paused" alert reads past a day.
PAUSED_AGE_BUCKETS = (60.0, 300.0, 900.0, 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0)
# Stop and reclaim reasons as the edge writes them, and their label; any other is "other".
STOP_REASONS = {
    "stopped by user": "user",
    "max_lifetime": "max_lifetime",
    "idle_ttl": "idle_ttl",
    "lease_expired": "lease_expired",
    "lease_lapsed": "lease_lapsed",
    "deadline": "deadline",
    "idle": "idle",
    "memory_pressure": "memory_pressure",
    "admission": "admission",
    "sandbox exited unexpectedly": "exited",
    "edge_shutdown": "edge_shutdown",
    "fncall pool restarted": "fncall_pool",
}
CREATE_PHASES = ("placement", "admission", "layer_mount", "runtime_start", "first_output")
_MAX_AWAITING = 100_000  # sandboxes whose first output is awaited (one per live sandbox)


class _Record(Protocol):  # edge/journal.py's Record
    @property
    def state(self) -> SandboxState: ...
    @property
    def backend(self) -> str: ...
    @property
    def spec(self) -> ContainerSpec: ...
    @property
    def paused_at(self) -> float | None: ...


class _Live(Protocol):  # edge/tally.py's _Live
    @property
    def record(self) -> _Record: ...


class _PauseTotals(Protocol):  # edge/pausing.py's PauseTotals
    @property
    def pauses(self) -> int: ...
    @property
    def resumes(self) -> int: ...
    @property
    def returned_bytes(self) -> int: ...
    @property
    def prefetched_bytes(self) -> int: ...


class _Creates(Protocol):  # edge/creating.py's Creating
    @property
    def under_way(self) -> int: ...


class _Limits(Protocol):  # edge/config.py's EdgeConfig
    @property
    def max_sandboxes(self) -> int: ...


class _Sampler(Protocol):  # edge/metrics.py's MetricsSampler
    def last_memory(self) -> Iterable[tuple[int, int]]: ...


class _Pool(Protocol):  # edge/fncall/pool.py's FnPool
    def stats(self) -> dict[str, Any]: ...


class MeteredEdge(Protocol):
    """What the metrics read from an edge (edge/edge.py's ``Edge``), named here so that
    observe/ does not import edge/ (which imports this module)."""

    @property
    def live(self) -> Mapping[str, _Live]: ...  # edge/tally.py's LiveSandboxes
    @property
    def creating(self) -> _Creates: ...
    @property
    def fenced(self) -> str: ...
    @property
    def drain_fence(self) -> str: ...
    @property
    def config(self) -> _Limits: ...
    def committed(self) -> tuple[int, float]: ...
    @property
    def metrics(self) -> _Sampler: ...
    @property
    def mounts(self) -> LayerMounts: ...
    @property
    def ksm(self) -> Ksm: ...
    @property
    def egress(self) -> EgressPolicy: ...
    @property
    def pause_totals(self) -> _PauseTotals: ...
    @property
    def pools(self) -> Mapping[str, _Pool]: ...


def stop_reason(reason: str) -> str:
    return STOP_REASONS.get(reason, "other")


class EdgeMetrics(ProcessMetrics):
    """The edge's registry and hooks; :meth:`bind` adds the collector over the edge's state."""

    def __init__(self, options: MetricsOptions | None = None) -> None:
        super().__init__("edge")
        self.options = options or MetricsOptions.from_env()
        r = self.registry
        self.creates = Counter(
            "dsec_creates", "Creates finished, by backend and outcome", ["backend", "outcome"], registry=r
        )
        self.create_phase = Histogram(
            "dsec_create_phase_seconds",
            "Create latency by phase (placement: apiserver; first_output: create to first command output)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stops = Counter("dsec_stops", "Sandboxes stopped, by reason", ["reason"], registry=r)
        self.reclaims = Counter(
            "dsec_reclaims",
            "Sandboxes the reaper stopped or paused, by action and reason",
            ["action", "reason"],
            registry=r,
        )
        self.refusals = Counter(
            "dsec_create_refusals", "Creates this edge refused, by reason", ["reason"], registry=r
        )
        self.commands = Histogram(
            "dsec_command_seconds",
            "exec and run_shell round trips, by kind and outcome",
            ["kind", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.oom_kills = Counter(
            "dsec_command_oom_kills", "Commands that ended in an OOM kill, by kind", ["kind"], registry=r
        )
        self.fncalls = Histogram(
            "dsec_fncall_seconds",
            "FnCall calls, by language and status",
            ["language", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pause_seconds = Histogram(
            "dsec_pause_seconds", "Pause and resume times", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.pause_bytes = Counter(
            "dsec_pause_bytes", "Memory a pause returned, or a resume prefetched", ["op"], registry=r
        )
        self.journal_write = Histogram(
            "dsec_journal_write_seconds",
            "Journal insert and update latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._created_at: dict[str, float] = {}  # awaiting their first command output
        self._edge: MeteredEdge | None = None

    def bind(self, edge: MeteredEdge) -> None:
        self.registry.register(EdgeCollector(edge, self.options))
        self._edge = edge

    async def scrape(self) -> bytes:
        # The firewall's counters are read with a subprocess and the name check's from its
        # socket: here, off the collector (which runs synchronously on the event loop), once
        # per scrape.
        if self._edge is not None:
            await self._edge.egress.read_firewall()
        return await super().scrape()

    # -- hooks ------------------------------------------------------------------------------

    def phase(self, name: str, started: float) -> None:
        """``started``: a ``time.perf_counter()`` at the phase's start."""
        self.create_phase.labels(name).observe(time.perf_counter() - started)

    def created(self, sandbox_id: str, backend: str) -> None:
        self.creates.labels(backend, "ok").inc()
        if len(self._created_at) < _MAX_AWAITING:
            self._created_at[sandbox_id] = time.perf_counter()

    def create_failed(self, backend: str, exc: BaseException) -> None:
        self.creates.labels(backend, exc.code if isinstance(exc, DSecError) else "cancelled").inc()

    def refused(self, exc: DSecError) -> None:
        self.refusals.labels(str(exc.reason or "full")).inc()

    def stopped(self, sandbox_id: str, reason: str) -> None:
        self._created_at.pop(sandbox_id, None)
        self.stops.labels(stop_reason(reason)).inc()

    def reclaimed(self, stops: Iterable[tuple[str, str]], pauses: Iterable[tuple[str, str]]) -> None:
        for action, each in (("stop", stops), ("pause", pauses)):
            for _, why in each:
                self.reclaims.labels(action, stop_reason(why)).inc()

    def command(self, sandbox_id: str, kind: str, started: float, outcome: str, oom: bool = False) -> None:
        """A command ended (``outcome``: ok, nonzero, timeout, oom, error)."""
        self.commands.labels(kind, outcome).observe(time.perf_counter() - started)
        if oom:
            self.oom_kills.labels(kind).inc()
        first = self._created_at.pop(sandbox_id, None)
        if first is not None:
            self.create_phase.labels("first_output").observe(time.perf_counter() - first)

    async def fncall(self, language: str, call: Awaitable[FnResult]) -> FnResult:
        """``call``'s result, timed by language and status (an error's code when it raised)."""
        started = time.perf_counter()
        try:
            result = await call
        except DSecError as exc:
            self.fncalls.labels(language, exc.code).observe(time.perf_counter() - started)
            raise
        self.fncalls.labels(language, result.status).observe(time.perf_counter() - started)
        return result

    def paused(self, op: str, seconds: float, moved_bytes: int) -> None:
        self.pause_seconds.labels(op).observe(seconds)
        self.pause_bytes.labels(op).inc(moved_bytes)


def command_outcome(exit_code: int | None, timed_out: bool, oom_killed: bool) -> str:
    if oom_killed:
        return "oom"
    if timed_out:
        return "timeout"
    return "ok" if exit_code == 0 else "nonzero"


class EdgeCollector(Collector):
    """Reads the edge's state at each scrape."""

    def __init__(self, edge: MeteredEdge, options: MetricsOptions) -> None:
        self.edge = edge
        self.options = options

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: the edge may not have started yet

    def collect(self) -> Iterator[Metric]:
        edge = self.edge
        yield from self._sandboxes(edge)
        yield from self._node(edge)
        yield from self._pausing(edge)
        yield from self._pools(edge)

    def _sandboxes(self, edge: MeteredEdge) -> Iterator[Metric]:
        by_key: Tally[tuple[str, str, str, str]] = Tally()
        projects: Tally[str] = Tally()
        jobs: Tally[tuple[str, str]] = Tally()
        paused_ages: list[float] = []
        now = time.time()
        jobs_wanted = self.options.jobs > 0
        for live in edge.live.values():
            rec = live.record
            labels = rec.spec.labels
            project = labels.get(PROJECT_LABEL, DEFAULT_PROJECT)
            by_key[(rec.state.value, rec.backend, rec.spec.runtime, project)] += 1
            projects[project] += 1
            if jobs_wanted and JOB_LABEL in labels:
                jobs[(project, labels[JOB_LABEL])] += 1
            if rec.state is SandboxState.paused and rec.paused_at is not None:
                paused_ages.append(now - rec.paused_at)
        kept = top(projects, self.options.max_projects)
        g = GaugeMetricFamily(
            "dsec_sandboxes",
            "Sandboxes held, by state, backend, runtime and project",
            labels=["state", "backend", "runtime", "project"],
        )
        folded: Tally[tuple[str, str, str, str]] = Tally()
        for (state, backend, runtime, project), n in by_key.items():
            folded[(state, backend, runtime, project if project in kept else OTHER)] += n
        for key, n in folded.items():
            g.add_metric(list(key), n)
        yield g
        if jobs_wanted:
            j = GaugeMetricFamily(
                "dsec_job_sandboxes", "Sandboxes held per job (DSEC_METRICS_JOBS)", labels=["project", "job"]
            )
            flat = Tally({f"{p}\0{job}": n for (p, job), n in jobs.items()})
            for pair, n in top(flat, self.options.jobs).items():
                p, _, job = pair.partition("\0")
                j.add_metric([p, job] if job else [OTHER, OTHER], n)
            yield j
        yield _histogram(
            "dsec_paused_sandbox_age_seconds",
            "How long each paused sandbox has been paused",
            paused_ages,
            PAUSED_AGE_BUCKETS,
        )
        yield GaugeMetricFamily("dsec_sandboxes_creating", "Creates under way", value=edge.creating.under_way)
        capacity = 0 if edge.fenced or edge.drain_fence else edge.config.max_sandboxes
        yield GaugeMetricFamily(
            "dsec_node_capacity_sandboxes", "Sandboxes the node admits (0: fenced)", value=capacity
        )

    def _node(self, edge: MeteredEdge) -> Iterator[Metric]:
        total = mem_total_bytes()
        yield GaugeMetricFamily("dsec_node_memory_total_bytes", "The node's RAM", value=total)
        yield GaugeMetricFamily(
            "dsec_node_memory_available_bytes", "MemAvailable", value=mem_available_bytes()
        )
        committed, cpus = edge.committed()
        yield GaugeMetricFamily(
            "dsec_node_memory_committed_bytes", "Memory limits of running sandboxes", value=committed
        )
        yield GaugeMetricFamily(
            "dsec_node_cpu_committed_cores", "CPU limits of running sandboxes", value=cpus
        )
        yield GaugeMetricFamily(
            "dsec_node_density_sandboxes_per_gib",
            "Sandboxes held per GiB of node RAM",
            value=len(edge.live) / max(1.0, total / GiB),
        )
        anon = [float(a) for a, _ in edge.metrics.last_memory()]
        cache = sum(c for _, c in edge.metrics.last_memory())
        yield _histogram(
            "dsec_sandbox_memory_bytes",
            "Anonymous memory of each running container sandbox (last sample)",
            anon,
            MEMORY_BUCKETS,
        )
        yield GaugeMetricFamily(
            "dsec_sandbox_page_cache_bytes", "Page cache charged to running sandboxes", value=cache
        )
        mounted = edge.mounts.mounted()
        yield GaugeMetricFamily("dsec_layer_mounts", "Layers mounted on the node", value=len(mounted))
        yield GaugeMetricFamily(
            "dsec_layer_mount_users",
            "Sandboxes using the node's layer mounts, summed: users over mounts is"
            " how many share each layer's page cache",
            value=sum(mounted.values()),
        )
        yield from _ondemand(edge)
        ksm = edge.ksm.stats()
        yield GaugeMetricFamily(
            "dsec_node_ksm_saved_bytes", "Memory KSM merged away", value=ksm["saved_bytes"]
        )
        yield GaugeMetricFamily("dsec_node_ksm_running", "Whether ksmd runs", value=int(bool(ksm["running"])))
        yield GaugeMetricFamily("dsec_node_swap_free_bytes", "Free swap", value=free_swap_bytes())
        egress = CounterMetricFamily(
            "dsec_egress_dns_answers",
            "The sandboxes' name server's answers: granted (a permitted name), denied (any other)",
            labels=["verdict"],
        )
        for verdict, n in edge.egress.dns_answers().items():
            egress.add_metric([verdict], n)
        yield egress
        yield from _firewall(edge)
        yield from name_checks(edge.egress)

    def _pausing(self, edge: MeteredEdge) -> Iterator[Metric]:
        t = edge.pause_totals
        yield _counter("dsec_pauses", "Pauses done", t.pauses)
        yield _counter("dsec_resumes", "Resumes done", t.resumes)
        yield _counter("dsec_swap_returned_bytes", "RAM pauses gave back (paged out)", t.returned_bytes)
        yield _counter("dsec_swap_prefetched_bytes", "Memory resumes read back in", t.prefetched_bytes)

    def _pools(self, edge: MeteredEdge) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "dsec_fncall_pool_workers", "FnCall pool workers, by pool and state", labels=["pool", "state"]
        )
        recycled = CounterMetricFamily(
            "dsec_fncall_pool_recycled", "FnCall workers recycled", labels=["pool"]
        )
        for name, pool in edge.pools.items():
            s = pool.stats()
            ready.add_metric([name, "ready"], s["ready"])
            ready.add_metric([name, "idle"], s["idle"])
            recycled.add_metric([name], s["recycled"])
        yield ready
        yield recycled


def _firewall(edge: MeteredEdge) -> Iterator[Metric]:
    """The egress table's counters, read from the kernel just before the scrape."""
    from dsec.netpolicy.nft import DENIALS, GRANTED

    counts = edge.egress.firewall_counts()
    if not counts:
        return  # no egress table on this node (no permissions configured, no links)
    denied = CounterMetricFamily(
        "dsec_egress_denied_packets",
        "Packets the sandboxes' firewall (nftables) refused, by reason: not_granted (to an"
        " endpoint the sandbox's rules do not grant; a TCP connection attempt is one SYN,"
        " answered with a reset), node (to the node itself beyond DNS and its proxies),"
        " spoofed (a source address not the sandbox's), inbound (towards a sandbox, not a"
        " reply). Reset when the edge rebuilds its table (a restart)",
        labels=["reason"],
    )
    for reason in DENIALS:
        denied.add_metric([reason], counts.get(reason, 0))
    yield denied
    yield CounterMetricFamily(
        "dsec_egress_granted_connections",
        "New connections (a TCP SYN, a UDP flow's first datagram) the sandboxes' firewall let"
        " out to a granted endpoint",
        value=counts.get(GRANTED, 0),
    )


def _ondemand(edge: MeteredEdge) -> Iterator[Metric]:
    """Split layers' data read in place from the shared store (``LayerMounts.ondemand_use``)."""
    use = edge.mounts.ondemand_use()
    yield GaugeMetricFamily(
        "dsec_ondemand_layers", "Split (on-demand) layers mounted on the node", value=use.layers
    )
    yield GaugeMetricFamily(
        "dsec_ondemand_data_bytes",
        "Size of the mounted split layers' data blobs on the shared store: all their sandboxes could read",
        value=use.data_bytes,
    )
    fetched = GaugeMetricFamily(
        "dsec_ondemand_fetched_bytes",
        "Bytes of the mounted split layers' data blobs this node fetched from the shared store,"
        " read at scrape time with cachestat(2): state=cached, held in the page cache now (what"
        " sandboxes read plus the readahead around it); state=evicted, fetched and dropped"
        " since (a lower bound: the kernel forgets evictions under pressure), a read there"
        " fetches again. Over dsec_ondemand_data_bytes: the share of the layers the node"
        " pulled",
        labels=["state"],
    )
    fetched.add_metric(["cached"], use.cached_bytes)
    fetched.add_metric(["evicted"], use.evicted_bytes)
    yield fetched
    scan = use.read
    if scan is not None:
        yield GaugeMetricFamily(
            "dsec_ondemand_read_bytes",
            "Bytes of the mounted split layers' files in the page cache (what sandboxes read of"
            " them, decompressed, plus readahead within those files), from the last background"
            " scan (cachestat per file, at most every minute; see the scan's gauges)",
            value=scan.cached_bytes,
        )
        yield GaugeMetricFamily(
            "dsec_ondemand_read_scan_timestamp_seconds", "When that scan ended (Unix time)", value=scan.at
        )
        yield GaugeMetricFamily("dsec_ondemand_read_scan_seconds", "How long it took", value=scan.seconds)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, values: list[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram of values read now (not observed over time): counts per ``le`` bucket."""
    values.sort()
    out: list[tuple[str, float]] = []
    i = 0
    for le in buckets:
        while i < len(values) and values[i] <= le:
            i += 1
        out.append((repr(le), i))
    out.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, doc, buckets=out, sum_value=sum(values))
