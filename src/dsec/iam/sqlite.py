"""The embedded IAM store: one SQLite file (WAL), shared safely by several processes.

Every transaction runs whole on one dedicated thread per store, in submission order, so the
event loop never waits for SQLite (a write may wait up to ``busy_timeout_s`` for another
process's write lock) and pays one hop per transaction, not one per statement. A write
transaction starts with ``BEGIN IMMEDIATE``: it takes the file's write lock before reading
anything, so the counters it checks cannot change before it commits; that single lock is
SQLite's version of PostgreSQL's row locks on the ancestor chain. A transaction, once on the
thread, ends in COMMIT or ROLLBACK there whatever its caller does: a caller cancelled
meanwhile sees the cancellation, and the store all of the transaction or none of it.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

from dsec.iam.base import ROOT_PROJECT
from dsec.iam.ledger import Row, Tx
from dsec.iam.sql import SqlIamStore

T = TypeVar("T")

SCHEMA_VERSION = 4
# Version 1 is the schema before quotas and revocation (projects, api_keys with four columns);
# files from then are upgraded in place so existing admin keys keep working. Version 3 adds the
# cluster membership table (iam/registry.py); version 4 the storage quota column.
_TABLES = """
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY, parent TEXT REFERENCES projects(id), created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    digest TEXT PRIMARY KEY, project TEXT NOT NULL REFERENCES projects(id),
    admin INTEGER NOT NULL, created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    sandbox_id TEXT PRIMARY KEY, project TEXT NOT NULL, node TEXT,
    cpu_m INTEGER NOT NULL, memory_mib INTEGER NOT NULL, since REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_node ON ledger(node, since);
CREATE INDEX IF NOT EXISTS ledger_project ON ledger(project);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY, url TEXT NOT NULL, epoch INTEGER NOT NULL,
    registered_at REAL NOT NULL, last_seen REAL NOT NULL
);
"""
_ADDED_COLUMNS = {
    "projects": [
        "max_sandboxes INTEGER",
        "max_cpu_m INTEGER",
        "max_memory_mib INTEGER",
        "used_sandboxes INTEGER NOT NULL DEFAULT 0",
        "used_cpu_m INTEGER NOT NULL DEFAULT 0",
        "used_memory_mib INTEGER NOT NULL DEFAULT 0",
        "max_storage_mib INTEGER",
    ],
    "api_keys": ["key_id TEXT", "name TEXT NOT NULL DEFAULT ''", "revoked_at REAL"],
}
_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS api_keys_key_id ON api_keys(key_id);
CREATE INDEX IF NOT EXISTS api_keys_project ON api_keys(project);
CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent);
"""


def connect(path: Path, *, busy_timeout_s: float = 30.0) -> sqlite3.Connection:
    """Open (creating or upgrading) an IAM database; autocommit mode, transactions are explicit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a process crash without fsync
    db.execute("PRAGMA foreign_keys=ON")
    # Several processes may open a new file at once: set up under the write lock, re-checking.
    db.execute("BEGIN IMMEDIATE")
    try:
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            for stmt in _TABLES.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            for table, columns in _ADDED_COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                for column in columns:
                    if column.split()[0] not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
            # A key's public id is its digest's prefix (base.key_id_of), so old keys get theirs here.
            db.execute("UPDATE api_keys SET key_id = substr(digest, 1, 16) WHERE key_id IS NULL")
            for stmt in _INDEXES.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute(
            "INSERT OR IGNORE INTO projects (id, parent, created_at) VALUES (?, NULL, ?)",
            (ROOT_PROJECT, time.time()),
        )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        db.close()
        raise
    return db


@lru_cache(maxsize=512)
def _qmark(sql: str) -> str:
    # The shared SQL numbers its parameters PostgreSQL-style; SQLite spells the same ``?1``.
    return re.sub(r"\$(\d+)", r"?\1", sql)


class _SqliteTx:
    """The statements of one transaction, run at once on the store's thread: its body is
    driven there whole (:func:`_drive`), so a transaction is one hop off the event loop."""

    lock_update = ""
    lock_delete = ""
    lock_share = ""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return self._db.execute(_qmark(sql), args).fetchall()

    async def execute(self, sql: str, *args: Any) -> None:
        self._db.execute(_qmark(sql), args)


def _drive(body: Awaitable[T]) -> T:
    """Run a transaction's body to its end on this thread. Its awaits are its statements,
    which never suspend here; one that awaits anything else is a bug, refused."""
    steps = body.__await__()
    try:
        steps.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    steps.close()
    raise RuntimeError("an IAM transaction awaited something other than its statements")


class _SqliteDriver:
    def __init__(self, path: Path, busy_timeout_s: float) -> None:
        self._db = connect(path, busy_timeout_s=busy_timeout_s)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-iam-sqlite")
        self._lock = asyncio.Lock()  # one connection: one transaction at a time in this process

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, self._db)

    async def _run(self, begin: str, fn: Callable[[Tx], Awaitable[T]]) -> T:
        def whole(db: sqlite3.Connection) -> T:
            db.execute(begin)
            try:
                result = _drive(fn(_SqliteTx(db)))
                db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            return result

        async with self._lock:
            # One hop for the whole transaction: a hop to a thread and back costs more CPU than
            # the statements of a reservation (docs/decisions.md). Shielded: a transaction
            # that started runs to its COMMIT or ROLLBACK, whatever its caller does meanwhile.
            return await asyncio.shield(self.call(whole))

    def _rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    async def write(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        return await self._run("BEGIN IMMEDIATE", fn)

    async def read(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        # A deferred transaction: a consistent snapshot that never waits for writers (WAL).
        return await self._run("BEGIN", fn)

    async def close(self) -> None:
        async with self._lock:
            await self.call(lambda db: db.close())
        self._thread.shutdown(wait=True)


class SqliteIamStore(SqlIamStore):
    """The embedded store: ``SqliteIamStore(path)``; close with ``await store.close()``."""

    def __init__(self, path: Path, *, cache_ttl_s: float = 5.0, busy_timeout_s: float = 30.0) -> None:
        self.path = path
        super().__init__(_SqliteDriver(path, busy_timeout_s), cache_ttl_s=cache_ttl_s)
