"""Per-sandbox trajectory log and idempotent replay, kept by the edge outside the sandbox.

Every request that changes a sandbox (shell commands, execs, file writes and removals,
pause/resume, packs) is written here with its outcome, in the edge's own SQLite file, where
nothing inside the sandbox can read or forge it. A request carrying an ``idempotency_key``
runs at most once per sandbox: a repeat gets the recorded outcome (or joins the run still in
progress), so an agent loop restarted after its trainer died can replay its history without
running a non-idempotent command twice. A keyed command whose edge restarted mid-run has an
unknown outcome; a repeat says so (``InfraFailure``, reason ``interrupted``) instead of
guessing.

The log lives as long as its sandbox's journal record (``keep_finished_s`` after it stops).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec.protocol.errors import Conflict, DSecError, InfraFailure, InfraReason, error_from_wire
from dsec.protocol.models import TrajectoryEntry

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    sandbox_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    key TEXT,
    request TEXT NOT NULL,
    result TEXT,
    error TEXT,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    PRIMARY KEY (sandbox_id, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS steps_key ON steps(sandbox_id, key) WHERE key IS NOT NULL;
"""
_LIST_LIMIT = 10_000
# A page's recorded bytes (requests, outcomes, errors): a step may carry a megabyte command and
# its output, and 10,000 of them would be gigabytes read into memory for one answer. Past this
# a page ends early (never before its first step); the caller pages on from its last ``seq``.
PAGE_BYTES = 32 << 20


class TrajectoryLog:
    """The SQLite file behind the log (WAL; one writer lock, calls are short)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            # What ran while the edge went down has no outcome: say so rather than "running".
            self._db.execute("UPDATE steps SET status='interrupted' WHERE status='running'")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def begin(self, sandbox_id: str, kind: str, key: str | None, request: dict[str, Any]) -> int:
        with self._lock:
            seq = self._next.get(sandbox_id)
            if seq is None:
                row = self._db.execute(
                    "SELECT COALESCE(MAX(seq), 0) FROM steps WHERE sandbox_id=?", (sandbox_id,)
                ).fetchone()
                seq = int(row[0])
            seq += 1
            self._next[sandbox_id] = seq
            self._db.execute(
                "INSERT INTO steps(sandbox_id, seq, kind, key, request, status, started_at)"
                " VALUES(?,?,?,?,?,'running',?)",
                (sandbox_id, seq, kind, key, json.dumps(request), time.time()),
            )
        return seq

    def finish(
        self,
        sandbox_id: str,
        seq: int,
        *,
        result: dict[str, Any] | None = None,
        error: DSecError | None = None,
    ) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE steps SET status=?, result=?, error=?, finished_at=? WHERE sandbox_id=? AND seq=?",
                (
                    "failed" if error is not None else "done",
                    None if result is None else json.dumps(result),
                    None if error is None else json.dumps(error.to_wire()),
                    time.time(),
                    sandbox_id,
                    seq,
                ),
            )

    def by_key(self, sandbox_id: str, key: str) -> TrajectoryEntry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM steps WHERE sandbox_id=? AND key=?", (sandbox_id, key)
            ).fetchone()
        return None if row is None else _entry(row)

    def entries(self, sandbox_id: str, *, after: int = 0, limit: int = _LIST_LIMIT) -> list[TrajectoryEntry]:
        """Steps after ``after``, oldest first: at most ``limit`` (10,000), and fewer once they
        hold ``PAGE_BYTES`` (at least one step whatever its size)."""
        rows: list[tuple[Any, ...]] = []
        held = 0
        with self._lock:
            cursor = self._db.execute(
                "SELECT * FROM steps WHERE sandbox_id=? AND seq>? ORDER BY seq LIMIT ?",
                (sandbox_id, after, min(limit, _LIST_LIMIT)),
            )
            for row in cursor:
                held += sum(len(row[i] or "") for i in (4, 5, 6))
                if rows and held > PAGE_BYTES:
                    break
                rows.append(row)
            cursor.close()
        return [_entry(r) for r in rows]

    def forget(self, sandbox_ids: list[str]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM steps WHERE sandbox_id=?", [(i,) for i in sandbox_ids])
            for i in sandbox_ids:
                self._next.pop(i, None)


def _entry(row: tuple[Any, ...]) -> TrajectoryEntry:
    return TrajectoryEntry(
        seq=row[1],
        kind=row[2],
        key=row[3],
        request=json.loads(row[4]),
        result=None if row[5] is None else json.loads(row[5]),
        error=None if row[6] is None else json.loads(row[6]),
        status=row[7],
        started_at=row[8],
        finished_at=row[9],
    )


def _replayed(sandbox_id: str, entry: TrajectoryEntry) -> dict[str, Any]:
    """A finished keyed step's outcome, or its error raised as it was raised then."""
    if entry.status == "done":
        return entry.result or {}
    if entry.status == "failed" and entry.error is not None:
        raise error_from_wire(500, entry.error)
    raise InfraFailure(
        f"the request with idempotency key {entry.key!r} to {sandbox_id} was interrupted by an edge"
        " restart: whether it took effect is unknown",
        reason=InfraReason.interrupted,
    )


class Recorder:
    """Runs requests through the log: records them, and runs keyed ones at most once."""

    def __init__(self, log: TrajectoryLog) -> None:
        self.log = log
        # Keyed work in progress, joined by repeats: (sandbox, key) -> its task.
        self._running: dict[tuple[str, str], asyncio.Task[dict[str, Any]]] = {}
        self._kinds: dict[tuple[str, str], str] = {}  # what each running key was used for
        self._feeds: dict[tuple[str, str], _Feed] = {}

    def _same_kind(self, sandbox_id: str, key: str, kind: str, used_for: str) -> None:
        if used_for != kind:
            raise Conflict(
                f"idempotency key {key!r} of {sandbox_id} names a {used_for!r} request, not"
                f" a {kind!r} one: use one key per request"
            )

    def _start(
        self, sandbox_id: str, key: str, kind: str, work: Awaitable[dict[str, Any]]
    ) -> asyncio.Task[dict[str, Any]]:
        # A task of its own: the caller going away (a trainer killed mid-command) must not
        # cancel a command it asked to run exactly once; its outcome is recorded either way.
        task = asyncio.ensure_future(work)
        self._running[(sandbox_id, key)] = task
        self._kinds[(sandbox_id, key)] = kind

        def forget(_t: object) -> None:
            self._running.pop((sandbox_id, key), None)
            self._kinds.pop((sandbox_id, key), None)
            self._feeds.pop((sandbox_id, key), None)

        task.add_done_callback(forget)
        return task

    async def call(
        self,
        sandbox_id: str,
        kind: str,
        key: str | None,
        request: dict[str, Any],
        run: Callable[[], Awaitable[dict[str, Any]]],
        *,
        brief: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Record ``run()``'s outcome (a JSON-able dict); with a key, at most once.

        ``brief`` shortens what an unkeyed request's record keeps (a keyed one keeps all of
        it: a repeat must get exactly what the first call got)."""
        if key is None:
            return await self._record(sandbox_id, kind, None, request, run, brief)
        task = self._running.get((sandbox_id, key))
        if task is None:
            entry = self.log.by_key(sandbox_id, key)
            if entry is not None:
                self._same_kind(sandbox_id, key, kind, entry.kind)
                return _replayed(sandbox_id, entry)
            task = self._start(sandbox_id, key, kind, self._record(sandbox_id, kind, key, request, run))
        else:
            self._same_kind(sandbox_id, key, kind, self._kinds[(sandbox_id, key)])
        return await asyncio.shield(task)

    async def _record(
        self,
        sandbox_id: str,
        kind: str,
        key: str | None,
        request: dict[str, Any],
        run: Callable[[], Awaitable[dict[str, Any]]],
        brief: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        seq = self.log.begin(sandbox_id, kind, key, request)
        try:
            result = await run()
        except DSecError as exc:
            self.log.finish(sandbox_id, seq, error=exc)
            raise
        except BaseException as exc:
            wrapped = InfraFailure(
                f"{kind} did not finish: {type(exc).__name__}", reason=InfraReason.interrupted
            )
            self.log.finish(sandbox_id, seq, error=wrapped)
            raise
        self.log.finish(sandbox_id, seq, result=result if brief is None else brief(result))
        return result

    async def stream(
        self,
        sandbox_id: str,
        kind: str,
        key: str | None,
        request: dict[str, Any],
        events: Callable[[], AsyncGenerator[dict[str, Any], None]],
        summarize: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A recorded event stream (an exec). Unkeyed: passed through, closing it early stops
        the work. Keyed: it runs to its end whoever listens, every listener (the first, or a
        repeat) gets every event from the start, and a finished one replays from the record,
        whose ``result`` holds the events (``summarize`` makes the recorded result)."""
        if key is None:
            seq = self.log.begin(sandbox_id, kind, None, request)
            seen: list[dict[str, Any]] = []
            failure: DSecError | None = None
            gen = events()
            try:
                async for ev in gen:
                    seen.append(ev)
                    yield ev
            except DSecError as exc:
                failure = exc
                raise
            except Exception as exc:
                failure = InfraFailure(
                    f"{kind} failed on the edge: {type(exc).__name__}", reason=InfraReason.interrupted
                )
                raise
            finally:
                await gen.aclose()
                if failure is not None:
                    self.log.finish(sandbox_id, seq, error=failure)
                else:  # also a stream its caller closed early: what it saw is what happened
                    self.log.finish(sandbox_id, seq, result=summarize(seen))
            return
        feed = _Feed()

        async def collect() -> dict[str, Any]:
            try:
                async for ev in events():
                    feed.events.append(ev)
                    feed.changed.set()
            finally:
                feed.changed.set()
            return {**summarize(feed.events), "events": feed.events}

        task = self._running.get((sandbox_id, key))
        if task is None:
            entry = self.log.by_key(sandbox_id, key)
            if entry is not None:
                self._same_kind(sandbox_id, key, kind, entry.kind)
                for ev in _replayed(sandbox_id, entry).get("events", []):
                    yield ev
                return
            self._feeds[(sandbox_id, key)] = feed
            task = self._start(sandbox_id, key, kind, self._record(sandbox_id, kind, key, request, collect))
        else:
            self._same_kind(sandbox_id, key, kind, self._kinds[(sandbox_id, key)])
            feed = self._feeds[(sandbox_id, key)]
        async for ev in feed.follow(task):
            yield ev


class _Feed:
    """The events of a keyed stream so far, for every listener from the first one."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    async def follow(self, task: asyncio.Task[dict[str, Any]]) -> AsyncGenerator[dict[str, Any], None]:
        i = 0
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if task.done():
                await task  # the run's error, if it failed before its end
                return
            self.changed.clear()
            if i < len(self.events):
                continue
            waiter = asyncio.ensure_future(self.changed.wait())
            try:
                # Not the task itself: a listener that goes away must leave the run going.
                await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
