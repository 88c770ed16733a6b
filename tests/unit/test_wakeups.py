"""Wakeups: when the reaper next looks at each sandbox (edge/wakeups.py)."""

from __future__ import annotations

from dsec.edge.wakeups import Wakeups


def test_a_sandbox_is_due_once_at_the_earliest_time_asked() -> None:
    w = Wakeups()
    w.at("a", 10.0)
    w.at("a", 20.0)  # later: the earlier request stands
    w.at("b", 15.0)
    w.at("b", 5.0)  # earlier: it wins
    assert w.due(4.9) == []
    assert w.due(5.0) == ["b"]
    assert w.due(12.0) == ["a"]
    assert w.due(100.0) == []  # each once: the superseded entries are not returned again
    assert len(w) == 0


def test_a_forgotten_sandbox_is_not_due_and_can_be_asked_for_again() -> None:
    w = Wakeups()
    w.at("a", 1.0)
    w.forget("a")
    assert w.due(2.0) == []
    w.at("a", 3.0)
    assert w.due(3.0) == ["a"]


def test_superseded_entries_are_dropped_without_losing_a_time() -> None:
    w = Wakeups()
    for i in range(5000):  # each request earlier than the last: one live time, many stale entries
        w.at("a", 10_000.0 - i)
        w.at(f"s{i % 7}", 50_000.0 + i % 7)
    assert len(w._heap) <= 2 * len(w) + 1024
    assert w.due(5_001.0) == ["a"]
    assert sorted(w.due(60_000.0)) == [f"s{i}" for i in range(7)]
