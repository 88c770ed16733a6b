"""When each sandbox next needs the reaper: a heap of due times, so a pass looks at the
sandboxes whose time came, not at every sandbox the edge holds.

Walking every sandbox each second was an edge's steady cost at density (py-spy at 8,000 held:
~8% of a core, taken from creates). Times only move later as sandboxes are used (activity
defers idleness), so an entry is never updated in place: the reaper looks when it falls due,
finds the sandbox's real next time and asks again (:meth:`Wakeups.look_again`). Whatever can
make a time earlier (a new deadline, a resume, a stop to retry) asks for it when it happens.
"""

from __future__ import annotations

import heapq
import time

from dsec.edge.tally import _Live
from dsec.protocol.models import SandboxState


class Wakeups:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._at: dict[str, float] = {}  # the earliest time asked for each sandbox

    def at(self, sandbox_id: str, when: float) -> None:
        """Look at ``sandbox_id`` no later than ``when`` (an earlier request stands)."""
        held = self._at.get(sandbox_id)
        if held is not None and held <= when:
            return
        self._at[sandbox_id] = when
        heapq.heappush(self._heap, (when, sandbox_id))
        if len(self._heap) > 2 * len(self._at) + 1024:  # superseded entries: drop them
            self._heap = [(t, i) for i, t in self._at.items()]
            heapq.heapify(self._heap)

    def look_again(self, live: _Live) -> None:
        """Have the reaper look at this sandbox when its next time-based condition could hold."""
        when = next_look(live, time.time())
        if when is not None:
            self.at(live.record.id, when)

    def due(self, now: float) -> list[str]:
        """The sandboxes whose time came, each once; they are forgotten until asked for again."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, sandbox_id = heapq.heappop(heap)
            if self._at.get(sandbox_id) == when:
                del self._at[sandbox_id]
                out.append(sandbox_id)
        return out

    def forget(self, sandbox_id: str) -> None:
        self._at.pop(sandbox_id, None)

    def __len__(self) -> int:
        return len(self._at)


def next_look(live: _Live, now: float) -> float | None:
    """The earliest time one of the sandbox's time-based conditions (:mod:`.reclaim`) could
    hold, as things stand (activity only makes it later); None if it has none."""
    rec, spec = live.record, live.record.spec
    if rec.state is SandboxState.stopping:
        return now  # a destroy that failed: the next pass tries again
    idle_since = now if working(live) else rec.last_active_at
    times = [
        rec.created_at + spec.max_lifetime_s if spec.max_lifetime_s is not None else None,
        rec.deadline_at if rec.state is SandboxState.running else None,
        idle_since + spec.ttl_running_stop if spec.ttl_running_stop is not None else None,
        idle_since + spec.pause_after_idle_s
        if spec.pause_after_idle_s is not None and rec.state is SandboxState.running
        else None,
    ]
    return min((t for t in times if t is not None), default=None)


def working(live: _Live) -> bool:
    """Whether the sandbox is busy for its idle TTL: running a command. A command frozen with
    a paused sandbox is not activity (it waits for a resume that may never come), so a paused
    sandbox's TTL counts from its pause, or its last request after it."""
    return bool(live.busy) and live.record.state is not SandboxState.paused
