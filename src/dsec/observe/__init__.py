"""Seeing a running cluster (issue 32): request IDs and structured logs, and Prometheus metrics.

``request_ids`` and ``logs``: one ID follows a request from the SDK through the apiserver to the
edge. ``metrics`` (with ``edge_metrics`` and ``api_metrics``): each apiserver's and edge's
``/metrics``, from a :class:`prometheus_client.CollectorRegistry` each object owns (never the
library's global one: ``dsec up`` runs an apiserver and an edge in one process).
"""
