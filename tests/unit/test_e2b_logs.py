"""The E2B log entries made of a trajectory (apiserver/e2b/logs.py), for the outcomes a live
sandbox rarely shows: a step an edge restart cut short, a process killed by a signal, one still
running; and the query's order, floor and cursor."""

from __future__ import annotations

from typing import Any

from dsec.apiserver.e2b.logs import log_entries, ms, select
from dsec.protocol.models import TrajectoryEntry


def step(seq: int, status: str, t: float, done: float | None, **kw: Any) -> TrajectoryEntry:
    return TrajectoryEntry(seq=seq, kind="process", status=status, started_at=t, finished_at=done, **kw)


def test_each_outcome_has_its_level_and_words() -> None:
    steps = [
        step(
            1, "done", 10.0, 11.0, request={"argv": ["sleep", "1 0"]}, result={"exit_code": -9, "signal": 9}
        ),
        step(2, "interrupted", 12.0, None, request={"argv": ["make"]}),
        step(3, "running", 13.0, None, request={"argv": ["serve"]}),
        step(4, "failed", 14.0, 14.5, error={"error": {"code": "invalid_request", "message": "no user x"}}),
    ]
    got = [(e["level"], e["message"], e["fields"]["event_type"]) for e in log_entries(steps)]
    assert got == [
        ("info", "Process started: sleep '1 0'", "process_start"),
        ("info", "Process killed by signal 9", "process_end"),
        ("info", "Process started: make", "process_start"),
        ("warn", "Process interrupted (its node restarted while it ran)", "process_end"),
        ("info", "Process started: serve", "process_start"),  # no end yet
        ("info", "Process started", "process_start"),
        ("error", "Process failed: no user x", "process_end"),
    ]


def test_a_query_reads_back_from_its_cursor_above_its_floor() -> None:
    steps = [step(i, "failed" if i % 2 else "done", 100.0 + i, 100.5 + i) for i in range(1, 7)]
    entries = log_entries(steps)
    errors = select(entries, cursor=None, backward=True, level="error", limit=10)
    assert [ms(e["timestamp"]) for e in errors] == [105_500, 103_500, 101_500]
    back = select(entries, cursor=103_000, backward=True, level="debug", limit=3)
    assert [ms(e["timestamp"]) for e in back] == [103_000, 102_500, 102_000]
    forward = select(entries, cursor=103_000, backward=False, level="info", limit=2, search="started")
    assert [ms(e["timestamp"]) for e in forward] == [103_000, 104_000]
