"""Group commit for reservations: many creates' quota checks in one transaction.

Every create reserves quota, and every reservation locks the root project's row (all
projects are below it). One transaction per create therefore caps a cluster's creation
rate at what one row lock and one commit allow (about 1,800/s on SQLite on the 2-core
development machine). Instead, reservations that arrive while a transaction is running
queue up and the next transaction takes all of them: it inserts their ledger rows, locks
the union of their ancestor chains once (in id order, like a single reservation), checks
each one in arrival order against the counters as the previous ones left them, and writes
each touched project's counters once. The result per reservation is exactly what running
them one after another would give, so quotas hold (no overshoot); an idle store still
commits a lone reservation at once, there is no timer.

A reservation whose ID is already in the ledger (a retried request) is answered by the
single-reservation path afterwards, which returns the existing row or raises ``Conflict``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dsec.iam.base import Reservation, ancestors, to_cores
from dsec.iam.ledger import PROJECT_COLS, Driver, ProjectRow, Tx, check_fits, params
from dsec.protocol.errors import InvalidRequest

_MAX_BATCH = 512
_ROWS_PER_INSERT = 100  # 6 parameters each: far below SQLite's and PostgreSQL's limits


@dataclass
class Want:
    project: str
    sandbox_id: str
    node: str | None
    cpu_m: int
    memory_mib: int


# A reservation, an error for this reservation alone, or None: already in the ledger.
Outcome = Reservation | Exception | None


async def reserve_many(tx: Tx, wants: list[Want]) -> list[Outcome]:
    now = time.time()
    inserted: set[str] = set()
    for at in range(0, len(wants), _ROWS_PER_INSERT):
        chunk = wants[at : at + _ROWS_PER_INSERT]
        values = ", ".join(f"({params(6, 6 * i + 1)})" for i in range(len(chunk)))
        args = [v for w in chunk for v in (w.sandbox_id, w.project, w.node, w.cpu_m, w.memory_mib, now)]
        rows = await tx.fetch(
            "INSERT INTO ledger (sandbox_id, project, node, cpu_m, memory_mib, since)"
            f" VALUES {values} ON CONFLICT (sandbox_id) DO NOTHING RETURNING sandbox_id",
            *args,
        )
        inserted.update(r[0] for r in rows)
    ids = sorted({p for w in wants for p in ancestors(w.project)})
    rows_by_id: dict[str, ProjectRow] = {}
    for at in range(0, len(ids), 500):  # each chunk in id order, chunks in order: one lock order
        some = ids[at : at + 500]
        found = await tx.fetch(
            f"SELECT {PROJECT_COLS} FROM projects WHERE id IN ({params(len(some))})"
            f" ORDER BY id{tx.lock_update}",
            *some,
        )
        rows_by_id.update((r[0], ProjectRow.of(r)) for r in found)
    before = dict(rows_by_id)
    outcomes: list[Outcome] = []
    refused: list[str] = []
    counted: set[str] = set()
    for w in wants:
        if w.sandbox_id not in inserted or w.sandbox_id in counted:
            outcomes.append(None)  # in the ledger before this batch, or twice in it
            continue
        counted.add(w.sandbox_id)
        chain = ancestors(w.project)
        try:
            missing = [p for p in chain if p not in rows_by_id]
            if missing:
                raise InvalidRequest(f"no project {missing[0]!r}")
            check_fits([rows_by_id[p] for p in chain], (1, w.cpu_m, w.memory_mib))
        except Exception as exc:
            outcomes.append(exc)
            refused.append(w.sandbox_id)
            continue
        for p in chain:
            row = rows_by_id[p]
            rows_by_id[p] = dataclasses.replace(
                row,
                used_sandboxes=row.used_sandboxes + 1,
                used_cpu_m=row.used_cpu_m + w.cpu_m,
                used_memory_mib=row.used_memory_mib + w.memory_mib,
            )
        outcomes.append(Reservation(w.sandbox_id, w.project, w.node, to_cores(w.cpu_m), w.memory_mib, now))
    for p, row in rows_by_id.items():
        old = before[p]
        if row != old:
            await tx.execute(
                "UPDATE projects SET used_sandboxes = used_sandboxes + $1, used_cpu_m = used_cpu_m + $2,"
                " used_memory_mib = used_memory_mib + $3 WHERE id = $4",
                row.used_sandboxes - old.used_sandboxes,
                row.used_cpu_m - old.used_cpu_m,
                row.used_memory_mib - old.used_memory_mib,
                p,
            )
    for at in range(0, len(refused), 500):
        gone = refused[at : at + 500]
        await tx.execute(f"DELETE FROM ledger WHERE sandbox_id IN ({params(len(gone))})", *gone)
    return outcomes


class ReservationQueue:
    """Feeds concurrent reservations to :func:`reserve_many`, one transaction at a time."""

    def __init__(
        self,
        db: Driver,
        single: Callable[[Want], Awaitable[Reservation]],
        undo: Callable[[str], Awaitable[object]],
    ) -> None:
        self._db = db
        self._single = single  # the one-at-a-time path, for IDs already in the ledger
        self._undo = undo  # releases a reservation whose caller gave up while it committed
        self._queue: list[_Entry] = []
        self._drainer: asyncio.Task[None] | None = None
        self._singles: set[asyncio.Task[None]] = set()

    async def reserve(self, want: Want) -> Reservation:
        """All or nothing, also for a caller cancelled at any point: a reservation not yet in
        a transaction is withdrawn; one being committed is waited for and then released."""
        entry = _Entry(want, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        try:
            return await asyncio.shield(entry.future)
        except asyncio.CancelledError:
            if entry in self._queue:
                self._queue.remove(entry)
                raise
            with contextlib.suppress(Exception):
                await asyncio.shield(entry.future)
                if entry.fresh:
                    await asyncio.shield(self._undo(want.sandbox_id))
            raise

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:_MAX_BATCH], self._queue[_MAX_BATCH:]
            wants = [e.want for e in batch]

            async def tx(tx: Tx, wants: list[Want] = wants) -> list[Outcome]:
                return await reserve_many(tx, wants)

            try:
                outcomes = await self._db.write(tx)
            except Exception as exc:  # the whole transaction failed: so did each reservation
                for e in batch:
                    e.future.set_exception(exc)
                continue
            for e, outcome in zip(batch, outcomes, strict=True):
                if outcome is None:
                    task = asyncio.create_task(self._one(e))
                    self._singles.add(task)
                    task.add_done_callback(self._singles.discard)
                elif isinstance(outcome, Exception):
                    e.future.set_exception(outcome)
                else:
                    e.fresh = True
                    e.future.set_result(outcome)

    async def _one(self, e: _Entry) -> None:
        try:
            e.future.set_result(await self._single(e.want))
        except Exception as exc:
            e.future.set_exception(exc)


@dataclass(eq=False)
class _Entry:
    want: Want
    future: asyncio.Future[Reservation]
    fresh: bool = False  # inserted by a batch (not an earlier reservation of the same ID)

    def __post_init__(self) -> None:
        # Retrieved here too, so an error for a caller that gave up is not reported as unseen.
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())
