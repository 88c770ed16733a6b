"""The edge's per-sandbox metric rings (no sandbox: the ring and the CPU share alone)."""

from __future__ import annotations

import pytest

from dsec.edge import metrics
from dsec.edge.metrics import CAPACITY, _cpu_pct, _Reading, _Series


def test_a_ring_keeps_the_last_capacity_samples_oldest_first() -> None:
    series = _Series(base=1_800_000_000.0, cpu_count=2, mem_total=1 << 30, disk_total=0)
    for i in range(CAPACITY + 7):
        series.push(_Reading(1_800_000_000.0 + 5 * i, 0, i << 20, 0, 0), 1.0)
    got = series.samples()
    assert len(got) == CAPACITY and len(series.rows) == CAPACITY * 5, "bounded"
    assert [s.mem_used >> 20 for s in got] == list(range(7, CAPACITY + 7))
    assert [round(s.ts) for s in got] == [1_800_000_000 + 5 * i for i in range(7, CAPACITY + 7)]


def test_cpu_share_is_of_the_sandboxs_cores() -> None:
    series = _Series(base=100.0, cpu_count=2, mem_total=0, disk_total=0)
    series.last = _Reading(100.0, 0, 0, 0, 0)
    # one core busy for the whole 5 s of a 2-core sandbox: half of it
    assert _cpu_pct(series, _Reading(105.0, 5 * 10**9, 0, 0, 0), 100.0) == pytest.approx(50.0)
    series.last = None  # no earlier sample: counted from the sandbox's start
    assert _cpu_pct(series, _Reading(110.0, 20 * 10**9, 0, 0, 0), 100.0) == pytest.approx(100.0)


def test_time_params_are_bounded() -> None:
    class Q:
        def __init__(self, value: str) -> None:
            self.query = {"start": value}

    assert metrics.time_param(Q("1712345678.25"), "start") == 1712345678.25  # type: ignore[arg-type]
    for bad in ("-1", "1e9", "99999999999", "nan", "1" * 40):
        with pytest.raises(metrics.InvalidRequest):
            metrics.time_param(Q(bad), "start")  # type: ignore[arg-type]
