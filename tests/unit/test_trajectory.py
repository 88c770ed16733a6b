"""The trajectory log and its recorder: every request is written down with its outcome, and a
request with an idempotency key runs at most once per sandbox, also across an edge restart."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.edge.trajectory import Recorder, TrajectoryLog
from dsec.protocol.errors import (
    CommandTimeout,
    Conflict,
    DSecError,
    FileNotFound,
    InfraFailure,
    SandboxNotFound,
    SessionLost,
)
from tests.support import DEADLINE_S, eventually

SB = "sb-one"
OTHER = "sb-two"

Test = Callable[..., Awaitable[None]]


def bounded(test: Test) -> Test:
    """A test that waits on the recorder's tasks fails after a deadline instead of hanging."""

    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> None:
        async with asyncio.timeout(DEADLINE_S):
            await test(*args, **kwargs)

    return run


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "edge" / "trajectory.sqlite"


@pytest.fixture
def log(log_path: Path) -> Iterator[TrajectoryLog]:
    opened = TrajectoryLog(log_path)
    yield opened
    opened.close()


@pytest.fixture
def recorder(log: TrajectoryLog) -> Recorder:
    return Recorder(log)


class Counted:
    """A request's work: counts its runs, and can be held until the test lets it finish."""

    def __init__(self, result: dict[str, Any] | None = None, *, hold: bool = False) -> None:
        self.result = result if result is not None else {"ok": True}
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = asyncio.Event()
        self.cancelled = False
        if not hold:
            self.release.set()

    async def __call__(self) -> dict[str, Any]:
        self.runs += 1
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.finished.set()
        return {**self.result, "run": self.runs}


def failing(exc: BaseException, counter: list[int]) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def run() -> dict[str, Any]:
        counter.append(1)
        raise exc

    return run


# -- calls --------------------------------------------------------------------------------------


async def test_unkeyed_calls_run_every_time_and_are_recorded_in_order(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    work = Counted({"stdout": "hi\n"})
    first = await recorder.call(SB, "shell", None, {"command": "echo hi"}, work)
    second = await recorder.call(SB, "shell", None, {"command": "echo hi"}, work)
    assert (work.runs, first["run"], second["run"]) == (2, 1, 2)
    entries = log.entries(SB)
    assert [(e.seq, e.kind, e.key, e.status) for e in entries] == [
        (1, "shell", None, "done"),
        (2, "shell", None, "done"),
    ]
    assert entries[0].request == {"command": "echo hi"}
    assert entries[0].result == {"stdout": "hi\n", "run": 1} and entries[0].error is None
    assert entries[0].finished_at is not None and entries[0].finished_at >= entries[0].started_at
    assert log.entries(OTHER) == [], "a sandbox's log holds only its own requests"


async def test_a_keyed_repeat_gets_the_recorded_result_without_running_again(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    work = Counted({"stdout": "1\n"})
    first = await recorder.call(SB, "shell", "step-1", {"command": "echo x >> f"}, work)
    again = await recorder.call(SB, "shell", "step-1", {"command": "echo x >> f"}, work)
    assert work.runs == 1 and again == first == {"stdout": "1\n", "run": 1}
    assert [(e.kind, e.key) for e in log.entries(SB)] == [("shell", "step-1")], "a repeat is not a step"
    # The key is per sandbox and per key: another key, or the same key elsewhere, runs.
    await recorder.call(SB, "shell", "step-2", {}, work)
    await recorder.call(OTHER, "shell", "step-1", {}, work)
    assert work.runs == 3


@bounded
async def test_a_concurrent_keyed_repeat_joins_the_run_in_progress(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    work = Counted(hold=True)
    first = asyncio.ensure_future(recorder.call(SB, "shell", "k", {}, work))
    await work.started.wait()
    arrived = asyncio.Event()

    async def repeat() -> dict[str, Any]:
        arrived.set()  # call() joins without yielding: once this task waits, it has joined
        return await recorder.call(SB, "shell", "k", {}, work)

    second = asyncio.ensure_future(repeat())
    await arrived.wait()
    assert not second.done(), "the repeat waits for the run in progress"
    work.release.set()
    assert await first == await second == {"ok": True, "run": 1}
    assert work.runs == 1
    assert [e.status for e in log.entries(SB)] == ["done"]


@bounded
async def test_a_concurrent_keyed_repeat_gets_the_failure_of_the_run_it_joined(recorder: Recorder) -> None:
    gate = asyncio.Event()
    runs: list[int] = []

    async def run() -> dict[str, Any]:
        runs.append(1)
        await gate.wait()
        raise Conflict("the sandbox is stopping")

    first = asyncio.ensure_future(recorder.call(SB, "shell", "k", {}, run))
    second = asyncio.ensure_future(recorder.call(SB, "shell", "k", {}, run))
    gate.set()
    for task in (first, second):
        with pytest.raises(Conflict, match="stopping"):
            await task
    assert runs == [1]


@bounded
async def test_a_cancelled_caller_does_not_cancel_its_keyed_run(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    work = Counted(hold=True)
    caller = asyncio.ensure_future(recorder.call(SB, "shell", "k", {}, work))
    await work.started.wait()
    caller.cancel()  # the trainer died mid-command
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not work.cancelled
    work.release.set()
    await work.finished.wait()
    # The new trainer's repeat gets what the run did (joined, or from the record).
    assert await recorder.call(SB, "shell", "k", {}, work) == {"ok": True, "run": 1}
    assert work.runs == 1
    await eventually(lambda: [e.status for e in log.entries(SB)] == ["done"], "the run to be recorded")


@bounded
async def test_a_cancelled_unkeyed_call_stops_its_run_and_says_so(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    work = Counted(hold=True)
    caller = asyncio.ensure_future(recorder.call(SB, "shell", None, {}, work))
    await work.started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert work.cancelled, "without a key the work is the caller's: it goes with it"
    [entry] = log.entries(SB)
    assert entry.status == "failed" and entry.error is not None
    assert entry.error["error"]["code"] == InfraFailure.code
    assert entry.error["error"]["reason"] == "interrupted"


@pytest.mark.parametrize(
    "error",
    [
        Conflict("sandbox is stopping"),
        FileNotFound("no /x"),
        CommandTimeout("ran past 3s"),
        SandboxNotFound("gone"),
        SessionLost("the shell died", reason="oom"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_recorded_failure_is_raised_again_as_the_same_class(
    recorder: Recorder, log: TrajectoryLog, error: DSecError
) -> None:
    runs: list[int] = []
    with pytest.raises(type(error)) as first:
        await recorder.call(SB, "shell", "k", {}, failing(error, runs))
    with pytest.raises(DSecError) as again:
        await recorder.call(SB, "shell", "k", {}, failing(error, runs))
    assert runs == [1], "a failed keyed request is not run again either"
    assert type(again.value) is type(first.value)
    assert (again.value.message, again.value.reason) == (error.message, error.reason)
    [entry] = log.entries(SB)
    assert entry.status == "failed" and entry.result is None
    assert entry.error is not None and entry.error["error"]["code"] == error.code


async def test_a_keyed_run_that_crashed_has_an_unknown_outcome(recorder: Recorder) -> None:
    runs: list[int] = []
    with pytest.raises(RuntimeError, match="bug"):
        await recorder.call(SB, "shell", "k", {}, failing(RuntimeError("bug"), runs))
    with pytest.raises(InfraFailure) as again:
        await recorder.call(SB, "shell", "k", {}, failing(RuntimeError("bug"), runs))
    assert runs == [1]
    assert again.value.reason == "interrupted"


# -- the file across restarts ---------------------------------------------------------------------


async def test_a_step_left_running_by_a_restart_is_interrupted_and_not_run_again(log_path: Path) -> None:
    before = TrajectoryLog(log_path)
    before.finish(SB, before.begin(SB, "shell", "done-key", {"command": "a"}), result={"stdout": "a"})
    seq = before.begin(SB, "shell", "k", {"command": "echo x >> f"})  # the edge dies here
    assert [e.status for e in before.entries(SB)] == ["done", "running"]
    before.close()

    after = TrajectoryLog(log_path)
    try:
        entries = after.entries(SB)
        assert [(e.seq, e.status) for e in entries] == [(1, "done"), (seq, "interrupted")]
        assert entries[1].finished_at is None and entries[1].result is None
        recorder = Recorder(after)
        work = Counted()
        with pytest.raises(InfraFailure) as info:
            await recorder.call(SB, "shell", "k", {"command": "echo x >> f"}, work)
        assert info.value.reason == "interrupted" and "k" in info.value.message
        # What finished before the restart still replays from the record.
        assert await recorder.call(SB, "shell", "done-key", {}, work) == {"stdout": "a"}
        assert work.runs == 0
    finally:
        after.close()


async def test_sequence_numbers_continue_after_a_reopen(log_path: Path) -> None:
    first = TrajectoryLog(log_path)
    recorder = Recorder(first)
    for _ in range(3):
        await recorder.call(SB, "shell", None, {}, Counted())
    await recorder.call(OTHER, "shell", None, {}, Counted())
    first.close()

    second = TrajectoryLog(log_path)
    try:
        await Recorder(second).call(SB, "write", None, {"path": "/f"}, Counted())
        assert [(e.seq, e.kind) for e in second.entries(SB)] == [
            (1, "shell"),
            (2, "shell"),
            (3, "shell"),
            (4, "write"),
        ]
        assert [e.seq for e in second.entries(OTHER)] == [1]
    finally:
        second.close()


async def test_entries_page_with_after_and_limit(recorder: Recorder, log: TrajectoryLog) -> None:
    for i in range(5):
        await recorder.call(SB, "shell", None, {"i": i}, Counted())
    await recorder.call(OTHER, "shell", None, {"i": 99}, Counted())
    assert [e.seq for e in log.entries(SB, limit=2)] == [1, 2]
    assert [e.seq for e in log.entries(SB, after=2, limit=2)] == [3, 4]
    assert [e.request["i"] for e in log.entries(SB, after=4, limit=2)] == [4]
    assert log.entries(SB, after=5) == []
    assert [e.seq for e in log.entries(SB)] == [1, 2, 3, 4, 5]


async def test_forget_drops_only_the_given_sandboxes(recorder: Recorder, log: TrajectoryLog) -> None:
    work = Counted()
    await recorder.call(SB, "shell", "k", {}, work)
    await recorder.call(SB, "shell", None, {}, work)
    await recorder.call(OTHER, "shell", "k", {}, work)
    log.forget([SB])
    assert log.entries(SB) == [] and log.by_key(SB, "k") is None
    assert [e.key for e in log.entries(OTHER)] == ["k"]
    runs = work.runs
    await recorder.call(SB, "shell", "k", {}, work)  # the key is free again
    await recorder.call(OTHER, "shell", "k", {}, work)  # still recorded: not run
    assert work.runs == runs + 1
    assert [(e.seq, e.key) for e in log.entries(SB)] == [(1, "k")]


# -- streams ------------------------------------------------------------------------------------


class Source:
    """An event stream's work: counts its runs; holds after the first event until released."""

    def __init__(self, n: int = 3, *, hold: bool = False, fail: DSecError | None = None) -> None:
        self.n = n
        self.fail = fail
        self.runs = 0
        self.release = asyncio.Event()
        self.closed = asyncio.Event()
        self.ended = asyncio.Event()
        if not hold:
            self.release.set()

    async def __call__(self) -> AsyncGenerator[dict[str, Any], None]:
        self.runs += 1
        try:
            for i in range(self.n):
                if i == 1:
                    await self.release.wait()
                yield {"t": "out", "i": i}
            if self.fail is not None:
                raise self.fail
            yield {"t": "exit", "code": 0}
            self.ended.set()
        finally:
            self.closed.set()


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"count": len(events), "exit": next((e["code"] for e in events if e["t"] == "exit"), None)}


EVENTS = [{"t": "out", "i": 0}, {"t": "out", "i": 1}, {"t": "out", "i": 2}, {"t": "exit", "code": 0}]


async def collect(events: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [ev async for ev in events]


async def test_an_unkeyed_stream_passes_through_and_records_a_summary(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    source = Source()
    for _ in range(2):
        got = await collect(recorder.stream(SB, "exec", None, {"argv": ["x"]}, source, summarize))
        assert got == EVENTS
    assert source.runs == 2
    entries = log.entries(SB)
    assert [(e.kind, e.key, e.status) for e in entries] == [("exec", None, "done")] * 2
    assert entries[0].request == {"argv": ["x"]}
    assert entries[0].result == {"count": 4, "exit": 0}


@bounded
async def test_closing_an_unkeyed_stream_stops_its_work(recorder: Recorder, log: TrajectoryLog) -> None:
    source = Source(hold=True)
    stream = recorder.stream(SB, "exec", None, {}, source, summarize)
    assert await anext(stream) == {"t": "out", "i": 0}
    await stream.aclose()  # the caller went away
    assert source.closed.is_set() and not source.ended.is_set()
    [entry] = log.entries(SB)
    assert entry.status == "done" and entry.result == {"count": 1, "exit": None}, "what it saw is recorded"


async def test_an_unkeyed_stream_that_fails_is_recorded_as_failed(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    source = Source(fail=SandboxNotFound("vanished mid-command"))
    seen: list[dict[str, Any]] = []
    with pytest.raises(SandboxNotFound, match="mid-command"):
        async for ev in recorder.stream(SB, "exec", None, {}, source, summarize):
            seen.append(ev)
    assert seen == EVENTS[:3]
    [entry] = log.entries(SB)
    assert entry.status == "failed" and entry.error is not None
    assert entry.error["error"]["code"] == SandboxNotFound.code


async def test_a_finished_keyed_stream_replays_from_the_record(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    source = Source()
    first = await collect(recorder.stream(SB, "exec", "e1", {}, source, summarize))
    again = await collect(recorder.stream(SB, "exec", "e1", {}, source, summarize))
    assert first == again == EVENTS
    assert source.runs == 1
    [entry] = log.entries(SB)
    assert (entry.key, entry.status) == ("e1", "done")
    assert entry.result is not None and entry.result["events"] == EVENTS and entry.result["count"] == 4
    # The record outlives the Recorder (an edge restart): a new one replays it too.
    assert await collect(Recorder(log).stream(SB, "exec", "e1", {}, source, summarize)) == EVENTS
    assert source.runs == 1


@bounded
async def test_every_listener_of_a_keyed_stream_gets_every_event_from_the_start(recorder: Recorder) -> None:
    source = Source(hold=True)
    first = recorder.stream(SB, "exec", "e1", {}, source, summarize)
    assert await anext(first) == {"t": "out", "i": 0}
    second = recorder.stream(SB, "exec", "e1", {}, source, summarize)
    assert await anext(second) == {"t": "out", "i": 0}, "a listener that joins late starts at the start"
    source.release.set()
    rest_first, rest_second = await asyncio.gather(collect(first), collect(second))
    assert rest_first == rest_second == EVENTS[1:]
    assert source.runs == 1


@bounded
async def test_a_keyed_stream_runs_to_its_end_when_its_listener_goes_away(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    source = Source(hold=True)
    stream = recorder.stream(SB, "exec", "e1", {}, source, summarize)
    assert await anext(stream) == {"t": "out", "i": 0}
    await stream.aclose()
    assert not source.closed.is_set(), "closing a keyed stream's listener leaves the work going"
    source.release.set()
    await source.ended.wait()
    await eventually(lambda: [e.status for e in log.entries(SB)] == ["done"], "the stream to be recorded")
    assert await collect(recorder.stream(SB, "exec", "e1", {}, source, summarize)) == EVENTS
    assert source.runs == 1


@bounded
async def test_a_cancelled_listener_does_not_cancel_a_keyed_stream(recorder: Recorder) -> None:
    source = Source(hold=True)
    first_event = asyncio.Event()

    async def listen() -> list[dict[str, Any]]:
        seen = []
        async for ev in recorder.stream(SB, "exec", "e1", {}, source, summarize):
            seen.append(ev)
            first_event.set()
        return seen

    listener = asyncio.ensure_future(listen())
    await first_event.wait()
    listener.cancel()
    with pytest.raises(asyncio.CancelledError):
        await listener
    joined = recorder.stream(SB, "exec", "e1", {}, source, summarize)
    source.release.set()
    assert await collect(joined) == EVENTS
    assert source.runs == 1 and source.ended.is_set()


async def test_a_keyed_stream_that_failed_fails_again_without_running(recorder: Recorder) -> None:
    source = Source(fail=CommandTimeout("ran past its timeout"))
    seen: list[dict[str, Any]] = []
    with pytest.raises(CommandTimeout):
        async for ev in recorder.stream(SB, "exec", "e1", {}, source, summarize):
            seen.append(ev)
    assert seen == EVENTS[:3]
    with pytest.raises(CommandTimeout, match="timeout"):
        await collect(recorder.stream(SB, "exec", "e1", {}, source, summarize))
    assert source.runs == 1


async def test_a_keyed_stream_interrupted_by_a_restart_is_not_run_again(log_path: Path) -> None:
    before = TrajectoryLog(log_path)
    before.begin(SB, "exec", "e1", {"argv": ["x"]})
    before.close()
    after = TrajectoryLog(log_path)
    try:
        source = Source()
        with pytest.raises(InfraFailure) as info:
            await collect(Recorder(after).stream(SB, "exec", "e1", {}, source, summarize))
        assert info.value.reason == "interrupted" and source.runs == 0
    finally:
        after.close()


async def test_a_key_reused_for_another_kind_of_request_is_a_conflict(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    await recorder.call(SB, "shell", "k", {}, Counted())
    with pytest.raises(Conflict, match="names a 'shell' request"):
        await collect(recorder.stream(SB, "exec", "k", {}, Source(), summarize))
    await collect(recorder.stream(SB, "exec", "e", {}, Source(), summarize))
    with pytest.raises(Conflict, match="names a 'exec' request"):
        await recorder.call(SB, "shell", "e", {}, Counted())


@bounded
async def test_a_key_reused_while_its_run_is_in_progress_is_a_conflict(recorder: Recorder) -> None:
    held = Counted(hold=True)
    first = asyncio.ensure_future(recorder.call(SB, "shell", "k", {}, held))
    await held.started.wait()
    with pytest.raises(Conflict):
        await collect(recorder.stream(SB, "exec", "k", {}, Source(), summarize))
    held.release.set()
    assert (await first)["run"] == 1


async def test_an_unkeyed_stream_broken_by_a_non_dsec_error_is_recorded_as_failed(
    recorder: Recorder, log: TrajectoryLog
) -> None:
    async def broken() -> AsyncGenerator[dict[str, Any], None]:
        yield {"t": "out"}
        raise RuntimeError("spawn failed")

    with pytest.raises(RuntimeError):
        await collect(recorder.stream(SB, "exec", None, {}, broken, summarize))
    [entry] = log.entries(SB)
    assert entry.status == "failed" and entry.error is not None
    assert entry.error["error"]["reason"] == "interrupted"


async def test_a_page_ends_at_its_byte_budget_and_paging_goes_on(
    recorder: Recorder, log: TrajectoryLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dsec.edge.trajectory.PAGE_BYTES", 10_000)
    for i in range(5):  # ~4 KB of request each: two fit a page
        await recorder.call(SB, "shell", None, {"i": i, "cmd": "x" * 4000}, Counted())
    pages, after = [], 0
    while page := log.entries(SB, after=after):
        pages.append([e.seq for e in page])
        after = page[-1].seq
    assert pages == [[1, 2], [3, 4], [5]]
    await recorder.call(SB, "shell", None, {"cmd": "y" * 20_000}, Counted())
    assert [e.seq for e in log.entries(SB, after=5)] == [6], "a step past the budget alone still comes"
