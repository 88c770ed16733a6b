"""A pool hands a freed sandbox to the call that has waited longest (``FnPool._release``),
never to one that arrived meanwhile, and never loses it to a call that gave up; a sandbox
replaced after ``max_calls`` costs the pool no capacity and its last call no wait."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from dsec.edge.fncall.pool import FnPool, PoolConfig, Worker
from dsec.protocol.errors import CapacityExhausted
from dsec.protocol.fncall import FnResult, FnTask

TASK = FnTask.model_validate({"language": "python", "code": "print(1)"})


class FakeWorker:
    """Stands for a runner: each call waits until the test lets it finish."""

    def __init__(self, name: str) -> None:
        self.sandbox_id = name
        self.calls = 0
        self.succeeded = False
        self.gate = asyncio.Event()

    async def call(self, task: FnTask) -> FnResult:
        self.calls += 1
        await self.gate.wait()
        self.gate.clear()
        return FnResult.model_validate(_result())

    async def close(self) -> None:
        pass


class QuickWorker(FakeWorker):
    async def call(self, task: FnTask) -> FnResult:
        self.calls += 1
        return FnResult.model_validate(_result())


class SlowStops:
    """The edge, as far as retiring goes: a stop takes until the test says."""

    def __init__(self) -> None:
        self.stopped: list[str] = []
        self.done = asyncio.Event()

    async def stop(self, sandbox_id: str, *, reason: str = "") -> None:
        await self.done.wait()
        self.stopped.append(sandbox_id)


def _result() -> dict[str, Any]:
    return {
        "status": "ok",
        "exit_code": 0,
        "signal": None,
        "stdout": "1\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "files": {},
        "fetch_errors": {},
        "judged": None,
        "compile_time_s": 0.0,
        "run_time_s": 0.0,
        "cpu_time_s": 0.0,
        "max_rss_kib": 0,
        "clean": True,
    }


def _pool(*workers: FakeWorker) -> FnPool:
    pool = FnPool(cast(Any, None), PoolConfig(size=len(workers)))
    for w in workers:
        pool._workers[w.sandbox_id] = cast(Worker, w)
        pool._release(cast(Worker, w))
    return pool


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_freed_sandbox_goes_to_the_oldest_waiter_not_a_newcomer() -> None:
    worker = FakeWorker("w")
    pool = _pool(worker)
    order: list[str] = []

    async def call(name: str) -> None:
        await pool.call(TASK)
        order.append(name)

    first = asyncio.create_task(call("first"))
    await _settle()  # first holds the sandbox
    waiting = [asyncio.create_task(call(f"waiter{i}")) for i in range(3)]
    await _settle()
    # A call arriving as `first` ends runs between the release and waiter0's wake-up: it must
    # still queue behind the waiters (with an asyncio.Queue it took the sandbox).
    newcomer = asyncio.create_task(call("newcomer"))
    worker.gate.set()
    for _ in range(5):
        await _settle()
        worker.gate.set()
    await asyncio.gather(first, *waiting, newcomer)
    assert order == ["first", "waiter0", "waiter1", "waiter2", "newcomer"]


async def test_a_sandbox_handed_to_a_call_that_was_cancelled_goes_to_the_next() -> None:
    worker = FakeWorker("w")
    pool = _pool(worker)
    taken = await pool._take(1.0)  # as a call does
    leaving = asyncio.create_task(pool.call(TASK))
    staying = asyncio.create_task(pool.call(TASK))
    await _settle()
    pool._release(taken)  # handed to `leaving` ...
    leaving.cancel()  # ... which is cancelled before it resumes
    await _settle()
    worker.gate.set()
    assert (await staying).stdout == "1\n"
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert worker.calls == 1 and list(pool._idle) == [worker]


async def test_no_free_sandbox_within_the_queue_timeout_is_capacity_exhausted() -> None:
    worker = FakeWorker("w")
    pool = _pool(worker)
    holder = asyncio.create_task(pool.call(TASK))
    await _settle()
    with pytest.raises(CapacityExhausted, match="no sandbox free"):
        await pool.call(TASK, queue_timeout_s=0.01)
    worker.gate.set()
    await holder
    assert list(pool._idle) == [worker] and not pool._waiters


async def test_a_sandbox_at_max_calls_has_its_successor_already_and_its_last_call_no_wait() -> None:
    old = QuickWorker("old")
    pool = _pool(old)
    pool.config.max_calls = 40  # the successor starts 5% ahead: at 38 calls
    edge = SlowStops()
    pool.edge = cast(Any, edge)
    added: list[QuickWorker] = []

    async def add() -> None:  # as FnPool._add ends: a started sandbox joins the pool
        new = QuickWorker(f"new{len(added)}")
        added.append(new)
        pool._workers[new.sandbox_id] = cast(Worker, new)
        pool._release(cast(Worker, new))

    pool._add = add  # type: ignore[method-assign]
    for _ in range(37):
        await pool.call(TASK)
    await _settle()
    assert not added and old.calls == 37
    await pool.call(TASK)  # the 38th
    await _settle()
    assert len(added) == 1 and set(pool._workers) == {"old", "new0"}, "the successor serves beside it"
    while old.calls < 40:  # the two share the calls meanwhile
        await pool.call(TASK)
    # The 40th call had its answer while the stop was still under way.
    assert not edge.stopped and set(pool._workers) == {"new0"} and old not in pool._idle
    edge.done.set()
    await _settle()
    assert edge.stopped == ["old"] and pool.recycled == 1
    assert len(added) == 1, "no second replacement: the successor was the replacement"
