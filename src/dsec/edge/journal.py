"""The edge's local journal (SQLite, WAL): every state transition is written before it acts.

After a crash or restart the journal is the truth about which sandboxes this node owns; the
runtime is then reconciled against it (re-adopt what still runs, clean up what does not).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.handle import Handle
from dsec.protocol.models import (
    DEFAULT_PROJECT,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    ContainerSpec,
    SandboxInfo,
    SandboxState,
    parse_spec,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    backend TEXT NOT NULL,
    spec TEXT NOT NULL,
    layers TEXT NOT NULL,
    user TEXT NOT NULL,
    handle TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    stop_reason TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS leases (
    project TEXT NOT NULL,
    job TEXT NOT NULL,
    expires_at REAL NOT NULL,
    grace_s REAL NOT NULL,
    PRIMARY KEY (project, job)
);
CREATE TABLE IF NOT EXISTS links (sandbox_id TEXT PRIMARY KEY, idx INTEGER NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS network_held (
    sandbox_id TEXT NOT NULL,
    permission TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, permission)
) WITHOUT ROWID;
"""
# Distinct permissions (with their cutoffs) kept per sandbox: a sandbox cycling through dates
# must not grow the journal without end; past this the newest ones are not recorded.
MAX_HELD_PERMISSIONS = 256
# Columns added after the first release: (name, declaration); added in place when missing.
_ADDED_COLUMNS = (
    ("paused_at", "REAL"),
    ("pause_reason", "TEXT"),
    ("deadline_at", "REAL"),
    ("deadline_s", "REAL"),
    ("on_deadline", "TEXT"),
)
_COLUMNS = (
    "id, state, backend, spec, layers, user, handle, created_at, last_active_at, stop_reason,"
    " paused_at, pause_reason, deadline_at, deadline_s, on_deadline"
)

LIVE_STATES = (SandboxState.creating, SandboxState.running, SandboxState.paused, SandboxState.stopping)


@dataclass
class Record:
    id: str
    state: SandboxState
    backend: str
    spec: ContainerSpec
    layers: list[str]  # digests, base first
    user: dict[str, Any]
    # As journaled: a base Handle keeping every key; the edge reads it as its backend's model.
    handle: Handle = field(default_factory=Handle)
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    stop_reason: str | None = None
    paused_at: float | None = None
    pause_reason: str | None = None
    # A deadline set through set_deadline: at ``deadline_at`` the reaper stops or pauses the
    # sandbox (``on_deadline``); ``deadline_s`` is kept so a resume can give it that long again.
    deadline_at: float | None = None
    deadline_s: float | None = None
    on_deadline: str | None = None

    def info(self, node: str) -> SandboxInfo:
        """What callers see of this sandbox on node ``node`` (reserved labels left out)."""
        return SandboxInfo(
            id=self.id,
            state=self.state,
            backend=self.backend,
            node=node,
            layers=self.layers,
            labels={k: v for k, v in self.spec.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)},
            project=self.spec.labels.get(PROJECT_LABEL, DEFAULT_PROJECT),
            init_user=self.spec.init_user,
            memory_limit_mb=self.spec.memory_limit_mb,
            cpu_cores_limit=self.spec.cpu_cores_limit,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            stop_reason=self.stop_reason,
            paused_at=self.paused_at,
            pause_reason=self.pause_reason,
            network_rules=self.spec.network_rules,
            egress_headers=self.spec.egress_headers,
            refs=self.spec.layer_refs(),
            deadline_at=self.deadline_at,
            deadline_s=self.deadline_s,
            on_deadline="pause" if self.on_deadline == "pause" else "stop" if self.on_deadline else None,
        )


@dataclass
class Lease:
    """A job's lease on this node: its sandboxes pause at ``expires_at`` and are reclaimed
    ``grace_s`` later, unless the trainer renews it."""

    project: str
    job: str
    expires_at: float
    grace_s: float


class Journal:
    def __init__(self, path: Path, handle_types: Mapping[str, type[Handle]] | None = None) -> None:
        # Each record's handle is read back as its backend's model (by backend name); a
        # backend not named here: a base Handle, which keeps every key.
        self._handle_types = dict(handle_types or {})
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        # Seconds each insert or update took (the edge's Prometheus histogram sets it).
        self.observe_write: Callable[[float], None] = _ignore
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
            for name, decl in _ADDED_COLUMNS:
                if name not in have:
                    self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def meta(self, key: str, default: str | None = None) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    def insert(self, rec: Record) -> None:
        started = time.perf_counter()
        with self._lock:
            self._db.execute(
                f"INSERT INTO sandboxes({_COLUMNS}) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec.id,
                    rec.state.value,
                    rec.backend,
                    rec.spec.model_dump_json(),
                    json.dumps(rec.layers),
                    json.dumps(rec.user),
                    json.dumps(rec.handle.dump()),
                    rec.created_at,
                    rec.last_active_at,
                    rec.stop_reason,
                    rec.paused_at,
                    rec.pause_reason,
                    rec.deadline_at,
                    rec.deadline_s,
                    rec.on_deadline,
                ),
            )
        self.observe_write(time.perf_counter() - started)

    def update(self, rec: Record) -> None:
        started = time.perf_counter()
        ended = rec.state not in LIVE_STATES and (rec.spec.egress_headers or rec.spec.egress_secrets)
        if ended:  # a secret's value outlives no sandbox, not even in its record
            rec.spec = rec.spec.model_copy(update={"egress_headers": {}, "egress_secrets": {}})
            self.set_spec(rec.id, rec.spec)
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET state=?, handle=?, last_active_at=?, stop_reason=?, paused_at=?,"
                " pause_reason=?, deadline_at=?, deadline_s=?, on_deadline=? WHERE id=?",
                (
                    rec.state.value,
                    json.dumps(rec.handle.dump()),
                    rec.last_active_at,
                    rec.stop_reason,
                    rec.paused_at,
                    rec.pause_reason,
                    rec.deadline_at,
                    rec.deadline_s,
                    rec.on_deadline,
                    rec.id,
                ),
            )
        self.observe_write(time.perf_counter() - started)

    def set_spec(self, sandbox_id: str, spec: ContainerSpec) -> None:
        """A live change of what a sandbox may do (its network rules)."""
        with self._lock:
            self._db.execute("UPDATE sandboxes SET spec=? WHERE id=?", (spec.model_dump_json(), sandbox_id))

    def touch_many(self, activity: dict[str, float]) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE sandboxes SET last_active_at=? WHERE id=?", [(t, i) for i, t in activity.items()]
            )

    def live(self) -> list[Record]:
        marks = ",".join("?" for _ in LIVE_STATES)
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN ({marks})", [s.value for s in LIVE_STATES]
            ).fetchall()
        return [self._record(r) for r in rows]

    def get(self, sandbox_id: str) -> Record | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return None if row is None else self._record(row)

    def forget_before(self, cutoff: float) -> list[str]:
        """Drop finished sandboxes older than ``cutoff`` so the journal does not grow forever;
        returns their IDs (their trajectories go with them)."""
        with self._lock:
            rows = self._db.execute(
                "DELETE FROM sandboxes WHERE state IN ('stopped', 'failed') AND last_active_at < ?"
                " RETURNING id",
                (cutoff,),
            ).fetchall()
            if rows:  # normally dropped at stop already
                self._db.execute(
                    "DELETE FROM network_held WHERE sandbox_id NOT IN (SELECT id FROM sandboxes)"
                )
        return [str(r[0]) for r in rows]

    # -- job leases -------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        with self._lock:
            rows = self._db.execute("SELECT project, job, expires_at, grace_s FROM leases").fetchall()
        return [Lease(*r) for r in rows]

    def put_lease(self, lease: Lease) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO leases VALUES(?,?,?,?)",
                (lease.project, lease.job, lease.expires_at, lease.grace_s),
            )

    def drop_lease(self, project: str, job: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM leases WHERE project=? AND job=?", (project, job))

    # -- network links (sandbox -> index in the egress pool) ----------------------------------

    def links(self) -> dict[str, int]:
        with self._lock:
            return {str(r[0]): int(r[1]) for r in self._db.execute("SELECT sandbox_id, idx FROM links")}

    def put_link(self, sandbox_id: str, index: int) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO links VALUES(?, ?)", (sandbox_id, index))

    def drop_link(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM links WHERE sandbox_id=?", (sandbox_id,))

    # -- network permissions a sandbox held (what a layer packed from it records) -------------

    def network_held(self, sandbox_id: str) -> set[str]:
        with self._lock:
            rows = self._db.execute("SELECT permission FROM network_held WHERE sandbox_id=?", (sandbox_id,))
            return {str(r[0]) for r in rows}

    def add_network_held(self, sandbox_id: str, permissions: set[str]) -> None:
        """Adds what is new; at most :data:`MAX_HELD_PERMISSIONS` per sandbox."""
        with self._lock:
            have = {
                str(r[0])
                for r in self._db.execute(
                    "SELECT permission FROM network_held WHERE sandbox_id=?", (sandbox_id,)
                )
            }
            room = max(0, MAX_HELD_PERMISSIONS - len(have))
            new = sorted(permissions - have)[:room]
            if new:
                self._db.executemany(
                    "INSERT OR IGNORE INTO network_held VALUES(?, ?)", [(sandbox_id, p) for p in new]
                )

    def drop_network_held(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM network_held WHERE sandbox_id=?", (sandbox_id,))

    def _record(self, row: tuple[Any, ...]) -> Record:
        return Record(
            id=row[0],
            state=SandboxState(row[1]),
            backend=row[2],
            spec=parse_spec(row[3], trusted=True),
            layers=json.loads(row[4]),
            user=json.loads(row[5]),
            handle=self._handle_types.get(row[2], Handle).model_validate_json(row[6]),
            created_at=row[7],
            last_active_at=row[8],
            stop_reason=row[9],
            paused_at=row[10],
            pause_reason=row[11],
            deadline_at=row[12],
            deadline_s=row[13],
            on_deadline=row[14],
        )


def _ignore(_seconds: float) -> None:
    pass
