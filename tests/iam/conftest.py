"""The throwaway PostgreSQL server for the IAM tests: one per session, started on first use.

Missing server binaries fail the PostgreSQL tests with a clear message (they are never
skipped); the server and its directory are removed at the end, also after failures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .pgserver import PgServer, running_pg_server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    with running_pg_server() as server:
        yield server
