"""A pool hands a freed sandbox to the call that has waited longest (``FnPool._release``),
never to one that arrived meanwhile, and never loses it to a call that gave up."""

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
        self.gate = asyncio.Event()

    async def call(self, task: FnTask) -> FnResult:
        self.calls += 1
        await self.gate.wait()
        self.gate.clear()
        return FnResult.model_validate(_result())


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
