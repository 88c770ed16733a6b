"""Projects and API keys (SQLite for the embedded node).

Keys are stored as SHA-256 digests: a leaked database does not leak usable keys. Projects
form a tree; quotas and sub-project management arrive with cluster mode, the shape is here.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.protocol.errors import Unauthorized

_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY, parent TEXT REFERENCES projects(id), created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    digest TEXT PRIMARY KEY, project TEXT NOT NULL REFERENCES projects(id),
    admin INTEGER NOT NULL, created_at REAL NOT NULL
);
"""

ROOT_PROJECT = "root"


@dataclass(frozen=True)
class Principal:
    project: str
    admin: bool


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class IamStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._cache: dict[str, Principal] = {}
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO projects VALUES(?, NULL, ?)", (ROOT_PROJECT, time.time()))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def issue_key(self, project: str = ROOT_PROJECT, *, admin: bool = False) -> str:
        key = "dsec_" + secrets.token_hex(24)
        with self._lock:
            self._db.execute(
                "INSERT INTO api_keys VALUES(?, ?, ?, ?)", (_digest(key), project, int(admin), time.time())
            )
        return key

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        digest = _digest(key)
        cached = self._cache.get(digest)
        if cached is not None:
            return cached
        with self._lock:
            row = self._db.execute("SELECT project, admin FROM api_keys WHERE digest=?", (digest,)).fetchone()
        if row is None:
            raise Unauthorized("unknown API key")
        principal = Principal(project=row[0], admin=bool(row[1]))
        self._cache[digest] = principal
        return principal

    def is_valid(self, key: str) -> bool:
        try:
            self.authenticate(key)
        except Unauthorized:
            return False
        return True
