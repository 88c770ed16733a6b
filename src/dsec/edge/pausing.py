"""Pause and resume, idle pausing, and the job leases that pause a trainer's sandboxes.

Pause freezes the sandbox (cgroup freezer: it stops using CPU at once), then pushes its memory
out of RAM (:mod:`dsec.density.memory`: anon pages to the swap the edge manages, page cache
dropped), and journals ``paused``. Resume reads the swapped pages back ahead of time, thaws,
and journals ``running``. Any request to a paused sandbox resumes it first, so a caller never
has to know. The journaled state is re-applied on restart (freeze is idempotent), so a paused
sandbox stays paused across an edge restart, and one caught mid-pause ends up as journaled.

Pause and work exclude each other (the gate, state on :class:`~dsec.edge.tally._Live`): a
command counts as work (:meth:`Pausing.working`) from before it starts until it answered, and
every process the edge starts in the sandbox is a start (:meth:`Pausing.starting`). A pause
closes the gate to new work, waits for the work under way to end (``pause_drain_s`` for a
caller's pause, not at all for the reaper's), then waits for the starts under way and freezes;
work that came meanwhile waits for the pause and resumes the sandbox. A start never meets a
frozen cgroup (its process would freeze before it ran: "the sandbox is paused", a 500, before
the gate), and a stop destroys nothing a start is joining (dsec-enter: "joined cgroups differ").
Work still running when the freeze comes resumes with the sandbox; it does not keep a paused
sandbox from its idle TTL.

A job lease belongs to a (project, ``job`` label) pair and lives on every node that runs one of
the job's leased sandboxes. The trainer renews it with one call per job (the apiserver fans it
out, one request per node). When it lapses, the job's sandboxes pause (a dead trainer frees
the node's CPU and RAM, and loses nothing); ``lease_grace_s`` later they are reclaimed. A new
trainer that renews in time and touches a sandbox finds it as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from dsec.backends.base import Backend
from dsec.edge.config import EdgeConfig
from dsec.edge.journal import Journal, Lease, Record
from dsec.edge.tally import LeaseKey, LiveSandboxes, _Live, lease_key
from dsec.edge.trajectory import Recorder
from dsec.edge.wakeups import Wakeups
from dsec.iam.base import in_subtree
from dsec.observe.edge_metrics import EdgeMetrics
from dsec.protocol.errors import Conflict, InfraFailure, InfraReason, SandboxNotFound
from dsec.protocol.models import ContainerSpec, SandboxInfo, SandboxState

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
    """The edge's gate between work, pauses and stops, pause and resume, and job leases."""

    def __init__(
        self,
        config: EdgeConfig,
        journal: Journal,
        recorder: Recorder,
        live: LiveSandboxes,
        wakeups: Wakeups,
        prom: EdgeMetrics,
        backend_of: Callable[[Record], Backend],
        totals: PauseTotals,
    ) -> None:
        self.config = config
        self.journal = journal
        self.recorder = recorder
        self.live = live
        self.wakeups = wakeups
        self.prom = prom
        self.backend_of = backend_of
        self.totals = totals
        self.leases: dict[LeaseKey, Lease] = {(x.project, x.job): x for x in journal.leases()}

    def _info(self, rec: Record) -> SandboxInfo:
        return rec.info(self.config.node)

    async def use(self, sandbox_id: str) -> _Live:
        """The sandbox a request works on, resumed first if it was paused."""
        live = self.live.touch(sandbox_id)
        if live.record.state is SandboxState.paused:
            info = await self.resume(sandbox_id)
            if info.state is not SandboxState.running:  # stopped while it resumed
                raise SandboxNotFound(f"sandbox {sandbox_id} was stopped")
        return live

    async def _open(self, sandbox_id: str, *, start: bool) -> _Live:
        """The sandbox running, with no pause under way that would keep out new work (or, for
        ``start``, a process start); waits for such a pause and resumes after it. A stop makes
        it :class:`SandboxNotFound` (``_get_live``). Returns without awaiting after its last
        check: the caller counts itself in before anything else runs."""
        while True:
            live = self.live.touch(sandbox_id)
            shut = live.freezing if start else live.closed
            if live.record.state is SandboxState.running and not shut:
                return live
            if live.record.state is SandboxState.paused and not shut:
                await self.use(sandbox_id)
            else:
                await live.changed()

    @contextlib.asynccontextmanager
    async def working(self, sandbox_id: str) -> AsyncIterator[_Live]:
        """A command of a caller, from its start until its answer: a pause lets it end first
        (for ``pause_drain_s``); one that comes during a pause waits for it, then resumes."""
        live = await self._open(sandbox_id, start=False)
        with live.working():
            yield live

    @contextlib.asynccontextmanager
    async def starting(self, sandbox_id: str) -> AsyncIterator[_Live]:
        """Around starting a process in the sandbox: never into a frozen cgroup, and a stop
        waits for it before it destroys the sandbox (the process then dies with it)."""
        live = await self._open(sandbox_id, start=True)
        with live.starting():
            yield live

    @contextlib.asynccontextmanager
    async def held_still(self, sandbox_id: str) -> AsyncIterator[_Live]:
        """Around the edge's own reading of a running sandbox's writable layer (pack, changes),
        for which the backend freezes it: no process starts meanwhile (it would meet a frozen
        cgroup), and no pause, resume or stop runs (a pause's freeze and the reading's thaw
        would undo each other). A paused sandbox is resumed first, as for any request."""
        while True:
            live = await self._open(sandbox_id, start=False)
            async with live.stopping:
                if live.record.state is not SandboxState.running:
                    continue  # paused (or pausing) between the look and the lock: round again
                live.freezing = True
                try:
                    await _until(live, functools.partial(_quiet, live), None)
                    if live.stop_wanted:
                        raise SandboxNotFound(f"sandbox {sandbox_id} was stopped")
                    with live.working():
                        yield live
                finally:
                    live.freezing = False
                    live.notify()
                return

    async def pause(
        self, sandbox_id: str, *, reason: str = "requested", drain_s: float | None = None
    ) -> SandboxInfo:
        """``drain_s``: how long commands under way may take to end before the freeze (default
        ``pause_drain_s``); those still running then resume with the sandbox."""
        self.live.touch(sandbox_id)  # unknown: an error, not a trajectory entry
        wait = self.config.pause_drain_s if drain_s is None else drain_s

        async def run() -> dict[str, Any]:
            return (await self._pause(sandbox_id, reason, wait)).model_dump()

        out = await self.recorder.call(sandbox_id, "pause", None, {"reason": reason}, run)
        return SandboxInfo.model_validate(out)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        live = self.live.touch(sandbox_id)
        if live.record.state is not SandboxState.paused:
            return self._info(live.record)

        async def run() -> dict[str, Any]:
            return (await self._resume(sandbox_id)).model_dump()

        return SandboxInfo.model_validate(await self.recorder.call(sandbox_id, "resume", None, {}, run))

    async def _pause(self, sandbox_id: str, reason: str, drain_s: float) -> SandboxInfo:
        live = self.live.touch(sandbox_id)
        async with live.stopping:
            rec = live.record
            if rec.state is SandboxState.paused:
                return self._info(rec)
            if rec.state is not SandboxState.running:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}: it cannot pause")
            started = time.monotonic()
            live.closed = True
            try:
                await _until(live, lambda: not live.busy or live.stop_wanted, drain_s)
                live.freezing = True
                await _until(live, lambda: not live.entering or live.stop_wanted, None)
                if live.stop_wanted:
                    raise SandboxNotFound(f"sandbox {sandbox_id} was stopped while it paused")
                return await self._freeze(live, reason, started)
            finally:
                live.closed = live.freezing = False
                live.notify()

    async def _freeze(self, live: _Live, reason: str, started: float) -> SandboxInfo:
        rec = live.record
        sandbox_id = rec.id
        backend = self.backend_of(rec)
        await backend.freeze(sandbox_id, rec.handle)
        try:
            returned = await backend.page_out(sandbox_id, rec.handle)
        except Exception as exc:
            await backend.thaw(sandbox_id, rec.handle)
            raise InfraFailure(f"pausing {sandbox_id}: {exc}", reason=InfraReason.runtime) from exc
        rec.state = SandboxState.paused
        self.live.mark_paused(sandbox_id, True)
        rec.paused_at = time.time()
        rec.pause_reason = reason
        self.journal.update(rec)
        self.wakeups.look_again(live)  # its idle TTL counts from now, whatever still runs in it
        totals = self.totals
        totals.pauses += 1
        totals.returned_bytes += returned
        totals.last_pause_s = time.monotonic() - started
        self.prom.paused("pause", totals.last_pause_s, returned)
        log.info("paused %s (%s): %d MiB out", sandbox_id, reason, returned >> 20)
        return self._info(rec)

    async def _resume(self, sandbox_id: str) -> SandboxInfo:
        live = self.live.touch(sandbox_id)
        async with live.stopping:
            rec = live.record
            if rec.state is not SandboxState.paused:
                return self._info(rec)
            started = time.monotonic()
            backend = self.backend_of(rec)
            prefetched = await backend.prefetch(sandbox_id, rec.handle)
            await backend.thaw(sandbox_id, rec.handle)
            rec.state = SandboxState.running
            self.live.mark_paused(sandbox_id, False)
            rec.paused_at = None
            rec.pause_reason = None
            live.touch()
            if rec.deadline_s is not None:  # only running time counts against a deadline
                rec.deadline_at = rec.last_active_at + rec.deadline_s
            self.journal.update(rec)
            self.wakeups.look_again(live)  # a deadline that counts again
            totals = self.totals
            totals.resumes += 1
            totals.prefetched_bytes += prefetched
            totals.last_resume_s = time.monotonic() - started
            self.prom.paused("resume", totals.last_resume_s, prefetched)
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
        covered = sum(len(self.live.by_lease.get(key, ())) for key in renewed)
        return covered, expires

    def lease_actions(self, now: float) -> tuple[list[str], list[str]]:
        """(sandboxes to pause because their lease lapsed, sandboxes to stop after the grace);
        forgets leases that no longer cover any sandbox. Looks at lapsed leases' sandboxes only."""
        to_pause: list[str] = []
        to_stop: list[str] = []
        for key in list(self.leases):
            lease = self.leases[key]
            held = self.live.by_lease.get(key)
            if not held:
                del self.leases[key]
                self.journal.drop_lease(*key)
            elif now >= lease.expires_at + lease.grace_s:
                to_stop.extend(held)
            elif now >= lease.expires_at:
                to_pause.extend(sid for sid in held if self.live[sid].record.state is SandboxState.running)
        return to_pause, to_stop


async def _until(live: _Live, done: Callable[[], bool], timeout_s: float | None) -> None:
    """Until ``done()`` holds, checked at each of ``live``'s notifications, or ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while not done():
                await live.changed()


def _quiet(live: _Live) -> bool:
    """No process is joining the sandbox (or a stop wants it)."""
    return not live.entering or live.stop_wanted
