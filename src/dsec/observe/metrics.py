"""The ``/metrics`` route and what every process part's metrics share.

A :class:`ProcessMetrics` (an edge's :class:`~dsec.observe.edge_metrics.EdgeMetrics`, an
apiserver's :class:`~dsec.observe.api_metrics.ApiMetrics`) owns one ``CollectorRegistry``.
Most figures are read from the object's own state when Prometheus scrapes (custom collectors
over the edge's sandbox table, its tallies, the sampler's last readings): nothing is counted
twice and nothing costs a thing between scrapes. Events (creates, stops, errors, latencies)
are counted by a hook at the one place each happens.

Cardinality is bounded by construction: label values are enums (states, backends, error
codes and reasons, the server's route patterns, never a raw path) or come from a set the
operator controls and capped (projects: the :data:`MetricsOptions.max_projects` largest, the
rest as ``_other``). Jobs are a per-run label, unbounded over time: they are a label only when
``DSEC_METRICS_JOBS=N`` is set (the N largest jobs, the rest as ``_other``).

:func:`serve_metrics` adds the route and a middleware counting requests and errors: one line
in each server's ``app()``. The route sits behind that server's own authentication (the
cluster secret on an edge, an admin key on an apiserver).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.process_collector import ProcessCollector

from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.protocol.http import CLIENT_CLOSED_REQUEST, require_cluster_secret

METRICS_PATH = "/metrics"
CLUSTER_METRICS_PATH = "/cluster/v1/metrics"  # an apiserver's, for the cluster secret
JOBS_ENV = "DSEC_METRICS_JOBS"
OTHER = "_other"  # the label value every key past a cap folds into
MAX_JOBS = 1000
# Latencies from a millisecond (an exec round trip) to minutes (a VM's create).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Per route: a series set per route pattern, so fewer buckets (a scrape's cost is its lines).
ROUTE_BUCKETS = (0.005, 0.025, 0.1, 0.5, 2.5, 10, 60)

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

Authorize = Callable[[web.Request], None]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class MetricsOptions:
    """``max_projects``: projects named in labels (the largest; IAM bounds them anyway).
    ``jobs``: jobs named in labels (0: none, the default; ``DSEC_METRICS_JOBS``)."""

    max_projects: int = 200
    jobs: int = 0

    @classmethod
    def from_env(cls) -> MetricsOptions:
        raw = os.environ.get(JOBS_ENV, "0").strip() or "0"
        try:
            jobs = int(raw)
        except ValueError:
            jobs = 0
        return cls(jobs=max(0, min(jobs, MAX_JOBS)))


def top(tally: Tally[str], limit: int) -> dict[str, int]:
    """``tally`` with at most ``limit`` keys: the largest, the rest summed under :data:`OTHER`."""
    if len(tally) <= limit:
        return dict(tally)
    kept = dict(tally.most_common(limit))
    rest = sum(tally.values()) - sum(kept.values())
    if rest:
        kept[OTHER] = kept.get(OTHER, 0) + rest
    return kept


def bounded(value: str, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``, else ``other``: free text never becomes a label."""
    return value if value in allowed else "other"


class ProcessMetrics:
    """One registry and what every server counts: requests by route, errors by code and reason."""

    def __init__(self, part: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # CPU seconds and RSS: what a scrape itself costs shows here
        self.requests = Counter(
            f"dsec_{part}_http_requests",
            "HTTP requests handled, by route pattern, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            f"dsec_{part}_http_request_seconds",
            "HTTP request latency by route pattern (a stream: until its last byte)",
            ["route", "method"],
            buckets=ROUTE_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "dsec_errors",
            "DSecErrors answered, by code and reason",
            ["code", "reason"],
            registry=r,
        )
        # The label children by (route, method, status): ``labels()`` validates and locks on
        # every call, a third of what this middleware cost a cheap GET (docs/decisions.md).
        self._children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self.loop_lag = Gauge(
            "dsec_event_loop_lag_seconds",
            "How long a callback waited for the event loop at the last scrape",
            registry=r,
        )

    def local_edge(self, node: str) -> ProcessMetrics | None:
        """The metrics of edge ``node`` when it runs in this process (an apiserver's override)."""
        return None

    def error(self, exc: DSecError) -> None:
        self.errors.labels(exc.code, str(exc.reason or "")).inc()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request.match_info.route.resource
        route = info.canonical if info is not None else "unmatched"
        if route.startswith(METRICS_PATH) or route == CLUSTER_METRICS_PATH:
            return await handler(request)  # scrapes are Prometheus's own business
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except DSecError as exc:
            status = exc.status
            self.error(exc)
            raise
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # its client hung up (or the server shut down): not a 500
            status = CLIENT_CLOSED_REQUEST
            raise
        finally:
            # Bounded, the cache as the labels: routes are the server's patterns, methods a
            # fixed set (a client may send any token), statuses HTTP's.
            method = bounded(request.method, HTTP_METHODS)
            key = (route, method, status)
            children = self._children.get(key)
            if children is None:
                children = (
                    self.requests.labels(route, method, str(status)),
                    self.request_seconds.labels(route, method),
                )
                self._children[key] = children
            children[0].inc()
            children[1].observe(time.perf_counter() - started)

    async def scrape(self) -> bytes:
        loop = asyncio.get_running_loop()
        before = loop.time()
        await asyncio.sleep(0)  # back once every callback ready before it ran: the loop's lag now
        self.loop_lag.set(loop.time() - before)
        return generate_latest(self.registry)


def serve_metrics(app: web.Application, metrics: ProcessMetrics, authorize: Authorize | None = None) -> None:
    """``GET /metrics`` on ``app`` and the counting middleware (innermost: it sees a handler's
    DSecError before the server's error middleware turns it into a response).

    ``authorize`` runs first (the apiserver's ``require_admin``); an edge's own middleware
    already asked for the cluster secret. An apiserver with edges in its process (``dsec up``)
    serves each one's at ``/metrics/edges/{node}``: they have no HTTP server of their own."""

    async def handle(request: web.Request) -> web.Response:
        if authorize is not None:
            authorize(request)
        return _exposition(await metrics.scrape())

    async def handle_local(request: web.Request) -> web.Response:
        if authorize is not None:
            authorize(request)
        node = request.match_info["node"]
        local = metrics.local_edge(node)
        if local is None:
            raise InvalidRequest(f"no edge {node[:100]!r} runs in this process")
        return _exposition(await local.scrape())

    app.middlewares.append(metrics.middleware)
    app.router.add_get(METRICS_PATH, handle)
    app.router.add_get(METRICS_PATH + "/edges/{node}", handle_local)


def serve_cluster_metrics(app: web.Application, metrics: ProcessMetrics, secret: str) -> None:
    """An apiserver's metrics at ``/cluster/v1/metrics`` for the cluster secret too: one
    credential then scrapes every apiserver and edge. (Not ``/metrics`` itself: the
    apiserver's auth middleware takes any bearer token there for an API key.)"""
    token = secret.encode()

    async def handle(request: web.Request) -> web.Response:
        require_cluster_secret(request, token)
        return _exposition(await metrics.scrape())

    app.router.add_get(CLUSTER_METRICS_PATH, handle)


def _exposition(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
