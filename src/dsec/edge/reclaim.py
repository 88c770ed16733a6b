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
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from dsec.backends.base import Backend
from dsec.edge.config import EdgeConfig
from dsec.edge.journal import Journal, Record
from dsec.edge.pausing import Pausing
from dsec.edge.tally import LiveSandboxes
from dsec.edge.trajectory import Recorder
from dsec.edge.wakeups import Wakeups, working
from dsec.observe.edge_metrics import EdgeMetrics
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import DeadlineAction, SandboxInfo, SandboxState

log = logging.getLogger("dsec.edge")


class Stop(Protocol):
    """How the reaper stops a sandbox (:meth:`dsec.edge.edge.Edge.stop`)."""

    async def __call__(self, sandbox_id: str, *, reason: str, final: SandboxState) -> SandboxInfo: ...


class Reclaimer:
    """The reaper: a pass every ``reap_interval_s`` (:meth:`start`), and sandboxes' deadlines."""

    def __init__(
        self,
        config: EdgeConfig,
        journal: Journal,
        recorder: Recorder,
        live: LiveSandboxes,
        wakeups: Wakeups,
        prom: EdgeMetrics,
        backend_of: Callable[[Record], Backend],
        pausing: Pausing,
        *,
        stop: Stop,
        relieve_pressure: Callable[[], Awaitable[None]],
    ) -> None:
        """``relieve_pressure``: admission's pausing of the idlest while memory is short."""
        self.config = config
        self.journal = journal
        self.recorder = recorder
        self.live = live
        self.wakeups = wakeups
        self.prom = prom
        self.backend_of = backend_of
        self.pausing = pausing
        self.stop = stop
        self.relieve_pressure = relieve_pressure
        self._last_liveness = 0.0
        self._liveness_cursor = 0  # where the next liveness batch starts in live's order
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        """Stop the passes, and write the activity not journaled yet."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.flush_activity()

    def set_deadline(
        self, sandbox_id: str, timeout_s: float | None, on_timeout: DeadlineAction = "stop"
    ) -> SandboxInfo:
        """Stop (or pause) the sandbox ``timeout_s`` seconds from now; ``None`` clears it.

        Journaled, so an edge restart keeps it. Only running time counts: a paused sandbox is
        not acted on, and a resume gives it ``timeout_s`` again (E2B's timeout semantics).
        """
        if on_timeout not in ("stop", "pause"):
            raise InvalidRequest(f"on_timeout must be stop or pause, not {on_timeout!r}")
        rec = self.live.touch(sandbox_id).record
        rec.deadline_at = None if timeout_s is None else time.time() + timeout_s
        rec.deadline_s = timeout_s
        rec.on_deadline = None if timeout_s is None else on_timeout
        self.journal.update(rec)
        self.wakeups.look_again(self.live[sandbox_id])
        return rec.info(self.config.node)

    def flush_activity(self) -> None:
        # Only what changed: rewriting every row each second was an edge's steady CPU at 8,000.
        live, touched = self.live, self.live.touched
        if touched:
            self.journal.touch_many({i: live[i].record.last_active_at for i in touched if i in live})
            touched.clear()

    def _liveness_batch(self) -> set[str]:
        """The next ``liveness_batch`` sandboxes, round robin: each check reads /proc, so a
        pass over every sandbox of a full node each time was a steady cost of its own."""
        ids = list(self.live)
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
        lapsed, expired = self.pausing.lease_actions(now)
        to_pause = [(sid, "lease_lapsed") for sid in lapsed]
        lapsed_set = set(lapsed)
        expired_set = set(expired)
        to_check: set[str] = set()
        if now - self._last_liveness >= self.config.liveness_interval_s:
            self._last_liveness = now
            to_check = self._liveness_batch()
        looked = {*self.wakeups.due(now), *to_check, *lapsed_set, *expired_set}
        for sid in looked:
            live = self.live.get(sid)
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
                and not working(live)
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
            *(self.pausing.pause(sid, reason=why, drain_s=0) for sid, why in to_pause), return_exceptions=True
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
            if (live := self.live.get(sid)) is not None:
                self.wakeups.look_again(live)
        await self.relieve_pressure()
        self.flush_activity()
        self.recorder.log.forget(self.journal.forget_before(now - self.config.keep_finished_s))
        return [sid for sid, _ in due]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")
