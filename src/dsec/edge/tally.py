"""The edge's live sandboxes by ID, counted as they come and go.

The placement watcher asks every edge for its load each second (:meth:`Edge.stats`): counts per
backend, project and label, and how many are paused. Counting them from scratch each time walked
every sandbox (py-spy at 8,000 held: ~8% of the edge's CPU, taken from creates). Sandboxes
enter and leave through :meth:`LiveSandboxes.admit` and :meth:`LiveSandboxes.release` only, and
pausing says so through :meth:`LiveSandboxes.mark_paused`; reads are a plain dict's. The same
goes for what the reaper asks each pass: the sandboxes under each job lease (``by_lease``) and
those used since the journal last heard (``touched``, filled by ``_Live.touch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsec.backends.base import User
from dsec.edge.journal import Record
from dsec.executor.held import ProcessTable
from dsec.executor.session import Session
from dsec.protocol.errors import SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    DEFAULT_PROJECT,
    JOB_LABEL,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    ContainerSpec,
    SandboxState,
)

LeaseKey = tuple[str, str]  # (project, job)


def lease_key(spec: ContainerSpec) -> LeaseKey | None:
    if spec.lease_s is None:
        return None
    return spec.labels.get(PROJECT_LABEL, DEFAULT_PROJECT), spec.labels[JOB_LABEL]


@dataclass
class _Live:
    """A sandbox the edge holds: its record and what runs in it now."""

    record: Record
    user: User
    sessions: dict[str, Session] = field(default_factory=dict)
    processes: ProcessTable = field(default_factory=ProcessTable)  # started by start_process
    stopping: asyncio.Lock = field(default_factory=asyncio.Lock)  # one transition at a time
    busy: int = 0  # commands running now: a sandbox running a command is not idle
    # Where activity is noted for the journal: LiveSandboxes.touched once admitted.
    touched: set[str] = field(default_factory=set)
    # How pause and stop exclude work (edge/pausing.py, "gate"): while a pause is under way no
    # new command starts (``closed``); once it decided to freeze, no process is started either
    # (``freezing``: a process that joins a frozen cgroup freezes before it runs); a freeze or
    # a destroy waits for the starts under way (``entering``); a stop cuts a pause's wait short.
    closed: bool = False
    freezing: bool = False
    entering: int = 0
    stop_wanted: bool = False
    # Made by the first waiter only: thousands of sandboxes are held, few are ever waited on.
    _changed: asyncio.Event | None = None

    def touch(self) -> None:
        """Used now: idleness counts from here (the reaper's next pass journals it)."""
        self.record.last_active_at = time.time()
        self.touched.add(self.record.id)

    def notify(self) -> None:
        """Something a waiter of :meth:`changed` may wait for happened (work ended, a pause or
        a start finished, a stop began)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def changed(self) -> None:
        """Until the next :meth:`notify`."""
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.touch()
            self.notify()

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """A process being started in the sandbox (see :meth:`Pausing.starting`)."""
        self.entering += 1
        try:
            yield
        finally:
            self.entering -= 1
            self.notify()


class LiveSandboxes(dict[str, _Live]):
    def __init__(self) -> None:
        super().__init__()
        self.by_backend: Counter[str] = Counter()
        self.by_project: Counter[str] = Counter()
        self.by_label: Counter[str] = Counter()  # "key=value", reserved keys left out
        self.paused: set[str] = set()
        self.by_lease: dict[LeaseKey, set[str]] = {}
        self.touched: set[str] = set()  # last_active_at changed since the journal was told

    def admit(self, live: _Live) -> None:
        rec = live.record
        self.release(rec.id)
        self[rec.id] = live
        live.touched = self.touched
        self.touched.add(rec.id)
        self._count(live, 1)
        self.mark_paused(rec.id, rec.state is SandboxState.paused)
        key = lease_key(rec.spec)
        if key is not None:
            self.by_lease.setdefault(key, set()).add(rec.id)

    def touch(self, sandbox_id: str) -> _Live:
        """A sandbox that is running or paused; touching it counts as activity."""
        SandboxId.parse(sandbox_id)  # a malformed ID is the caller's error, not a missing sandbox
        live = self.get(sandbox_id)
        if live is None or live.record.state not in (SandboxState.running, SandboxState.paused):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist or is no longer running")
        live.touch()
        return live

    def release(self, sandbox_id: str) -> None:
        live = self.pop(sandbox_id, None)
        if live is not None:
            self._count(live, -1)
            self.paused.discard(sandbox_id)
            self.touched.discard(sandbox_id)
            key = lease_key(live.record.spec)
            if key is not None and key in self.by_lease:
                self.by_lease[key].discard(sandbox_id)
                if not self.by_lease[key]:
                    del self.by_lease[key]

    def mark_paused(self, sandbox_id: str, paused: bool) -> None:
        if paused:
            self.paused.add(sandbox_id)
        else:
            self.paused.discard(sandbox_id)

    def _count(self, live: _Live, sign: int) -> None:
        rec = live.record
        labels = rec.spec.labels
        keys = [f"{k}={v}" for k, v in labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)]
        for counter, key in (
            (self.by_backend, rec.backend),
            (self.by_project, labels.get(PROJECT_LABEL, DEFAULT_PROJECT)),
            *((self.by_label, k) for k in keys),
        ):
            counter[key] += sign
            if counter[key] <= 0:
                del counter[key]
