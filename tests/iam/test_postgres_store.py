"""The IAM conformance suite against a real PostgreSQL server (started by tests/iam/conftest.py).

Every test gets its own schema in the session's server, so tests never see each other's rows.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg  # type: ignore[import-untyped]
import pytest

from dsec.iam import IamStore, Quota, open_iam_store
from dsec.iam.postgres import PostgresIamStore
from dsec.protocol.errors import InfraFailure, InvalidRequest

from .conformance import IamConformance
from .pgserver import PgServer

_schemas = itertools.count()


@pytest.fixture
def schema() -> str:
    return f"t{next(_schemas)}"


class TestPostgresConformance(IamConformance):
    @pytest.fixture
    async def iam(self, pg_server: PgServer, schema: str) -> AsyncIterator[IamStore]:
        store = await PostgresIamStore.connect(pg_server.dsn, schema=schema, max_size=20)
        yield store
        await store.close()

    @pytest.fixture
    async def reopen(
        self, pg_server: PgServer, schema: str
    ) -> AsyncIterator[Callable[..., Awaitable[IamStore]]]:
        opened: list[IamStore] = []

        async def again(cache_ttl_s: float = 5.0) -> IamStore:
            store = await PostgresIamStore.connect(
                pg_server.dsn, schema=schema, max_size=10, cache_ttl_s=cache_ttl_s
            )
            opened.append(store)
            return store

        yield again
        for store in opened:
            await store.close()

    @pytest.fixture
    def racer_argv(self, pg_server: PgServer, schema: str) -> list[str]:
        return ["postgres", pg_server.dsn, schema]


async def test_the_database_holds_key_digests_not_keys(pg_server: PgServer, schema: str) -> None:
    store = await PostgresIamStore.connect(pg_server.dsn, schema=schema)
    key = await store.issue_key()
    await store.close()
    conn = await asyncpg.connect(pg_server.dsn)
    try:
        rows = await conn.fetch(f"SELECT * FROM {schema}.api_keys")
    finally:
        await conn.close()
    assert len(rows) == 1 and key[5:] not in repr([dict(r) for r in rows])


async def test_a_schema_from_before_the_storage_quota_gains_its_column(
    pg_server: PgServer, schema: str
) -> None:
    store = await PostgresIamStore.connect(pg_server.dsn, schema=schema)
    await store.create_project("root", "p", Quota(sandboxes=3))
    await store.close()
    conn = await asyncpg.connect(pg_server.dsn)
    try:  # the table as the release before the storage quota made it
        await conn.execute(f"ALTER TABLE {schema}.projects DROP COLUMN max_storage_mib")
    finally:
        await conn.close()
    store = await PostgresIamStore.connect(pg_server.dsn, schema=schema)
    try:
        assert (await store.get_project("root/p")).quota == Quota(sandboxes=3)
        await store.set_quota("root/p", Quota(sandboxes=3, storage_mib=7))
        assert (await store.get_project("root/p")).quota.storage_mib == 7
    finally:
        await store.close()


async def test_open_iam_store_opens_postgres_urls(pg_server: PgServer) -> None:
    store = await open_iam_store(pg_server.dsn)  # the default schema, dsec_iam
    try:
        assert isinstance(store, PostgresIamStore)
        assert (await store.get_project("root")).parent is None
    finally:
        await store.close()


async def test_an_unreachable_server_is_an_infra_failure(pg_server: PgServer) -> None:
    with pytest.raises(InfraFailure) as info:
        await PostgresIamStore.connect(f"postgresql://dsec@/postgres?host={pg_server.root}/nowhere")
    assert info.value.reason == "iam_store"
    with pytest.raises(InvalidRequest):
        await PostgresIamStore.connect(pg_server.dsn, schema="Robert'); DROP")
