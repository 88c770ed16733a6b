"""When each sandbox next needs the reaper: a heap of due times, so a pass looks at the
sandboxes whose time came, not at every sandbox the edge holds.

Walking every sandbox each second was an edge's steady cost at density (py-spy at 8,000 held:
~8% of a core, taken from creates). Times only move later as sandboxes are used (activity
defers idleness), so an entry is never updated in place: the reaper looks when it falls due,
finds the sandbox's real next time and asks again (:meth:`Wakeups.at`). Whatever can make a
time earlier (a new deadline, a resume, a stop to retry) asks for it when it happens.
"""

from __future__ import annotations

import heapq


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
