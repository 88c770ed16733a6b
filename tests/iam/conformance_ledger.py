"""The ledger and concurrency half of the IAM conformance suite (see :mod:`tests.iam.conformance`).

The races are real: asyncio tasks sharing one store, several store instances in one process
(separate connections or pools), and separate processes (``tests.iam.racer``), all firing at
one quota at once. "Exactly N succeed" is checked, and afterwards ``recount()`` must find the
subtree counters equal to the ledger, so no lost update hides behind a correct total.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from dsec.iam.base import IamStore, Quota, Usage
from dsec.protocol.errors import Conflict, QuotaExceeded, SandboxNotFound
from dsec.protocol.ids import SandboxId

REPO = Path(__file__).resolve().parents[2]


def sid(node: str = "n1") -> str:
    return str(SandboxId.new(node, 1))


async def race(reserve: Callable[[int], Awaitable[object]], n: int) -> tuple[int, int]:
    """Run ``n`` reserves at once; returns (succeeded, refused for quota)."""

    async def one(i: int) -> bool:
        try:
            await reserve(i)
        except QuotaExceeded:
            return False
        return True

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return results.count(True), results.count(False)


class LedgerConformance:
    # -- release, bind, reconcile -----------------------------------------------------------

    async def test_release_gives_the_quota_back(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=2, cpu_cores=2, memory_mib=200))
        a, b = sid(), sid()
        await iam.reserve("root/p", a, 1, 100)
        await iam.reserve("root/p", b, 1, 100)
        assert await iam.usage("root/p") == Usage(2, 2.0, 200)
        assert await iam.release(a)
        assert not await iam.release(a)
        assert await iam.usage("root/p") == Usage(1, 1.0, 100)
        assert await iam.usage("root") == Usage(1, 1.0, 100)
        await iam.reserve("root/p", sid(), 1, 100)
        assert await iam.recount() == {}

    async def test_reserving_the_same_sandbox_again(self, iam: IamStore) -> None:
        x = sid()
        first = await iam.reserve("root", x, 1.5, 256)
        again = await iam.reserve("root", x, 1.5, 256)  # a retried request changes nothing
        assert (again.sandbox_id, again.cpu_cores, again.memory_mib) == (x, 1.5, 256)
        assert again.since == first.since
        assert (await iam.usage("root")).sandboxes == 1
        with pytest.raises(Conflict):
            await iam.reserve("root", x, 2, 256)

    async def test_the_node_comes_from_the_sandbox_id(self, iam: IamStore) -> None:
        assert (await iam.reserve("root", sid("edge-7"), 1, 1)).node == "edge-7"
        assert (await iam.reserve("root", "pending-token", 1, 1)).node is None
        assert (await iam.reserve("root", "other-token", 1, 1, node="n9")).node == "n9"

    async def test_bind_moves_a_pending_reservation_onto_the_sandbox(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=1))
        await iam.reserve("root/p", "create-1", 1, 64)
        real = sid("n2")
        bound = await iam.bind("create-1", real)
        assert (bound.sandbox_id, bound.node, bound.project) == (real, "n2", "root/p")
        assert [r.sandbox_id for r in await iam.reservations(node="n2")] == [real]
        assert await iam.reconcile({real}, "n2", grace_s=0) == []
        assert (await iam.usage("root/p")).sandboxes == 1
        with pytest.raises(SandboxNotFound):
            await iam.bind("create-1", sid("n2"))
        await iam.reserve("root", "create-2", 1, 64)
        with pytest.raises(Conflict):
            await iam.bind("create-2", real)
        assert await iam.release(real)

    async def test_reconcile_releases_what_the_edge_no_longer_reports(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=10))
        a, b, c, d = sid("n1"), sid("n1"), sid("n1"), sid("n2")
        for x in (a, b, c, d, "pending"):
            await iam.reserve("root/p", x, 1, 10)
        assert await iam.reconcile({a}, "n1") == []  # within the grace period: kept
        assert sorted(await iam.reconcile({a, "unrelated"}, "n1", grace_s=0)) == sorted([b, c])
        assert sorted(r.sandbox_id for r in await iam.reservations(project="root/p")) == sorted(
            [a, d, "pending"]
        )
        assert await iam.usage("root/p") == Usage(3, 3.0, 30)
        assert await iam.reconcile(set(), "n2", grace_s=0) == [d]  # a node that came back empty
        assert await iam.reconcile(set(), "n3", grace_s=0) == []
        assert await iam.expire_pending(3600) == []
        assert await iam.expire_pending(0) == ["pending"]
        assert [r.sandbox_id for r in await iam.reservations()] == [a]
        assert await iam.recount() == {}

    async def test_concurrent_reconciles_release_each_row_once(
        self, iam: IamStore, reopen: Callable[..., Awaitable[IamStore]]
    ) -> None:
        await iam.create_project("root", "p")
        ids = [sid("n1") for _ in range(60)]
        for x in ids:
            await iam.reserve("root/p", x, 0.25, 8)
        live = set(ids[:10])
        other = await reopen()
        # Two apiservers reconciling the same node at once, while a third path releases some.
        reconciles = asyncio.gather(
            iam.reconcile(live, "n1", grace_s=0), other.reconcile(live, "n1", grace_s=0)
        )
        releases = asyncio.gather(*(iam.release(x) for x in ids[10:20]))
        by_reconcile, by_release = await asyncio.gather(reconciles, releases)
        reconciled = [x for r in by_reconcile for x in r]
        released = [x for x, ok in zip(ids[10:20], by_release, strict=True) if ok]
        assert sorted(reconciled + released) == sorted(ids[10:])
        assert await iam.usage("root/p") == Usage(10, 2.5, 80)
        assert await iam.recount() == {}

    async def test_cancelled_calls_leave_all_or_nothing_behind(self, iam: IamStore) -> None:
        # A client that gives up (a timeout) cancels the call at any point of its transaction,
        # also while a statement is executing. Sweep the point: a few loop turns, a few µs.
        await iam.create_project("root", "c", Quota(sandboxes=1000))
        failures: list[BaseException] = []
        for n in range(240):
            op = iam.reserve("root/c", f"c-{n}", 1, 1) if n % 3 else iam.release(f"c-{n - 1}")
            task = asyncio.ensure_future(op)
            for _ in range(n % 5):
                await asyncio.sleep(0)
            spin = time.perf_counter() + (n % 7) * 3e-6
            while time.perf_counter() < spin:
                pass
            task.cancel()
            [outcome] = await asyncio.gather(task, return_exceptions=True)
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                failures.append(outcome)
        assert failures == []
        assert await iam.recount() == {}
        held = len(await iam.reservations())
        await iam.reserve("root/c", "after", 1, 1)
        assert (await iam.usage("root/c")).sandboxes == held + 1

    # -- quotas under concurrency -----------------------------------------------------------

    async def test_reconciling_many_nodes_at_once(self, iam: IamStore) -> None:
        await iam.create_project("root", "r")
        ids = {node: [sid(node) for _ in range(3)] for node in ("n1", "n2", "n3")}
        for node_ids in ids.values():
            for s in node_ids:
                await iam.reserve("root/r", s, 1, 1)
        live = {"n1": ids["n1"][:1], "n2": ids["n2"]}  # n3 did not answer: its rows stay
        released = await iam.reconcile_nodes(live, grace_s=0)
        assert sorted(released) == sorted(ids["n1"][1:])
        held = {r.sandbox_id for r in await iam.reservations()}
        assert held == {ids["n1"][0], *ids["n2"], *ids["n3"]}
        assert (await iam.usage("root/r")).sandboxes == 7
        assert await iam.reconcile_nodes({"n2": []}, grace_s=3600) == [], "young rows are spared"
        assert await iam.reconcile_nodes({}) == []

    async def test_concurrent_reserves_each_get_their_own_answer(self, iam: IamStore) -> None:
        # Concurrent reserves share transactions (iam/group_commit.py): one caller's refusal,
        # retry or unknown project must not leak into another's answer.
        await iam.create_project("root", "g", Quota(sandboxes=2))
        await iam.reserve("root/g", "earlier", 1, 1)
        calls = [
            iam.reserve("root/g", "earlier", 1, 1),  # a retried request: the same row again
            iam.reserve("root/g", "twice", 1, 1),
            iam.reserve("root/g", "twice", 1, 1),  # the same ID twice in one batch
            iam.reserve("root/nope", "lost", 1, 1),
            iam.reserve("root/g", "one-more", 1, 1),  # the quota of 2 is full now
            iam.reserve("root", "elsewhere", 1, 1),
            iam.reserve("root/g", "earlier", 2, 1),  # the same ID with other amounts
        ]
        out = await asyncio.gather(*calls, return_exceptions=True)
        assert [type(o).__name__ for o in out] == [
            "Reservation",
            "Reservation",
            "Reservation",
            "InvalidRequest",
            "QuotaExceeded",
            "Reservation",
            "Conflict",
        ]
        assert (await iam.usage("root/g")).sandboxes == 2
        assert {r.sandbox_id for r in await iam.reservations()} == {"earlier", "twice", "elsewhere"}
        assert await iam.recount() == {}

    async def test_concurrent_reserves_never_overshoot(self, iam: IamStore) -> None:
        await iam.create_project("root", "q", Quota(sandboxes=10))
        await iam.create_project("root/q", "leaf")
        ok, refused = await race(lambda i: iam.reserve("root/q/leaf", f"t-{i}", 0.5, 64), 50)
        assert (ok, refused) == (10, 40)
        assert (await iam.usage("root/q")).sandboxes == 10
        assert len(await iam.reservations()) == 10
        assert await iam.recount() == {}

    async def test_concurrent_reserves_through_several_instances(
        self, iam: IamStore, reopen: Callable[..., Awaitable[IamStore]]
    ) -> None:
        await iam.create_project("root", "q", Quota(cpu_cores=5))
        stores = [iam, await reopen(), await reopen()]
        ok, refused = await race(lambda i: stores[i % 3].reserve("root/q", f"t-{i}", 0.5, 64), 60)
        assert (ok, refused) == (10, 50)
        assert (await iam.usage("root/q")).cpu_cores == 5.0
        assert await iam.recount() == {}

    async def test_siblings_race_for_their_parent_quota(self, iam: IamStore) -> None:
        await iam.create_project("root", "job", Quota(sandboxes=10))
        await iam.create_project("root/job", "x", Quota(sandboxes=8))
        await iam.create_project("root/job", "y", Quota(sandboxes=8))
        ok, _ = await race(lambda i: iam.reserve(f"root/job/{'xy'[i % 2]}", f"t-{i}", 1, 1), 50)
        assert ok == 10
        x, y = (await iam.usage("root/job/x")).sandboxes, (await iam.usage("root/job/y")).sandboxes
        assert x + y == 10 and x <= 8 and y <= 8
        assert await iam.recount() == {}

    async def test_concurrent_reserves_from_four_processes(
        self, iam: IamStore, racer_argv: list[str], tmp_path: Path
    ) -> None:
        await iam.create_project("root", "q", Quota(sandboxes=10))
        await iam.create_project("root/q", "leaf")
        go = tmp_path / "go"
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.iam.racer",
                *racer_argv,
                "root/q/leaf",
                "13",
                f"p{n}",
                str(go),
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            for n in range(4)
        ]
        try:
            for p in procs:  # every racer has its store open before any starts
                assert p.stdout is not None
                line = await asyncio.wait_for(p.stdout.readline(), 60)
                assert line == b"ready\n", line + (await p.stderr.read() if p.stderr else b"")
            go.touch()
            outputs = [await asyncio.wait_for(p.communicate(), 60) for p in procs]
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        results = []
        for p, (out, err) in zip(procs, outputs, strict=True):
            assert p.returncode == 0, err.decode()
            results.append(json.loads(out))
        assert sum(r["ok"] for r in results) == 10
        assert sum(r["quota"] for r in results) == 42
        assert (await iam.usage("root/q")).sandboxes == 10
        assert await iam.recount() == {}

    async def test_mixed_creates_and_releases_stay_consistent(
        self, iam: IamStore, reopen: Callable[..., Awaitable[IamStore]]
    ) -> None:
        await iam.create_project("root", "a", Quota(sandboxes=12, cpu_cores=6))
        for parent, name, quota in (
            ("root/a", "b", Quota(sandboxes=8)),
            ("root/a", "c", None),
            ("root/a/b", "d", Quota(cpu_cores=3)),
            ("root", "e", Quota(memory_mib=1000)),
        ):
            await iam.create_project(parent, name, quota)
        leaves = ["root/a/b/d", "root/a/b", "root/a/c", "root/a", "root/e", "root"]
        stores = [iam, await reopen(), await reopen()]
        rng = random.Random(4)
        held: list[str] = []

        async def worker(w: int) -> None:
            store = stores[w % 3]
            for i in range(25):
                if held and rng.random() < 0.4:
                    await store.release(held.pop(rng.randrange(len(held))))
                    continue
                try:
                    r = await store.reserve(rng.choice(leaves), f"w{w}-{i}", rng.choice((0.5, 1.0)), 100)
                except QuotaExceeded:
                    continue
                held.append(r.sandbox_id)

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(12))), 120)
        assert await iam.recount() == {}
        for p in await iam.list_projects():
            for used, limit in zip(
                (p.usage.sandboxes, p.usage.cpu_cores, p.usage.memory_mib),
                (p.quota.sandboxes, p.quota.cpu_cores, p.quota.memory_mib),
                strict=True,
            ):
                assert limit is None or used <= limit, p
        assert sorted(r.sandbox_id for r in await iam.reservations()) == sorted(held)
