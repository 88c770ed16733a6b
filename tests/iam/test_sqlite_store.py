"""The IAM conformance suite against SQLite, plus what only the SQLite store promises."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from dsec.iam import IamStore, Quota, open_iam_store
from dsec.iam.sqlite import SqliteIamStore
from dsec.protocol.errors import InvalidRequest

from .conformance import IamConformance


class TestSqliteConformance(IamConformance):
    @pytest.fixture
    async def iam(self, tmp_path: Path) -> AsyncIterator[IamStore]:
        store = SqliteIamStore(tmp_path / "iam.sqlite")
        yield store
        await store.close()

    @pytest.fixture
    async def reopen(self, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[IamStore]]]:
        opened: list[IamStore] = []

        async def again(cache_ttl_s: float = 5.0) -> IamStore:
            opened.append(SqliteIamStore(tmp_path / "iam.sqlite", cache_ttl_s=cache_ttl_s))
            return opened[-1]

        yield again
        for store in opened:
            await store.close()

    @pytest.fixture
    def racer_argv(self, tmp_path: Path) -> list[str]:
        return ["sqlite", str(tmp_path / "iam.sqlite")]


async def test_the_file_holds_key_digests_not_keys(tmp_path: Path) -> None:
    store = SqliteIamStore(tmp_path / "iam.sqlite")
    key = await store.issue_key()
    await store.close()
    for f in tmp_path.iterdir():
        assert key.encode() not in f.read_bytes()
        assert key[5:].encode() not in f.read_bytes()


async def test_a_file_of_the_old_schema_is_upgraded_and_its_keys_keep_working(tmp_path: Path) -> None:
    path = tmp_path / "iam.sqlite"
    digest = hashlib.sha256(b"dsec_old").hexdigest()
    old = sqlite3.connect(path)  # exactly what the pre-quota IamStore created
    old.executescript(
        f"""
        CREATE TABLE projects (id TEXT PRIMARY KEY, parent TEXT REFERENCES projects(id),
            created_at REAL NOT NULL);
        CREATE TABLE api_keys (digest TEXT PRIMARY KEY, project TEXT NOT NULL REFERENCES projects(id),
            admin INTEGER NOT NULL, created_at REAL NOT NULL);
        INSERT INTO projects VALUES ('root', NULL, 0);
        INSERT INTO api_keys VALUES ('{digest}', 'root', 1, 0);
        """
    )
    old.close()
    store = SqliteIamStore(path)
    try:
        principal = await store.authenticate("dsec_old")
        assert principal.project == "root" and principal.admin and principal.key_id == digest[:16]
        assert await store.revoke_key(digest[:16])
        assert not await store.is_valid("dsec_old")
    finally:
        await store.close()


async def test_a_file_of_schema_3_gains_the_storage_quota_and_keeps_its_quotas(tmp_path: Path) -> None:
    path = tmp_path / "iam.sqlite"
    store = SqliteIamStore(path)
    await store.create_project("root", "p", Quota(sandboxes=3, memory_mib=512))
    await store.close()
    old = sqlite3.connect(path)  # back to version 3: the storage column did not exist yet
    old.execute("ALTER TABLE projects DROP COLUMN max_storage_mib")
    old.execute("PRAGMA user_version=3")
    old.close()
    store = SqliteIamStore(path)
    try:
        assert (await store.get_project("root/p")).quota == Quota(sandboxes=3, memory_mib=512)
        await store.set_quota("root/p", Quota(sandboxes=3, memory_mib=512, storage_mib=7))
        assert (await store.get_project("root/p")).quota.storage_mib == 7
    finally:
        await store.close()


async def test_open_iam_store_picks_the_store_from_the_url(tmp_path: Path) -> None:
    for url in (str(tmp_path / "a.sqlite"), f"sqlite://{tmp_path / 'b.sqlite'}"):
        store = await open_iam_store(url)
        assert isinstance(store, SqliteIamStore)
        await store.close()
    with pytest.raises(InvalidRequest):
        await open_iam_store("mysql://nope")
