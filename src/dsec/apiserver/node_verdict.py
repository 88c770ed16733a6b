"""Whether a node the apiserver cannot reach is lost, or merely unreachable from here.

The cluster's registry (``iam/registry.py``) is what every apiserver shares about a node: its
epoch and when it last heartbeat (``last_seen``). A node is *declared lost* when the registry,
read successfully, has not heard from it for ``lost_after_s`` and neither has this apiserver
(no answer to any call, the watcher's polls included, in that time): every apiserver reads
the same rows, so they agree on a dead node, one that cannot read the registry keeps judging
by its last good read (it never declares a node lost for its own outage), and a node that
answers is never lost (an edge does not heartbeat while it starts, re-adopting its sandboxes,
which takes seconds). A node whose epoch changed has lost every sandbox of the earlier epoch.

What this decides for a request on the node's sandboxes (see :class:`NodeView`):

- it could not connect and the node is declared lost: ``InfraFailure(reason="node_lost")``;
  the request never left, so a create may still be placed elsewhere (``never_reached_edge``);
- it was sent and the connection broke (the edge died mid-command): the outcome waits for the
  verdict, at most ``lost_after_s`` and two registry reads: lost, or back under another epoch,
  is ``node_lost``; a heartbeat after the break (the node lives, only this connection failed)
  or no verdict in time is ``edge_unreachable``;
- it is still waiting on a node that gets declared lost (a machine gone without a reset, whose
  connections would hang) or re-registers under a new epoch: it is cut with ``node_lost``.
"""

from __future__ import annotations

import asyncio
import time

from dsec.protocol.errors import InfraFailure, InfraReason

NODE_LOST = InfraReason.node_lost
# Past the registry's verdict window: reads happen every interval, so allow two of them.
_READS_OF_GRACE = 2


class NodeView:
    """What the registry says about one node, and the link calls in flight on it."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.lost_after_s: float | None = None  # None: never declared lost (no registry)
        self.read_interval_s = 1.0
        self.epoch: int | None = None  # the registry's
        self.last_seen: float | None = None
        self.read_at: float | None = None  # when the registry was last read successfully
        self.heard_at: float | None = None  # when the node last answered this apiserver
        self._changed = asyncio.Event()
        self._in_flight: dict[asyncio.Task[object], int | None] = {}  # task -> epoch at its start
        self._cut: set[asyncio.Task[object]] = set()

    @property
    def lost(self) -> bool:
        if self.lost_after_s is None or self.last_seen is None or self.read_at is None:
            return False
        latest = max(self.last_seen, self.heard_at or 0.0)
        return self.read_at - latest > self.lost_after_s

    def heard(self) -> None:
        self.heard_at = time.time()

    def update(self, epoch: int, last_seen: float, read_at: float) -> None:
        """A registry read; cuts the calls that can no longer end well."""
        self.epoch, self.last_seen, self.read_at = epoch, last_seen, read_at
        lost = self.lost
        for task, started_epoch in self._in_flight.items():
            if task not in self._cut and (lost or _changed(started_epoch, epoch)):
                self._cut.add(task)
                task.cancel(f"node {self.node!r} was lost")
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def in_flight(self) -> int:
        """How many calls are waiting on the node (a broken one leaves at once for its verdict)."""
        return len(self._in_flight)

    def begin(self) -> asyncio.Task[object] | None:
        task = asyncio.current_task()
        if task is not None:
            self._in_flight[task] = self.epoch
        return task

    def end(self, task: asyncio.Task[object] | None) -> None:
        if task is not None:
            self._in_flight.pop(task, None)
            self._cut.discard(task)

    def started_epoch(self, task: asyncio.Task[object] | None) -> int | None:
        return self._in_flight.get(task, self.epoch) if task is not None else self.epoch

    def was_cut(self, task: asyncio.Task[object] | None) -> bool:
        """Whether ``task``'s cancellation is this view's own (then it is taken back)."""
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        # Cancelled by someone else too (the caller hung up): that cancellation stands.
        return task.uncancel() == 0

    def lost_error(self, what: str, why: str = "") -> InfraFailure:
        why = why or (f"not heard from for over {self.lost_after_s:g} s" if self.lost else "it re-registered")
        return InfraFailure(
            f"node {self.node!r} was lost ({why}) during {what}: its sandboxes went with it",
            reason=NODE_LOST,
        )

    async def after_break(self, what: str, started_epoch: int | None) -> InfraFailure | None:
        """A sent request's connection broke: ``node_lost`` once the registry says so, None
        (unreachable) if the node shows it lives, or if no verdict comes in time."""
        if self.lost_after_s is None:
            return None
        broke_at = time.time()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lost_after_s + _READS_OF_GRACE * self.read_interval_s
        while True:
            if self.epoch is not None and _changed(started_epoch, self.epoch):
                return self.lost_error(what, f"it came back as epoch {self.epoch}")
            if self.lost:
                return self.lost_error(what)
            if max(self.last_seen or 0.0, self.heard_at or 0.0) > broke_at:
                return None  # heard from after the break: alive, only this connection failed
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return None

    async def ended_early(self, what: str, url: str, started_epoch: int | None) -> InfraFailure:
        """A stream the edge closed before its last event: lost with the node, or unreachable."""
        lost = await self.after_break(what, started_epoch)
        return lost or InfraFailure(
            f"edge {self.node!r} at {url} ended {what} without its end", reason=InfraReason.edge_unreachable
        )


def _changed(started: int | None, now: int) -> bool:
    return started is not None and started != now
