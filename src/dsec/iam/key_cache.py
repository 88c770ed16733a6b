"""The in-process cache in front of ``authenticate``, which is on every request's path.

A fresh entry answers without a database trip; an entry lives ``ttl_s`` (default 5 s), which
is how long a revocation made through another apiserver process can take to reach this one
(the revoking process evicts at once). Concurrent misses for one key share one lookup.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from dsec.iam.base import Principal

_CACHE_MAX = 100_000


class KeyCache:
    """Principals by key digest; ``lookup`` reads one from the database (or raises)."""

    def __init__(self, lookup: Callable[[str], Awaitable[Principal]], ttl_s: float) -> None:
        self._lookup = lookup
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._inflight: dict[str, asyncio.Task[Principal]] = {}
        # Bumped by every eviction: a lookup that started before it must not cache its answer
        # (it may have read a key this process has revoked since).
        self._generation = 0

    async def get(self, digest: str) -> Principal:
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._fill(digest))
            self._inflight[digest] = task
            task.add_done_callback(lambda t: self._fill_done(digest, t))
        # Shielded: one caller giving up must not cancel the lookup the others are waiting for.
        return await asyncio.shield(task)

    def _fill_done(self, digest: str, task: asyncio.Task[Principal]) -> None:
        self._inflight.pop(digest, None)
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have given up already

    async def _fill(self, digest: str) -> Principal:
        generation = self._generation
        principal = await self._lookup(digest)
        if self.ttl_s > 0 and generation == self._generation:
            if len(self._cache) >= _CACHE_MAX:
                now = time.monotonic()
                self._cache = {d: e for d, e in self._cache.items() if e[1] > now}
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
            self._cache[digest] = (principal, time.monotonic() + self.ttl_s)
        return principal

    def evict(self, match: Callable[[Principal], bool]) -> None:
        self._generation += 1
        self._cache = {d: e for d, e in self._cache.items() if not match(e[0])}

    def clear(self) -> None:
        self._cache.clear()
