"""IAM: nested projects with quotas, API keys, and the usage ledger that enforces the quotas.

The seam is :class:`IamStore` (async); ``SqliteIamStore`` serves the embedded node and
``PostgresIamStore`` a cluster; :func:`open_iam_store` picks one from a URL.
"""

from __future__ import annotations

from pathlib import Path

from dsec.iam.base import (
    ROOT_PROJECT,
    IamStore,
    KeyInfo,
    Principal,
    ProjectInfo,
    Quota,
    Reservation,
    Usage,
    can_access,
)
from dsec.iam.registry import NodeRecord
from dsec.iam.sqlite import SqliteIamStore
from dsec.protocol.errors import InvalidRequest


async def open_iam_store(url: str, *, cache_ttl_s: float = 5.0) -> IamStore:
    """``postgresql://...`` (or ``postgres://``) opens the cluster store; a path or
    ``sqlite:///path`` the embedded one."""
    if url.startswith(("postgresql://", "postgres://")):
        from dsec.iam.postgres import PostgresIamStore  # asyncpg only when a cluster uses it

        return await PostgresIamStore.connect(url, cache_ttl_s=cache_ttl_s)
    if url.startswith("sqlite://"):
        url = url.removeprefix("sqlite://")
    elif "://" in url:
        raise InvalidRequest(f"unsupported IAM store URL {url!r}: use postgresql://... or a file path")
    return SqliteIamStore(Path(url), cache_ttl_s=cache_ttl_s)


__all__ = [
    "ROOT_PROJECT",
    "IamStore",
    "KeyInfo",
    "NodeRecord",
    "Principal",
    "ProjectInfo",
    "Quota",
    "Reservation",
    "SqliteIamStore",
    "Usage",
    "can_access",
    "open_iam_store",
]
