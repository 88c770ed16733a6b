"""The cluster IAM store: PostgreSQL through an asyncpg pool, shared by every apiserver.

Write transactions run at READ COMMITTED and lock the project rows they change with
``SELECT ... FOR NO KEY UPDATE`` in id order (see :mod:`dsec.iam.ledger`): after waiting for a
lock, PostgreSQL hands back the row as the previous holder committed it, so the quota check
always sees the latest counters. ``NO KEY UPDATE`` rather than ``UPDATE`` because we never
change a project's key, and the weaker lock lets inserts that reference the row (a new key, a
new sub-project) proceed. A deadlock or serialization failure PostgreSQL reports anyway is
retried a few times; a database that cannot be reached is an ``InfraFailure``.

All tables live in one schema (``dsec_iam`` by default) set as the pool's ``search_path``, so
DSec can share a database with other users, and tests run side by side in one server.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg  # type: ignore[import-untyped]

from dsec.iam.base import ROOT_PROJECT
from dsec.iam.ledger import Row, Tx
from dsec.iam.sql import SqlIamStore
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

T = TypeVar("T")

_RETRIES = 5
# Held while creating the schema: apiservers starting together would otherwise race on the
# catalog (CREATE ... IF NOT EXISTS is not atomic across sessions). Any constant works.
_SCHEMA_LOCK = 0x64736563_69616D  # "dsec" "iam"

# COLLATE "C": ids compare byte-wise, which the subtree range queries rely on (base.subtree_range).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    id TEXT COLLATE "C" PRIMARY KEY,
    parent TEXT COLLATE "C" REFERENCES projects(id),
    created_at DOUBLE PRECISION NOT NULL,
    max_sandboxes BIGINT, max_cpu_m BIGINT, max_memory_mib BIGINT,
    used_sandboxes BIGINT NOT NULL DEFAULT 0,
    used_cpu_m BIGINT NOT NULL DEFAULT 0,
    used_memory_mib BIGINT NOT NULL DEFAULT 0,
    max_storage_mib BIGINT
);
-- Added after the first release: schemas created before it get the column here.
ALTER TABLE projects ADD COLUMN IF NOT EXISTS max_storage_mib BIGINT;
CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent);
CREATE TABLE IF NOT EXISTS api_keys (
    digest TEXT PRIMARY KEY,
    key_id TEXT NOT NULL UNIQUE,
    project TEXT COLLATE "C" NOT NULL REFERENCES projects(id),
    admin INTEGER NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    created_at DOUBLE PRECISION NOT NULL,
    revoked_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS api_keys_project ON api_keys(project);
CREATE TABLE IF NOT EXISTS ledger (
    sandbox_id TEXT PRIMARY KEY,
    project TEXT COLLATE "C" NOT NULL,
    node TEXT,
    cpu_m BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    since DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_node ON ledger(node, since);
CREATE INDEX IF NOT EXISTS ledger_project ON ledger(project);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    registered_at DOUBLE PRECISION NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL
);
"""

_UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError)


class _PgTx:
    lock_update = " FOR NO KEY UPDATE"
    lock_delete = " FOR UPDATE"
    lock_share = " FOR KEY SHARE"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        rows: list[Row] = await self._conn.fetch(sql, *args)
        return rows

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, *args)


class _PgDriver:
    def __init__(self, pool: Any) -> None:
        self._pool = pool

    async def write(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        for attempt in range(_RETRIES):
            try:
                async with self._pool.acquire() as conn, conn.transaction():
                    return await fn(_PgTx(conn))
            except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError):
                if attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(random.uniform(0.001, 0.01) * 2**attempt)
            except _UNREACHABLE as exc:
                raise _infra(exc) from exc
        raise AssertionError("unreachable")

    async def read(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        try:
            async with self._pool.acquire() as conn:
                return await fn(_PgTx(conn))
        except _UNREACHABLE as exc:
            raise _infra(exc) from exc

    async def close(self) -> None:
        await self._pool.close()


def _infra(exc: BaseException) -> InfraFailure:
    return InfraFailure(
        f"IAM database unreachable: {type(exc).__name__}: {exc}", reason=InfraReason.iam_store
    )


class PostgresIamStore(SqlIamStore):
    """The cluster store. Open with ``await PostgresIamStore.connect(dsn)``; ``await close()``."""

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        schema: str = "dsec_iam",
        min_size: int = 1,
        max_size: int = 10,
        cache_ttl_s: float = 5.0,
    ) -> PostgresIamStore:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
            raise InvalidRequest(f"invalid PostgreSQL schema name {schema!r}")
        try:
            await _create_schema(dsn, schema)
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, server_settings={"search_path": schema}
            )
        except _UNREACHABLE as exc:
            raise _infra(exc) from exc
        return cls(_PgDriver(pool), cache_ttl_s=cache_ttl_s)


async def _create_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
            await conn.execute(_SCHEMA)
            await conn.execute(
                "INSERT INTO projects (id, parent, created_at) VALUES ($1, NULL, extract(epoch FROM now()))"
                " ON CONFLICT (id) DO NOTHING",
                ROOT_PROJECT,
            )
    finally:
        await conn.close()
