"""Pause and resume, idle pausing, and the job leases that pause a trainer's sandboxes.

Pause freezes the sandbox (cgroup freezer: it stops using CPU at once), then pushes its memory
out of RAM (:mod:`dsec.density.memory`: anon pages to the swap the edge manages, page cache
dropped), and journals ``paused``. Resume reads the swapped pages back ahead of time, thaws,
and journals ``running``. Any request to a paused sandbox resumes it first, so a caller never
has to know. The journaled state is re-applied on restart (freeze is idempotent), so a paused
sandbox stays paused across an edge restart, and one caught mid-pause ends up as journaled.

A job lease belongs to a (project, ``job`` label) pair and lives on every node that runs one of
the job's leased sandboxes. The trainer renews it with one call per job (the apiserver fans it
out, one request per node). When it lapses, the job's sandboxes pause (a dead trainer frees
the node's CPU and RAM, and loses nothing); ``lease_grace_s`` later they are reclaimed. A new
trainer that renews in time and touches a sandbox finds it as it was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsec.edge.journal import Lease
from dsec.edge.tally import LeaseKey, lease_key
from dsec.iam.base import in_subtree
from dsec.protocol.errors import Conflict, InfraFailure, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec, SandboxInfo, SandboxState

if TYPE_CHECKING:
    from dsec.backends.base import Backend
    from dsec.edge.journal import Journal, Record
    from dsec.edge.tally import LiveSandboxes, _Live
    from dsec.edge.trajectory import Recorder

log = logging.getLogger("dsec.edge")


@dataclass
class PauseTotals:
    """What pausing did on this node (for stats and the benchmark)."""

    pauses: int = 0
    resumes: int = 0
    returned_bytes: int = 0  # RAM given back by pauses
    prefetched_bytes: int = 0
    last_pause_s: float = 0.0
    last_resume_s: float = 0.0


class Pausing:
    """Mixed into :class:`~dsec.edge.edge.Edge`, whose state it reads."""

    if TYPE_CHECKING:
        backend: Backend
        journal: Journal
        recorder: Recorder
        _live: LiveSandboxes
        leases: dict[LeaseKey, Lease]
        pause_totals: PauseTotals

        def _info(self, rec: Record) -> SandboxInfo: ...
        def backend_of(self, rec: Record) -> Backend: ...
        def look_again(self, live: _Live) -> None: ...

    def _get_live(self, sandbox_id: str) -> _Live:
        """A sandbox that is running or paused; touching it counts as activity."""
        SandboxId.parse(sandbox_id)  # a malformed ID is the caller's error, not a missing sandbox
        live = self._live.get(sandbox_id)
        if live is None or live.record.state not in (SandboxState.running, SandboxState.paused):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist or is no longer running")
        live.touch()
        return live

    async def _use(self, sandbox_id: str) -> _Live:
        """The sandbox a request works on, resumed first if it was paused."""
        live = self._get_live(sandbox_id)
        if live.record.state is SandboxState.paused:
            info = await self.resume(sandbox_id)
            if info.state is not SandboxState.running:  # stopped while it resumed
                raise SandboxNotFound(f"sandbox {sandbox_id} was stopped")
        return live

    async def pause(self, sandbox_id: str, *, reason: str = "requested") -> SandboxInfo:
        self._get_live(sandbox_id)  # unknown: an error, not a trajectory entry

        async def run() -> dict[str, Any]:
            return (await self._pause(sandbox_id, reason)).model_dump()

        out = await self.recorder.call(sandbox_id, "pause", None, {"reason": reason}, run)
        return SandboxInfo.model_validate(out)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        live = self._get_live(sandbox_id)
        if live.record.state is not SandboxState.paused:
            return self._info(live.record)

        async def run() -> dict[str, Any]:
            return (await self._resume(sandbox_id)).model_dump()

        return SandboxInfo.model_validate(await self.recorder.call(sandbox_id, "resume", None, {}, run))

    async def _pause(self, sandbox_id: str, reason: str) -> SandboxInfo:
        live = self._get_live(sandbox_id)
        async with live.stopping:
            rec = live.record
            if rec.state is SandboxState.paused:
                return self._info(rec)
            if rec.state is not SandboxState.running:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}: it cannot pause")
            started = time.monotonic()
            backend = self.backend_of(rec)
            await backend.freeze(sandbox_id, rec.handle)
            try:
                returned = await backend.page_out(sandbox_id, rec.handle)
            except Exception as exc:
                await backend.thaw(sandbox_id, rec.handle)
                raise InfraFailure(f"pausing {sandbox_id}: {exc}", reason="runtime") from exc
            rec.state = SandboxState.paused
            self._live.mark_paused(sandbox_id, True)
            rec.paused_at = time.time()
            rec.pause_reason = reason
            self.journal.update(rec)
            totals = self.pause_totals
            totals.pauses += 1
            totals.returned_bytes += returned
            totals.last_pause_s = time.monotonic() - started
            log.info("paused %s (%s): %d MiB out", sandbox_id, reason, returned >> 20)
            return self._info(rec)

    async def _resume(self, sandbox_id: str) -> SandboxInfo:
        live = self._get_live(sandbox_id)
        async with live.stopping:
            rec = live.record
            if rec.state is not SandboxState.paused:
                return self._info(rec)
            started = time.monotonic()
            backend = self.backend_of(rec)
            prefetched = await backend.prefetch(sandbox_id, rec.handle)
            await backend.thaw(sandbox_id, rec.handle)
            rec.state = SandboxState.running
            self._live.mark_paused(sandbox_id, False)
            rec.paused_at = None
            rec.pause_reason = None
            live.touch()
            if rec.deadline_s is not None:  # only running time counts against a deadline
                rec.deadline_at = rec.last_active_at + rec.deadline_s
            self.journal.update(rec)
            self.look_again(live)  # a deadline that counts again
            totals = self.pause_totals
            totals.resumes += 1
            totals.prefetched_bytes += prefetched
            totals.last_resume_s = time.monotonic() - started
            return self._info(rec)

    async def reapply_pause_state(self, rec: Record) -> None:
        """After a restart: make the runtime match the journal (a crash may have come between)."""
        if rec.state is SandboxState.paused:
            await self.backend_of(rec).freeze(rec.id, rec.handle)
        else:
            await self.backend_of(rec).thaw(rec.id, rec.handle)

    # -- job leases -------------------------------------------------------------------------

    def take_lease(self, spec: ContainerSpec) -> None:
        """A create under a lease starts it, or extends it to cover the new sandbox."""
        key = lease_key(spec)
        if key is None or spec.lease_s is None:
            return
        expires = time.time() + spec.lease_s
        old = self.leases.get(key)
        if old is None or old.expires_at < expires or old.grace_s != spec.lease_grace_s:
            lease = Lease(key[0], key[1], max(expires, old.expires_at if old else 0), spec.lease_grace_s)
            self.leases[key] = lease
            self.journal.put_lease(lease)

    def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        """Extend the leases of ``job`` in projects at or below ``within``; returns how many
        sandboxes they cover on this node, and the new expiry."""
        expires = time.time() + lease_s
        renewed = set()
        for key, lease in list(self.leases.items()):
            if lease.job == job and in_subtree(lease.project, within):
                lease.expires_at = expires
                self.journal.put_lease(lease)
                renewed.add(key)
        covered = sum(len(self._live.by_lease.get(key, ())) for key in renewed)
        return covered, expires

    def lease_actions(self, now: float) -> tuple[list[str], list[str]]:
        """(sandboxes to pause because their lease lapsed, sandboxes to stop after the grace);
        forgets leases that no longer cover any sandbox. Looks at lapsed leases' sandboxes only."""
        to_pause: list[str] = []
        to_stop: list[str] = []
        for key in list(self.leases):
            lease = self.leases[key]
            held = self._live.by_lease.get(key)
            if not held:
                del self.leases[key]
                self.journal.drop_lease(*key)
            elif now >= lease.expires_at + lease.grace_s:
                to_stop.extend(held)
            elif now >= lease.expires_at:
                to_pause.extend(sid for sid in held if self._live[sid].record.state is SandboxState.running)
        return to_pause, to_stop
