"""The throwaway PostgreSQL server for the IAM tests: one per session, started on first use.

Missing server binaries fail the PostgreSQL tests with a clear message (they are never
skipped); the server and its directory are removed at the end, also after failures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .pgserver import PgServer, PgSetupError


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    try:
        server = PgServer()
    except PgSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.start()
    except PgSetupError as exc:
        server.stop()
        pytest.fail(f"could not start the test PostgreSQL server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
