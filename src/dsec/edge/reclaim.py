"""Reclamation: what an edge takes back by itself, without being asked.

A pass (every ``reap_interval_s``) stops sandboxes whose maximum lifetime ran out, that were
idle (no request and no running command) for their ``ttl_running_stop`` (paused or not), whose
deadline (:meth:`Reclaimer.set_deadline`, counted while running) passed, that died (checked
every ``liveness_interval_s``, ``liveness_batch`` sandboxes at a time), or whose job lease
lapsed longer than its grace ago; pauses sandboxes idle for their ``pause_after_idle_s``, those
whose lease lapsed or whose deadline says pause and, while the node is short of memory, the
idlest (see :mod:`.admission`); retries stops that failed before, writes the activity times
that changed to the journal in one batch and forgets finished sandboxes (and their
trajectories) after ``keep_finished_s``.

A pass looks only at the sandboxes whose time came (:mod:`.wakeups`), the liveness batch and
those under lapsed leases: its cost follows what it does, not how many sandboxes the node holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import DeadlineAction, SandboxInfo, SandboxState

if TYPE_CHECKING:
    from dsec.backends.base import Backend
    from dsec.edge.config import EdgeConfig
    from dsec.edge.journal import Journal, Record
    from dsec.edge.tally import LiveSandboxes, _Live
    from dsec.edge.trajectory import Recorder
    from dsec.edge.wakeups import Wakeups
    from dsec.observe.edge_metrics import EdgeMetrics

log = logging.getLogger("dsec.edge")


class Reclaimer:
    """Mixed into :class:`~dsec.edge.edge.Edge`, whose state it reads."""

    if TYPE_CHECKING:
        config: EdgeConfig
        backend: Backend
        journal: Journal
        _live: LiveSandboxes
        _last_liveness: float
        _liveness_cursor: int
        _wakeups: Wakeups
        recorder: Recorder
        prom: EdgeMetrics

        async def stop(
            self, sandbox_id: str, *, reason: str = ..., final: SandboxState = ...
        ) -> SandboxInfo: ...

        async def pause(
            self, sandbox_id: str, *, reason: str = ..., drain_s: float | None = ...
        ) -> SandboxInfo: ...

        def lease_actions(self, now: float) -> tuple[list[str], list[str]]: ...
        def _get_live(self, sandbox_id: str) -> _Live: ...
        def _info(self, rec: Record) -> SandboxInfo: ...
        def backend_of(self, rec: Record) -> Backend: ...
        async def relieve_pressure(self) -> None: ...

    def set_deadline(
        self, sandbox_id: str, timeout_s: float | None, on_timeout: DeadlineAction = "stop"
    ) -> SandboxInfo:
        """Stop (or pause) the sandbox ``timeout_s`` seconds from now; ``None`` clears it.

        Journaled, so an edge restart keeps it. Only running time counts: a paused sandbox is
        not acted on, and a resume gives it ``timeout_s`` again (E2B's timeout semantics).
        """
        if on_timeout not in ("stop", "pause"):
            raise InvalidRequest(f"on_timeout must be stop or pause, not {on_timeout!r}")
        rec = self._get_live(sandbox_id).record
        rec.deadline_at = None if timeout_s is None else time.time() + timeout_s
        rec.deadline_s = timeout_s
        rec.on_deadline = None if timeout_s is None else on_timeout
        self.journal.update(rec)
        self.look_again(self._live[sandbox_id])
        return self._info(rec)

    @staticmethod
    def _next_look(live: _Live, now: float) -> float | None:
        """The earliest time one of the sandbox's time-based conditions could hold, as things
        stand (activity only makes it later); None if it has none."""
        rec, spec = live.record, live.record.spec
        if rec.state is SandboxState.stopping:
            return now  # a destroy that failed: the next pass tries again
        idle_since = now if _working(live) else rec.last_active_at
        times = [
            rec.created_at + spec.max_lifetime_s if spec.max_lifetime_s is not None else None,
            rec.deadline_at if rec.state is SandboxState.running else None,
            idle_since + spec.ttl_running_stop if spec.ttl_running_stop is not None else None,
            idle_since + spec.pause_after_idle_s
            if spec.pause_after_idle_s is not None and rec.state is SandboxState.running
            else None,
        ]
        return min((t for t in times if t is not None), default=None)

    def look_again(self, live: _Live) -> None:
        """Have the reaper look at this sandbox when its next time-based condition could hold."""
        when = self._next_look(live, time.time())
        if when is not None:
            self._wakeups.at(live.record.id, when)

    def _flush_activity(self) -> None:
        # Only what changed: rewriting every row each second was an edge's steady CPU at 8,000.
        live, touched = self._live, self._live.touched
        if touched:
            self.journal.touch_many({i: live[i].record.last_active_at for i in touched if i in live})
            touched.clear()

    def _liveness_batch(self) -> set[str]:
        """The next ``liveness_batch`` sandboxes, round robin: each check reads /proc, so a
        pass over every sandbox of a full node each time was a steady cost of its own."""
        ids = list(self._live)
        batch = self.config.liveness_batch
        if len(ids) <= batch:
            return set(ids)
        start = self._liveness_cursor % len(ids)
        self._liveness_cursor = start + batch
        return {*ids[start : start + batch], *ids[: max(0, start + batch - len(ids))]}

    async def reap_once(self) -> list[str]:
        now = time.time()
        due: list[tuple[str, str]] = []
        dead: set[str] = set()
        lapsed, expired = self.lease_actions(now)
        to_pause = [(sid, "lease_lapsed") for sid in lapsed]
        lapsed_set = set(lapsed)
        expired_set = set(expired)
        to_check: set[str] = set()
        if now - self._last_liveness >= self.config.liveness_interval_s:
            self._last_liveness = now
            to_check = self._liveness_batch()
        looked = {*self._wakeups.due(now), *to_check, *lapsed_set, *expired_set}
        for sid in looked:
            live = self._live.get(sid)
            if live is None:
                continue
            spec, rec = live.record.spec, live.record
            if rec.state is SandboxState.stopping:
                due.append((sid, rec.stop_reason or "stopped"))  # a destroy that failed before
            # Not while it pauses, resumes or stops (its lock held): a microVM's QEMU has ended
            # before its handle names the snapshot it left, and would look dead.
            elif (
                sid in to_check
                and not live.stopping.locked()
                and not await self.backend_of(rec).alive(sid, rec.handle)
            ):
                due.append((sid, "sandbox exited unexpectedly"))
                dead.add(sid)
            elif spec.max_lifetime_s is not None and now - rec.created_at >= spec.max_lifetime_s:
                due.append((sid, "max_lifetime"))
            elif sid in expired_set:
                due.append((sid, "lease_expired"))
            elif rec.deadline_at is not None and rec.state is SandboxState.running and now >= rec.deadline_at:
                if rec.on_deadline == "pause":
                    to_pause.append((sid, "deadline"))
                else:
                    due.append((sid, "deadline"))
            elif (
                spec.ttl_running_stop is not None
                and not _working(live)
                and now - rec.last_active_at >= spec.ttl_running_stop
            ):
                due.append((sid, "idle_ttl"))
            elif (
                spec.pause_after_idle_s is not None
                and rec.state is SandboxState.running
                and not live.busy
                and now - rec.last_active_at >= spec.pause_after_idle_s
                and sid not in lapsed_set
            ):
                to_pause.append((sid, "idle"))
        due_ids = {sid for sid, _ in due}
        to_pause = [(sid, why) for sid, why in to_pause if sid not in due_ids]
        self.prom.reclaimed(due, to_pause)
        # Without waiting for commands to end (those resume with the sandbox): a pass must
        # not stall on one sandbox, and nobody waits for these pauses.
        paused = await asyncio.gather(
            *(self.pause(sid, reason=why, drain_s=0) for sid, why in to_pause), return_exceptions=True
        )
        for (sid, why), res in zip(to_pause, paused, strict=True):
            if isinstance(res, BaseException):
                log.warning("pausing %s (%s) failed: %s", sid, why, res)
        results = await asyncio.gather(
            *(
                self.stop(sid, reason=why, final=SandboxState.failed if sid in dead else SandboxState.stopped)
                for sid, why in due
            ),
            return_exceptions=True,
        )
        for (sid, why), res in zip(due, results, strict=True):
            if isinstance(res, BaseException):
                log.warning("reclaiming %s (%s) failed: %s", sid, why, res)
        for sid in looked:  # when to look next: later for the used, again for failed stops
            if (live := self._live.get(sid)) is not None:
                self.look_again(live)
        await self.relieve_pressure()
        self._flush_activity()
        self.recorder.log.forget(self.journal.forget_before(now - self.config.keep_finished_s))
        return [sid for sid, _ in due]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")


def _working(live: _Live) -> bool:
    """Whether the sandbox is busy for its idle TTL: running a command. A command frozen with
    a paused sandbox is not activity (it waits for a resume that may never come), so a paused
    sandbox's TTL counts from its pause, or its last request after it."""
    return bool(live.busy) and live.record.state is not SandboxState.paused
