"""Placement: filter the nodes that can take a sandbox, then pick by power of k choices.

The watcher's snapshot lags; each placement instance adds its own in-flight creates on top of
it so a burst from one apiserver does not pile onto the node that looked emptiest a second ago.
Instances need no coordination: the edge has the final word and rejects what it cannot admit.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from dsec.protocol.errors import CapacityExhausted


class NodeProbe(Protocol):
    async def stats(self) -> dict[str, Any]: ...


class Watcher:
    """Polls every edge for health and load. Holds no durable state: a restart polls again."""

    def __init__(
        self, nodes: Mapping[str, NodeProbe], interval_s: float = 1.0, timeout_s: float = 2.0
    ) -> None:
        self.nodes = nodes
        self.interval_s = interval_s
        self.timeout_s = timeout_s  # a node slower than this to answer counts as unhealthy
        self.snapshot: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None

    async def _probe(self, node: NodeProbe) -> dict[str, Any]:
        try:
            stats = dict(await asyncio.wait_for(node.stats(), self.timeout_s))
            stats["healthy"] = True
        except Exception:
            stats = {"healthy": False}
        stats["polled_at"] = time.time()
        return stats

    async def poll(self) -> None:
        names = list(self.nodes)
        results = await asyncio.gather(*(self._probe(self.nodes[n]) for n in names))
        self.snapshot = dict(zip(names, results, strict=True))

    async def start(self) -> None:
        await self.poll()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Placement:
    def __init__(self, watcher: Watcher, k: int = 2) -> None:
        self.watcher = watcher
        self.k = k
        self.in_flight: Counter[str] = Counter()

    def candidates(self, backend: str, exclude: set[str]) -> list[str]:
        out = []
        for name, s in self.watcher.snapshot.items():
            if name in exclude or not s.get("healthy") or backend not in s.get("backends", ()):
                continue
            if s.get("running", 0) + s.get("creating", 0) + self.in_flight[name] >= s.get("capacity", 0):
                continue
            out.append(name)
        return out

    def _load(self, name: str) -> float:
        s = self.watcher.snapshot[name]
        busy = s.get("running", 0) + s.get("creating", 0) + self.in_flight[name]
        return float(busy) / max(1, int(s.get("capacity", 1)))

    async def choose(self, backend: str, exclude: set[str] | None = None) -> str:
        eligible = self.candidates(backend, exclude or set())
        if not eligible:
            # The snapshot may be a poll old: a node that was full then may have room now.
            await self.watcher.poll()
            eligible = self.candidates(backend, exclude or set())
        if not eligible:
            raise CapacityExhausted(f"no node can take a {backend} sandbox right now")
        sample = random.sample(eligible, min(self.k, len(eligible)))
        return min(sample, key=self._load)

    @contextlib.contextmanager
    def reserve(self, node: str) -> Iterator[None]:
        self.in_flight[node] += 1
        try:
            yield
        finally:
            self.in_flight[node] -= 1
