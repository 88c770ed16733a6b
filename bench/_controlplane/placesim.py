"""Phase A: the placement algorithm alone, at the original's scale, in simulated time.

Real :class:`~dsec.placement.placement.Placement` and :class:`Watcher` objects place sandboxes
on counters standing for nodes. Time is simulated (an event queue, no sleeping), so snapshot
lag is exactly what the parameters say however fast this machine is: several apiservers, each
with its own watcher polling every ``poll_s`` (their polls spread over the interval) and its
own in-flight overlay, share nothing but the nodes; creates arrive at ``rate`` per second,
round robin over the apiservers, and each takes ``create_s`` on its node (counted as
``creating`` there, and in the overlay of the apiserver that placed it, meanwhile).
A node that is full rejects; the apiserver then tries another, as the create route does.
"""

from __future__ import annotations

import contextlib
import heapq
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsec.placement.placement import Placement, Watcher


class SimNode:
    """What the watcher sees of a node: counters only."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.running = 0
        self.creating = 0

    async def stats(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "epoch": 1,
            "backends": ["container"],
            "running": self.running,
            "creating": self.creating,
            "capacity": self.capacity,
        }


class SincePollPlacement(Placement):
    """A what-if, not in src: the overlay counts every create this instance placed since its
    watcher's last poll, not only those the edge has not answered yet. The stock overlay forgets
    a create when the edge answers, but the snapshot learns of it only at the next poll."""

    def __init__(self, watcher: Watcher, k: int = 2) -> None:
        super().__init__(watcher, k)
        self._seen: dict[str, dict[str, Any]] | None = None

    def _sync(self) -> None:
        if self.watcher.snapshot is not self._seen:  # a poll replaced it: it counts them all now
            self.in_flight.clear()
            self._seen = self.watcher.snapshot

    async def choose(self, *args: Any, **kwargs: Any) -> str:  # whatever the stock one takes
        self._sync()
        return await super().choose(*args, **kwargs)

    @contextlib.contextmanager
    def reserve(self, node: str) -> Iterator[None]:
        self._sync()
        self.in_flight[node] += 1
        yield


@dataclass
class PlaceResult:
    k: int
    variant: str
    placed: int
    imbalance: dict[int, float]  # sandboxes placed so far -> max node load / mean node load
    max_node: int
    mean_node: float
    min_node: int
    rejected: int  # creates a full node refused (then placed elsewhere)
    choose_s: list[float] = field(repr=False)  # wall time of each Placement.choose call

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "choose_s"}
        out["imbalance"] = {str(n): v for n, v in self.imbalance.items()}
        return out


def imbalance(nodes: list[SimNode]) -> float:
    loads = [n.running + n.creating for n in nodes]
    return max(loads) / (sum(loads) / len(loads))


async def simulate(
    *,
    k: int,
    variant: str = "stock",
    sandboxes: int,
    nodes: int,
    capacity: int,
    apiservers: int,
    rate: float,
    poll_s: float,
    create_s: float,
    seed: int,
    checkpoints: tuple[float, ...] = (0.1, 0.5, 1.0),
) -> PlaceResult:
    random.seed(seed)  # Placement samples with the module's generator
    sim = [SimNode(f"n{i:03d}", capacity) for i in range(nodes)]
    by_name = {n.name: n for n in sim}
    watchers = [Watcher(by_name, interval_s=poll_s) for _ in range(apiservers)]
    kind = SincePollPlacement if variant == "since-poll" else Placement
    placements = [kind(w, k=k) for w in watchers]
    for w in watchers:
        await w.poll()
    marks = {max(1, round(f * sandboxes)) for f in checkpoints}
    result = PlaceResult(k, variant, 0, {}, 0, 0.0, 0, 0, [])

    # (time, seq, action): polls and create completions; arrivals come in order between them
    events: list[tuple[float, int, Callable[[], Any]]] = []
    seq = 0

    def push(at: float, action: Callable[[], Any]) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, action))

    for j, w in enumerate(watchers):
        push(j * poll_s / apiservers, w.poll)

    def completion(node: SimNode, held: contextlib.AbstractContextManager[None]) -> Callable[[], None]:
        def done() -> None:
            node.creating -= 1
            node.running += 1
            held.__exit__(None, None, None)

        return done

    async def step() -> None:
        at, _, action = heapq.heappop(events)
        out = action()
        if out is not None:  # a poll: await it, then schedule the next one
            await out
            push(at + poll_s, action)

    for i in range(sandboxes):
        now = i / rate
        while events and events[0][0] <= now:
            await step()
        p = placements[i % apiservers]
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            name = await p.choose("container", tried)
            result.choose_s.append(time.perf_counter() - t0)
            node = by_name[name]
            if node.running + node.creating < node.capacity:
                break
            result.rejected += 1  # the edge has the final word
            tried.add(name)
        held = p.reserve(name)
        held.__enter__()
        node.creating += 1
        push(now + create_s, completion(node, held))
        if i + 1 in marks:
            result.imbalance[i + 1] = imbalance(sim)
    # Drain the creates still in flight (polls would go on forever: stop at the last completion).
    while any(n.creating for n in sim):
        await step()
    loads = [n.running for n in sim]
    result.placed = sum(loads)
    result.max_node, result.min_node = max(loads), min(loads)
    result.mean_node = result.placed / nodes
    result.imbalance[sandboxes] = result.max_node / result.mean_node
    return result
