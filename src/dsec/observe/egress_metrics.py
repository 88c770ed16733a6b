"""The egress name check's figures: what the edge's HAProxy (:mod:`dsec.netpolicy.sniproxy`)
let through or refused, read from its admin socket just before a scrape (with the firewall's
counters, :meth:`dsec.netpolicy.policy.EgressPolicy.read_firewall`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric

if TYPE_CHECKING:
    from dsec.netpolicy.policy import EgressPolicy

KINDS = ("tls", "http")
VERDICTS = ("granted", "refused")


def name_checks(egress: EgressPolicy) -> Iterator[Metric]:
    """Nothing while the proxy does not answer (or the node has none): no figure, not a 0."""
    counts = egress.name_checks()
    if not counts:
        return
    family = CounterMetricFamily(
        "dsec_egress_name_checks",
        "What the edge's name check (HAProxy, between sandboxes and the addresses they learned"
        " from a granted domain, on ports 443 and 80) decided, by kind and verdict: kind=tls,"
        " connections by the TLS server name (refused: no server name, another site's, or not"
        " TLS); kind=http, requests by Host (refused: answered 403; one kept-alive connection"
        " may carry several). Reset when HAProxy restarts (it outlives an edge restart that"
        " keeps its configuration)",
        labels=["kind", "verdict"],
    )
    for kind in KINDS:
        for verdict in VERDICTS:
            family.add_metric([kind, verdict], counts.get((kind, verdict), 0))
    yield family
