"""The usage ledger's transactions, written once for both SQL stores.

One ledger row per sandbox (or pending create) holds part of its project's quota. Each
project row also carries ``used_*`` counters for its whole subtree, so a create checks
``depth`` rows instead of summing a subtree that may hold hundreds of thousands of sandboxes.

Why no create overshoots: every change to the counters happens in one transaction that
first locks the project rows it touches, all ancestors of the project, in id order (paths:
a prefix sorts before its extensions). PostgreSQL takes them with ``SELECT ... FOR NO KEY
UPDATE`` (row locks that still let foreign-key checks through); SQLite's ``BEGIN
IMMEDIATE`` takes the database's single write lock instead. Two creates under a common
ancestor therefore run one after the other on that ancestor's row, and each sees the
other's committed counters. One global lock order means no deadlock between creates,
releases and reconciles; the rare one PostgreSQL can still detect (two reconciles deleting
overlapping rows) is retried by the driver.

Lock order everywhere: the ledger rows first (reserve inserts its row, release and reconcile
delete theirs), then the project rows in id order. The ledger has no foreign key to the
projects, so inserting a row takes no lock on a project row (a key-share lock there would
cross a project deletion's locks); a row for a project that does not exist is rolled back
when its ancestors are locked and one is missing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dsec.iam.base import Quota, Reservation, Usage, ancestors, to_cores, to_millicores
from dsec.protocol.errors import Conflict, InvalidRequest, QuotaExceeded, QuotaReason, SandboxNotFound

T = TypeVar("T")
Row = Sequence[Any]

PROJECT_COLS = (
    "id, parent, created_at, max_sandboxes, max_cpu_m, max_memory_mib,"
    " used_sandboxes, used_cpu_m, used_memory_mib, max_storage_mib"
)
_LEDGER_COLS = "sandbox_id, project, node, cpu_m, memory_mib, since"
_CHUNK = 500  # ids per IN list: under SQLite's and PostgreSQL's bound-parameter limits


class Tx(Protocol):
    """One open transaction (or, for reads, one connection), SQL written with ``$1`` params."""

    # Row-lock suffixes; empty on SQLite, whose BEGIN IMMEDIATE already holds the write lock.
    lock_update: str  # rows whose counters/quotas we change (not their keys)
    lock_delete: str  # rows we delete
    lock_share: str  # rows that must not vanish before we commit (a key's project)

    async def fetch(self, sql: str, *args: Any) -> list[Row]: ...

    async def execute(self, sql: str, *args: Any) -> None: ...


class Driver(Protocol):
    """How a store runs a transaction: the only part SQLite and PostgreSQL implement apart."""

    async def write(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        """Run ``fn`` in one write transaction; commit on return, roll back on an exception."""
        ...

    async def read(self, fn: Callable[[Tx], Awaitable[T]]) -> T: ...

    async def close(self) -> None: ...


def params(n: int, start: int = 1) -> str:
    return ", ".join(f"${i}" for i in range(start, start + n))


@dataclass(frozen=True)
class ProjectRow:
    id: str
    parent: str | None
    created_at: float
    max_sandboxes: int | None
    max_cpu_m: int | None
    max_memory_mib: int | None
    used_sandboxes: int
    used_cpu_m: int
    used_memory_mib: int
    # Last: a column added after the others (sqlite ALTER TABLE appends). No used_ counter:
    # the layer store counts storage (dsec.images.storage_quota).
    max_storage_mib: int | None = None

    @classmethod
    def of(cls, row: Row) -> ProjectRow:
        return cls(*row)

    @property
    def quota(self) -> Quota:
        cpu = None if self.max_cpu_m is None else to_cores(self.max_cpu_m)
        return Quota(self.max_sandboxes, cpu, self.max_memory_mib, self.max_storage_mib)

    @property
    def usage(self) -> Usage:
        return Usage(self.used_sandboxes, to_cores(self.used_cpu_m), self.used_memory_mib)

    def limits(self) -> tuple[int | None, int | None, int | None, int | None]:
        return self.max_sandboxes, self.max_cpu_m, self.max_memory_mib, self.max_storage_mib


def quota_limits(quota: Quota) -> tuple[int | None, int | None, int | None, int | None]:
    """A quota in stored units (millicores for CPU), in column order (``QUOTA_COLS``)."""
    cpu = None if quota.cpu_cores is None else to_millicores(quota.cpu_cores)
    return quota.sandboxes, cpu, quota.memory_mib, quota.storage_mib


QUOTA_COLS = ("max_sandboxes", "max_cpu_m", "max_memory_mib", "max_storage_mib")


def normalized(quota: Quota) -> Quota:
    """A quota as it reads back from the store (CPU rounded to millicores, as a float)."""
    s, c, m, d = quota_limits(quota)
    return Quota(s, None if c is None else to_cores(c), m, d)


_DIMS = (QuotaReason.sandboxes, QuotaReason.cpu_cores, QuotaReason.memory_mib, QuotaReason.storage_mib)
_LEDGER_DIMS = 3  # the dimensions a sandbox reserves (storage is the layer store's)


def _show(dim: int, value: int) -> str:
    return f"{to_cores(value):g} cores" if dim == 1 else f"{value} MiB" if dim >= 2 else str(value)


async def lock_chain(tx: Tx, chain: list[str], *, lock: str | None = None) -> list[ProjectRow]:
    """Lock (in id order) and return the rows of ``chain``; a missing one is an error."""
    rows = await tx.fetch(
        f"SELECT {PROJECT_COLS} FROM projects WHERE id IN ({params(len(chain))}) ORDER BY id"
        + (tx.lock_update if lock is None else lock),
        *chain,
    )
    if len(rows) != len(chain):
        found = {r[0] for r in rows}
        missing = next(p for p in chain if p not in found)
        raise InvalidRequest(f"no project {missing!r}")
    return [ProjectRow.of(r) for r in rows]


def bound(chain: list[ProjectRow]) -> tuple[int | None, ...]:
    """The tightest limit per dimension along ``chain``: what a child of its last row is under."""
    out: list[int | None] = [None] * len(_DIMS)
    for row in chain:
        for i, limit in enumerate(row.limits()):
            if limit is not None and (out[i] is None or limit < out[i]):  # type: ignore[operator]
                out[i] = limit
    return tuple(out)


def check_within(quota: Quota, chain: list[ProjectRow], project: str) -> None:
    """A sub-project's quota may not exceed what its parent chain is bounded by."""
    for i, (want, cap) in enumerate(zip(quota_limits(quota), bound(chain), strict=True)):
        if want is not None and cap is not None and want > cap:
            raise InvalidRequest(
                f"quota {_DIMS[i]} of {project!r} ({_show(i, want)}) exceeds the"
                f" {_show(i, cap)} its parent {chain[-1].id!r} is bounded by"
            )


def check_fits(chain: list[ProjectRow], need: tuple[int, int, int]) -> None:
    """Raise ``QuotaExceeded`` naming the nearest project and the quota a create would break."""
    for row in reversed(chain):
        used = (row.used_sandboxes, row.used_cpu_m, row.used_memory_mib)
        for i, limit in enumerate(row.limits()[:_LEDGER_DIMS]):
            if limit is not None and used[i] + need[i] > limit:
                raise QuotaExceeded(
                    f"project {row.id!r} is at its {_DIMS[i]} quota: {_show(i, used[i])} of"
                    f" {_show(i, limit)} in use, this sandbox needs {_show(i, need[i])}",
                    reason=_DIMS[i],
                )


def reservation(row: Row) -> Reservation:
    return Reservation(row[0], row[1], row[2], to_cores(row[3]), row[4], row[5])


async def reserve(
    tx: Tx, project: str, sandbox_id: str, node: str | None, cpu_m: int, memory_mib: int
) -> Reservation:
    chain = ancestors(project)
    now = time.time()
    # The ledger row goes in before the ancestors are locked: the lock on the root row, which
    # every create shares, is then held only for the counter update and the commit.
    inserted = await tx.fetch(
        f"INSERT INTO ledger ({_LEDGER_COLS}) VALUES ($1, $2, $3, $4, $5, $6)"
        " ON CONFLICT (sandbox_id) DO NOTHING RETURNING sandbox_id",
        sandbox_id,
        project,
        node,
        cpu_m,
        memory_mib,
        now,
    )
    if not inserted:
        # A retried request: the same reservation again changes nothing; another one is a bug.
        old = (await tx.fetch(f"SELECT {_LEDGER_COLS} FROM ledger WHERE sandbox_id = $1", sandbox_id))[0]
        if (old[1], old[3], old[4]) == (project, cpu_m, memory_mib):
            return reservation(old)
        raise Conflict(f"sandbox {sandbox_id!r} already holds a different reservation")
    check_fits(await lock_chain(tx, chain), (1, cpu_m, memory_mib))  # raising rolls the insert back
    await tx.execute(
        "UPDATE projects SET used_sandboxes = used_sandboxes + 1, used_cpu_m = used_cpu_m + $1,"
        f" used_memory_mib = used_memory_mib + $2 WHERE id IN ({params(len(chain), 3)})",
        cpu_m,
        memory_mib,
        *chain,
    )
    return Reservation(sandbox_id, project, node, to_cores(cpu_m), memory_mib, now)


async def release_many(tx: Tx, ids: Sequence[str], where: str = "", *args: Any) -> list[str]:
    """Delete these ledger rows (those still there, matching ``where``) and give their quota back."""
    released: list[str] = []
    deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for at in range(0, len(ids), _CHUNK):
        chunk = ids[at : at + _CHUNK]
        rows = await tx.fetch(
            f"DELETE FROM ledger WHERE sandbox_id IN ({params(len(chunk), len(args) + 1)}){where}"
            " RETURNING sandbox_id, project, cpu_m, memory_mib",
            *args,
            *chunk,
        )
        for sandbox_id, project, cpu_m, memory_mib in rows:
            released.append(sandbox_id)
            for p in ancestors(project):
                d = deltas[p]
                d[0], d[1], d[2] = d[0] + 1, d[1] + cpu_m, d[2] + memory_mib
    if deltas:
        affected = sorted(deltas)
        for at in range(0, len(affected), _CHUNK):  # chunks in id order keep the global lock order
            chunk = affected[at : at + _CHUNK]
            await tx.fetch(
                f"SELECT id FROM projects WHERE id IN ({params(len(chunk))}) ORDER BY id{tx.lock_update}",
                *chunk,
            )
        for p in affected:
            n, cpu_m, memory_mib = deltas[p]
            await tx.execute(
                "UPDATE projects SET used_sandboxes = used_sandboxes - $1, used_cpu_m = used_cpu_m - $2,"
                " used_memory_mib = used_memory_mib - $3 WHERE id = $4",
                n,
                cpu_m,
                memory_mib,
                p,
            )
    return released


async def bind(tx: Tx, reservation_id: str, sandbox_id: str, node: str | None) -> Reservation:
    if sandbox_id != reservation_id and await tx.fetch(
        "SELECT 1 FROM ledger WHERE sandbox_id = $1", sandbox_id
    ):
        raise Conflict(f"sandbox {sandbox_id!r} already holds a reservation")
    rows = await tx.fetch(
        "UPDATE ledger SET sandbox_id = $2, node = $3, since = $4 WHERE sandbox_id = $1"
        f" RETURNING {_LEDGER_COLS}",
        reservation_id,
        sandbox_id,
        node,
        time.time(),
    )
    if not rows:
        raise SandboxNotFound(f"reservation {reservation_id!r} no longer exists (released or expired)")
    return reservation(rows[0])


async def recount(tx: Tx) -> dict[str, tuple[Usage, Usage]]:
    """Recompute every counter from the ledger; fix and report ``{project: (stored, actual)}``."""
    rows = [
        ProjectRow.of(r)
        for r in await tx.fetch(f"SELECT {PROJECT_COLS} FROM projects ORDER BY id{tx.lock_update}")
    ]
    actual: dict[str, list[int]] = {r.id: [0, 0, 0] for r in rows}
    for project, cpu_m, memory_mib in await tx.fetch("SELECT project, cpu_m, memory_mib FROM ledger"):
        for p in ancestors(project):
            a = actual[p]
            a[0], a[1], a[2] = a[0] + 1, a[1] + cpu_m, a[2] + memory_mib
    drift: dict[str, tuple[Usage, Usage]] = {}
    for r in rows:
        n, cpu_m, memory_mib = actual[r.id]
        if (n, cpu_m, memory_mib) != (r.used_sandboxes, r.used_cpu_m, r.used_memory_mib):
            drift[r.id] = (r.usage, Usage(n, to_cores(cpu_m), memory_mib))
            await tx.execute(
                "UPDATE projects SET used_sandboxes = $1, used_cpu_m = $2, used_memory_mib = $3"
                " WHERE id = $4",
                n,
                cpu_m,
                memory_mib,
                r.id,
            )
    return drift
