"""A sandbox's resource sample as it crosses the wire (the ``metrics`` op's answer).

The edge samples (:mod:`dsec.edge.metrics`); apiservers, the E2B front and the SDK read these.
"""

from __future__ import annotations

from pydantic import BaseModel

MAX_UNIX_S = 10_413_791_999  # 2299-12-31T23:59:59Z, the last second E2B's API takes


class MetricSample(BaseModel):
    ts: float  # unix seconds
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int
