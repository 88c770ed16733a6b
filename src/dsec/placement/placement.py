"""Placement: filter the nodes that can take a sandbox, then pick by power of k choices.

The watcher's snapshot lags; each placement instance adds on top of it every create it placed
since that snapshot was taken (not only those still in flight: a create the edge has answered is
in no snapshot until the next poll), so a burst from one apiserver does not pile onto the node
that looked emptiest a second ago. Measured with bench/controlplane.py (160 nodes, 380,000
placements, k=2): max/mean load 1.0046 counting only creates in flight, 1.0025 counting all since
the poll; and k=3 then beats k=2 instead of herding. Instances need no coordination: the edge has
the final word and rejects what it cannot admit.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from dsec.protocol.errors import CapacityExhausted, InvalidRequest
from dsec.protocol.models import Hardware


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
    """Power of k choices over the nodes that can take a sandbox.

    Which nodes are eligible (healthy, offer the backend, fit the hardware asked for) changes
    only when the watcher polls, so the eligible list is computed once per snapshot and
    hardware request; a choice then samples ``k`` of it and checks only those for room, which
    keeps a create's cost independent of the cluster's size.
    """

    def __init__(self, watcher: Watcher, k: int = 2) -> None:
        if k < 1:
            raise ValueError("power of k choices needs k >= 1")
        self.watcher = watcher
        self.k = k
        self.in_flight: Counter[str] = Counter()  # creates placed since the snapshot was taken
        self._pools: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
        self._pools_of: dict[str, dict[str, Any]] | None = None
        # (backend, outcome, perf_counter at the start) of each choice: the apiserver's metrics.
        self.on_choose: Callable[[str, str, float], None] | None = None

    def _sync(self) -> None:
        snapshot = self.watcher.snapshot
        if snapshot is not self._pools_of:  # a poll replaced it: it counts those creates itself
            self._pools, self._pools_of = {}, snapshot
            self.in_flight.clear()

    def _pool(self, backend: str, need: Hardware | None, features: tuple[str, ...] = ()) -> list[str]:
        self._sync()
        snapshot = self.watcher.snapshot
        key = (backend, "" if need is None else need.model_dump_json(), features)
        pool = self._pools.get(key)
        if pool is None:
            pool = [
                name
                for name, s in snapshot.items()
                if s.get("healthy")
                and backend in s.get("backends", ())
                and (need is None or need.unmet(s.get("hardware", {})) is None)
                and _offers(s, backend, features)
            ]
            self._pools[key] = pool
        return pool

    def _has_room(self, name: str) -> bool:
        s = self.watcher.snapshot[name]
        return bool(s.get("running", 0) + s.get("creating", 0) + self.in_flight[name] < s.get("capacity", 0))

    def candidates(
        self, backend: str, exclude: set[str], need: Hardware | None = None, features: tuple[str, ...] = ()
    ) -> list[str]:
        return [n for n in self._pool(backend, need, features) if n not in exclude and self._has_room(n)]

    def busy(self, name: str) -> int:
        """Sandboxes on node ``name`` as of the snapshot, plus those placed there since."""
        self._sync()
        s = self.watcher.snapshot.get(name, {})
        return int(s.get("running", 0)) + int(s.get("creating", 0)) + self.in_flight[name]

    def _load(self, name: str) -> float:
        s = self.watcher.snapshot[name]
        busy = s.get("running", 0) + s.get("creating", 0) + self.in_flight[name]
        return float(busy) / max(1, int(s.get("capacity", 1)))

    def _sample(
        self, backend: str, exclude: set[str], need: Hardware | None, features: tuple[str, ...]
    ) -> list[str]:
        pool = self._pool(backend, need, features)
        picked = random.sample(pool, min(len(pool), self.k))
        ok = [n for n in picked if n not in exclude and self._has_room(n)]
        if len(ok) == len(picked):
            return ok
        # Some picks were tried or full: fall back to sampling among those that are not.
        eligible = self.candidates(backend, exclude, need, features)
        return random.sample(eligible, min(len(eligible), self.k))

    async def choose(
        self,
        backend: str,
        exclude: set[str] | None = None,
        need: Hardware | None = None,
        features: tuple[str, ...] = (),
    ) -> str:
        """A node for a ``backend`` sandbox; ``features``: capabilities of that backend the node
        must report true (a gVisor sandbox needs a node where runsc works)."""
        started = time.perf_counter()
        try:
            node = await self._choose(backend, exclude or set(), need, features)
        except Exception as exc:
            if self.on_choose is not None:
                outcome = "refused" if isinstance(exc, CapacityExhausted) else "invalid"
                self.on_choose(backend, outcome, started)
            raise
        if self.on_choose is not None:
            self.on_choose(backend, "placed", started)
        return node

    async def _choose(
        self, backend: str, exclude: set[str], need: Hardware | None, features: tuple[str, ...]
    ) -> str:
        sample = self._sample(backend, exclude, need, features)
        if not sample:
            # The snapshot may be a poll old: a node that was full then may have room now.
            await self.watcher.poll()
            sample = self._sample(backend, exclude, need, features)
        if not sample and features and self._pool(backend, need) and not self._pool(backend, need, features):
            # Not a matter of room: no node of the cluster can run it, so retrying will not help.
            raise InvalidRequest(
                f"no node offers {', '.join(features)} for {backend} sandboxes"
                " (a gVisor node needs runsc installed and working)"
            )
        if not sample:
            wanted = (
                ""
                if need is None or need == Hardware()
                else f" with {need.model_dump(exclude_defaults=True)}"
            )
            raise CapacityExhausted(f"no node can take a {backend} sandbox{wanted} right now")
        return min(sample, key=self._load)

    @contextlib.contextmanager
    def reserve(self, node: str) -> Iterator[None]:
        """Count a create placed on ``node`` until the next poll (uncounted if it fails)."""
        self._sync()
        self.in_flight[node] += 1
        try:
            yield
        except BaseException:
            if self._pools_of is self.watcher.snapshot:  # else a poll has cleared it already
                self.in_flight[node] -= 1
            raise


def _offers(stats: Mapping[str, Any], backend: str, features: tuple[str, ...]) -> bool:
    caps = stats.get("capabilities", {}).get(backend, {})
    return all(caps.get(f) for f in features)
