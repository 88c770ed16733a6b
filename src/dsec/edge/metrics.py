"""Per-sandbox resource figures over time, read from the node's cgroups (E2B's ``get_metrics``).

Every :data:`INTERVAL_S` the edge reads, for each running container sandbox, its CPU time
(``cpuacct.usage``), its anonymous memory and page cache (``memory.stat``: two files, ~37 us
a sandbox, 6 % of a core at 8,000 sandboxes) and, for a sandbox with ``disk_limit_mb``, the
bytes its quota volume references; it keeps the last :data:`CAPACITY` samples of each in a
ring of float32s (20 bytes a sample, grown as samples come: a sandbox that lives a minute
holds 12). A query also takes one fresh reading, so "now" is never up to an interval stale
and a sandbox younger than the first tick has a figure.

What the figures mean, as E2B's envd reports them from inside its VM:
  - ``cpu_used_pct``: CPU time over wall time since the previous sample, as a percentage of
    the sandbox's cores (one core busy in a 2-core sandbox is 50);
  - ``mem_used``: the cgroup's anonymous memory (E2B: used = total - free - cache, which the
    kernel's own memory counts in too); ``mem_cache`` its page cache (tmpfs files included);
    ``mem_total`` the sandbox's memory limit;
  - ``disk_used``/``disk_total``: the quota volume's referenced bytes and limit; both 0 for a
    sandbox without ``disk_limit_mb`` (its writes go to the node's file system, unmetered).

Paused sandboxes are not sampled (E2B records nothing for a paused VM either); a resume starts
the CPU count afresh. Other backends (microVMs, VMs) have no samples: their guests' cgroups are
not the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from dsec.backends.base import Backend
from dsec.backends.container import cgroups
from dsec.edge.journal import Record
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.metrics import MAX_UNIX_S, MetricSample
from dsec.protocol.models import SandboxState

log = logging.getLogger("dsec.edge.metrics")

INTERVAL_S = 5.0  # E2B's orchestrator exports each sandbox's figures every 5 s too
CAPACITY = 360  # samples kept per sandbox: 30 minutes at INTERVAL_S
_BATCH = 128  # sandboxes read between two yields to the event loop (~5 ms)
_FIELDS = 5  # ts offset, cpu_used_pct, mem_used, mem_cache, disk_used
_UNIX_TIME = re.compile(r"\d{1,11}(\.\d{1,9})?")


@dataclass
class _Reading:
    at: float  # unix seconds
    cpu_ns: int
    mem_used: int
    mem_cache: int
    disk_used: int


@dataclass
class _Series:
    """One sandbox's ring: float32 rows of :data:`_FIELDS`, ``ts`` kept as an offset from
    ``base`` (float32 holds a unix time only to ~2 minutes)."""

    base: float
    cpu_count: int
    mem_total: int
    disk_total: int
    rows: array[float] = field(default_factory=lambda: array("f"))
    head: int = 0  # the next row to overwrite once the ring is full
    last: _Reading | None = None  # what the next sample's CPU share is counted from
    paths: list[tuple[str, bytes, int]] = field(default_factory=list)  # see _V1
    referenced: str | None = None  # the quota volume's qgroup ``referenced`` file
    was_paused: bool = False  # the next reading is a baseline only (CPU time froze meanwhile)

    def push(self, r: _Reading, cpu_pct: float) -> None:
        row = (r.at - self.base, cpu_pct, float(r.mem_used), float(r.mem_cache), float(r.disk_used))
        if len(self.rows) < CAPACITY * _FIELDS:
            self.rows.extend(row)
        else:
            i = self.head * _FIELDS
            self.rows[i : i + _FIELDS] = array("f", row)
            self.head = (self.head + 1) % CAPACITY

    def samples(self) -> list[MetricSample]:
        n = len(self.rows) // _FIELDS
        order = [*range(self.head, n), *range(self.head)]
        return [self._sample(self.rows[i * _FIELDS : (i + 1) * _FIELDS]) for i in order]

    def _sample(self, row: array[float]) -> MetricSample:
        return MetricSample(
            ts=self.base + row[0],
            cpu_count=self.cpu_count,
            cpu_used_pct=round(row[1], 2),
            mem_used=int(row[2]),
            mem_total=self.mem_total,
            mem_cache=int(row[3]),
            disk_used=int(row[4]),
            disk_total=self.disk_total,
        )


# Where a sandbox's figures are, below its cgroup path: (file, key or b"" for a bare number,
# scale). cgroup v1 (this project's hosts): anon memory is memory.stat's total_rss, the cache
# its total_cache; cgroup2 (a host without the v1 memory hierarchy): anon and file.
_V1 = (("cpuacct/{}/cpuacct.usage", b"", 1), ("memory/{}/memory.stat", b"total_rss", 1),
       ("memory/{}/memory.stat", b"total_cache", 1))  # fmt: skip
_V2 = (("{}/cpu.stat", b"usage_usec", 1000), ("{}/memory.stat", b"anon", 1),
       ("{}/memory.stat", b"file", 1))  # fmt: skip


def _read_file(path: str) -> bytes:
    # os.open/read, not pathlib: a tick reads two files of every sandbox (bench/metrics_sampler.py)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 16384)
    finally:
        os.close(fd)


def _value(text: bytes, key: bytes) -> int:
    if not key:
        return int(text)
    at = text.find(key + b" ")
    while at > 0 and text[at - 1] != 0x0A:  # a longer key that ends in this one
        at = text.find(key + b" ", at + 1)
    return 0 if at < 0 else int(text[at + len(key) + 1 : text.find(b"\n", at)])


def _paths(sandbox_id: str) -> list[tuple[str, bytes, int]]:
    rel = cgroups.rel(sandbox_id)
    v1 = (cgroups.CGROUP_ROOT / "memory").is_dir()
    return [(f"{cgroups.CGROUP_ROOT}/{f.format(rel)}", key, k) for f, key, k in (_V1 if v1 else _V2)]


def _read(series: _Series) -> _Reading | None:
    """The sandbox's figures now; None if its cgroups are gone."""
    try:
        texts: dict[str, bytes] = {}
        cpu_ns, anon, cache = (
            _value(texts.get(f) or texts.setdefault(f, _read_file(f)), key) * k for f, key, k in series.paths
        )
        disk = int(_read_file(series.referenced)) if series.referenced is not None else 0
    except (OSError, ValueError):
        return None
    return _Reading(time.time(), cpu_ns, anon, cache, disk)


def _cpu_pct(series: _Series, r: _Reading, started_at: float) -> float:
    before_ns, since = (series.last.cpu_ns, series.last.at) if series.last else (0, started_at)
    wall = r.at - since
    if wall <= 0:
        return 0.0
    return max(0.0, min(100.0, (r.cpu_ns - before_ns) / 1e9 / wall / series.cpu_count * 100))


def _quota_file(backend: Backend, sandbox_id: str) -> str | None:
    """The qgroup ``referenced`` file of the sandbox's quota volume (container backend)."""
    volumes: Any = getattr(backend, "volumes", None)
    if volumes is None:
        return None
    try:
        fs = volumes.fs
        return str(Path(fs.qgroup_dir(fs.volume_id(sandbox_id))) / "referenced")
    except (OSError, ValueError, AttributeError):
        return None


class MetricsSampler:
    """The edge's sampler: ``live()`` is the edge's running sandboxes by ID."""

    def __init__(
        self,
        live: Callable[[], Mapping[str, Any]],
        backend_of: Callable[[Record], Backend],
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._live = live
        self._backend_of = backend_of
        self.interval_s = interval_s
        self._series: dict[str, _Series] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # a bad read must not end the sampling of every sandbox
                log.exception("sampling sandbox metrics")

    async def tick(self) -> None:
        """One sample of every running container sandbox; rings of the gone are dropped."""
        live = self._live()
        for gone in [sid for sid in self._series if sid not in live]:
            del self._series[gone]
        for n, (sid, each) in enumerate(list(live.items())):
            if n and n % _BATCH == 0:
                await asyncio.sleep(0)  # thousands of sandboxes: let requests in between
            rec: Record = each.record
            if rec.backend != "container" or rec.state is not SandboxState.running:
                if sid in self._series:  # paused: CPU counts again from the resume
                    self._series[sid].last, self._series[sid].was_paused = None, True
                continue
            series = self._series_of(rec)
            reading = _read(series)
            if reading is None:
                continue
            if series.last is None and series.was_paused:
                series.last = reading  # the first reading after a resume: a baseline only
                continue
            series.push(reading, _cpu_pct(series, reading, rec.created_at))
            series.last = reading

    def _series_of(self, rec: Record) -> _Series:
        series = self._series.get(rec.id)
        if series is None:
            disk_mb = rec.handle.disk_limit() or 0
            series = _Series(
                base=rec.created_at,
                cpu_count=max(1, math.ceil(rec.spec.cpu_cores_limit)),
                mem_total=rec.spec.memory_limit_mb << 20,
                disk_total=disk_mb << 20,
                paths=_paths(rec.id),
            )
            if disk_mb:
                series.referenced = _quota_file(self._backend_of(rec), rec.id)
            self._series[rec.id] = series
        return series

    def last_memory(self) -> Iterator[tuple[int, int]]:
        """(anonymous, page cache) bytes of each running container sandbox at its last sample
        (the edge's Prometheus collector: no reading of its own)."""
        for series in self._series.values():
            if series.last is not None:
                yield series.last.mem_used, series.last.mem_cache

    def query(self, sandbox_id: str, start: float | None, end: float | None) -> list[MetricSample]:
        """The sandbox's samples with ``start <= ts <= end`` (either open), oldest first, and a
        fresh one when the range reaches now. ``sandbox_id`` must be one the edge holds."""
        each = self._live().get(sandbox_id)
        if each is None:
            return []
        rec: Record = each.record
        if rec.backend != "container":
            return []
        series = self._series_of(rec)
        out = series.samples()
        if rec.state is SandboxState.running:
            reading = _read(series)
            if reading is not None and (series.last is not None or not series.was_paused):
                out.append(series._sample(_fresh_row(series, reading, rec.created_at)))
        return [s for s in out if (start is None or s.ts >= start) and (end is None or s.ts <= end)]


def _fresh_row(series: _Series, r: _Reading, started_at: float) -> array[float]:
    """A row for a reading that is not kept (the ring holds the interval's samples only)."""
    return array(
        "f",
        (r.at - series.base, _cpu_pct(series, r, started_at), r.mem_used, r.mem_cache, r.disk_used),
    )


def time_param(request: web.Request, name: str) -> float | None:
    """A unix time in seconds (``1712345678`` or ``1712345678.25``) from 0 to
    :data:`MAX_UNIX_S`, None when absent (the edge's ``/metrics`` route)."""
    raw = request.query.get(name)
    if raw is None:
        return None
    if not _UNIX_TIME.fullmatch(raw) or float(raw) > MAX_UNIX_S:
        raise InvalidRequest(f"query parameter {name!r} must be a unix time from 0 to {MAX_UNIX_S}")
    return float(raw)
