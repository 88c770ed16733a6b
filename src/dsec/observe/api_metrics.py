"""An apiserver's metrics: placement decisions, its view of every node, and its requests.

The nodes' figures come from the placement watcher's last poll (no request of its own):
whether each node answered (the "edge unreachable" alert), its load, and the imbalance
between the most and least loaded healthy nodes. Placement calls :meth:`ApiMetrics.placed`
through the ``on_choose`` hook of :class:`~dsec.placement.placement.Placement`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.observe.metrics import LATENCY_BUCKETS, ProcessMetrics
from dsec.placement.placement import Placement


class ApiMetrics(ProcessMetrics):
    def __init__(self, placement: Placement, edges: Mapping[str, object]) -> None:
        super().__init__("api")
        self.edges = edges  # EdgeLinks by node: in-process ones carry their edge's metrics
        r = self.registry
        self.decisions = Counter(
            "dsec_placement_decisions",
            "Placement choices, by backend and outcome",
            ["backend", "outcome"],
            registry=r,
        )
        self.create_phase = Histogram(
            "dsec_create_phase_seconds",
            "Create latency by phase (placement here; the edge reports the others)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._decision_children: dict[tuple[str, str], Counter] = {}
        self._placement_phase = self.create_phase.labels("placement")
        r.register(NodesCollector(placement))
        placement.on_choose = self.placed

    def local_edge(self, node: str) -> ProcessMetrics | None:
        edge = getattr(self.edges.get(node), "edge", None)  # a LocalEdgeLink's (dsec up)
        prom = getattr(edge, "prom", None)
        return prom if isinstance(prom, ProcessMetrics) else None

    def placed(self, backend: str, outcome: str, started: float) -> None:
        """``started``: ``time.perf_counter()`` when the choice began."""
        # Label children kept: ``labels()`` validates and locks on every call (as in
        # ProcessMetrics.middleware). Both keys are placement's enums: the cache stays small.
        child = self._decision_children.get((backend, outcome))
        if child is None:
            child = self._decision_children[(backend, outcome)] = self.decisions.labels(backend, outcome)
        child.inc()
        self._placement_phase.observe(time.perf_counter() - started)


class NodesCollector(Collector):
    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snapshot = self.placement.watcher.snapshot
        up = GaugeMetricFamily("dsec_node_up", "Whether the node answered the last poll", labels=["node"])
        load = GaugeMetricFamily("dsec_node_load", "Running + creating over capacity", labels=["node"])
        age = GaugeMetricFamily("dsec_node_poll_age_seconds", "Since the node's last poll", labels=["node"])
        now = time.time()
        loads = []
        for node, s in snapshot.items():
            healthy = bool(s.get("healthy"))
            up.add_metric([node], int(healthy))
            age.add_metric([node], max(0.0, now - float(s.get("polled_at", now))))
            if healthy:
                busy = s.get("running", 0) + s.get("creating", 0)
                value = float(busy) / max(1, int(s.get("capacity", 1)))
                load.add_metric([node], value)
                loads.append(value)
        yield up
        yield load
        yield age
        yield GaugeMetricFamily(
            "dsec_placement_imbalance",
            "Load of the most loaded healthy node minus the least loaded's",
            value=max(loads) - min(loads) if loads else 0.0,
        )
        yield GaugeMetricFamily("dsec_nodes_healthy", "Nodes that answered the last poll", value=len(loads))
