"""Phase C: what an apiserver holds per live sandbox.

In one process: the apiserver over simulated edges, driven through the route handlers
themselves (no HTTP: the wire costs time, not memory). Resident memory is read after a full
collection, in two rounds of ``n`` creates:
  1. the edges count their sandboxes but keep no entry, so any growth is the apiserver's;
     then a GET of as many sandboxes fills its project cache (bounded), the only
     per-sandbox structure it has;
  2. the edges keep an entry per sandbox, as real ones do on their own nodes: the growth
     beyond round 1's is the edges' share, the baseline.
RSS moves in allocator pages, so round 1 is repeated smaller under tracemalloc, which counts
the Python heap exactly and names the files that allocated what stays.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from _controlplane.apiproc import Apiserver, ServerConfig, project_cache_size
from _controlplane.procfs import settled_rss_mib
from _controlplane.simedge import fast_sandbox_id
from dsec.apiserver._http import PRINCIPAL
from dsec.iam import Principal


@dataclass(frozen=True)
class MemoryConfig:
    server: ServerConfig
    key: str
    body: bytes  # a create request, as the load generator sends it
    sandboxes: int = 100_000
    warmup: int = 2_000
    traced: int = 5_000
    concurrency: int = 64


class _Request(dict[Any, Any]):
    """What the create and get handlers use of a request, without HTTP. (aiohttp's
    make_mocked_request builds a dozen Mock objects: ~3.5 ms each, 10x the handler.)"""

    def __init__(self, body: bytes = b"", match_info: dict[str, str] | None = None) -> None:
        super().__init__()
        self._body = body
        self.match_info = match_info or {}

    async def read(self) -> bytes:
        return self._body


async def _many(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> None:
    counter = itertools.count()

    async def worker() -> None:
        while (i := next(counter)) < n:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _by_file(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> dict[str, int]:
    """Bytes still held, by the innermost dsec or bench source file that allocated them."""
    out: dict[str, int] = defaultdict(int)
    for stat in after.compare_to(before, "traceback"):
        where = "other (interpreter, libraries)"
        for frame in reversed(stat.traceback):  # most recent call last
            parts = Path(frame.filename).parts
            for root in ("dsec", "_controlplane"):
                if root in parts:
                    where = "/".join(parts[parts.index(root) :])
                    break
            else:
                continue
            break
        out[where] += stat.size_diff
    return dict(out)


async def reconcile_pass(server: Apiserver) -> dict[str, float]:
    """One pass of quota reconciliation over every edge: wall and event-loop CPU seconds."""
    live = server.live()
    wall, cpu = time.perf_counter(), time.thread_time()
    await server.api.tenancy.reconcile(server.links, grace_s=0)
    return {"live": live, "wall_s": time.perf_counter() - wall, "loop_cpu_s": time.thread_time() - cpu}


def measure(cfg: MemoryConfig) -> dict[str, Any]:
    """A process's main (see bench/controlplane.py): returns the figures."""
    return asyncio.run(_measure(cfg))


async def _measure(cfg: MemoryConfig) -> dict[str, Any]:
    server = Apiserver(cfg.server)
    await server.start()
    try:
        principal: Principal = await server.iam.authenticate(cfg.key)
        routes = server.api.sandboxes
        edges = list(server.edges.values())

        async def create(_: int) -> None:
            req = _Request(cfg.body)
            req[PRINCIPAL] = principal
            resp = await routes.create(cast(web.Request, req))
            assert isinstance(resp, web.Response) and resp.status == 201

        async def get(i: int) -> None:
            # A fresh ID each time, which the edges (keeping nothing) answer for: the bench
            # holds no list of IDs that would count as the apiserver's memory.
            edge = edges[i % len(edges)]
            req = _Request(match_info={"id": fast_sandbox_id(edge.node, edge.epoch)})
            req[PRINCIPAL] = principal
            assert (await routes.get(cast(web.Request, req))).status == 200

        def keep(on: bool) -> None:
            for edge in edges:
                edge.keep = on
                edge.live.clear()

        async def round_(n: int, size: Callable[[], float], gets: bool = True) -> list[float]:
            """Settled size, after n creates, after n GETs."""
            sizes = [size()]
            await _many(n, cfg.concurrency, create)
            sizes.append(size())
            if gets:
                await _many(n, cfg.concurrency, get)
                sizes.append(size())
            return sizes

        keep(False)
        await _many(cfg.warmup, cfg.concurrency, create)
        await _many(cfg.warmup, cfg.concurrency, get)
        alone = await round_(cfg.sandboxes, settled_rss_mib)
        cache = project_cache_size(server.api)
        keep(True)
        with_edges = await round_(cfg.sandboxes, settled_rss_mib, gets=False)
        # Quota reconciliation over these edges: the first pass releases the ledger rows of
        # the sandboxes the edges do not list (round 1's), the second is a steady one.
        passes = [await reconcile_pass(server) for _ in range(2)]
        keep(False)

        tracemalloc.start(8)  # reaches a dsec frame from inside the libraries; 16 took 3x as long

        def heap_mib() -> float:
            gc.collect()
            return tracemalloc.get_traced_memory()[0] / 2**20

        before = tracemalloc.take_snapshot()
        heap = await round_(cfg.traced, heap_mib)
        held = _by_file(before, tracemalloc.take_snapshot())
        tracemalloc.stop()
        return {
            "sandboxes": cfg.sandboxes,
            "rss_alone_mib": alone,  # settled, after creates, after GETs; edges keep nothing
            "rss_with_edges_mib": with_edges,  # settled, after creates; edges keep their entries
            "project_cache_entries": cache,
            "reconcile_passes": passes,
            "traced": cfg.traced,
            "heap_mib": heap,  # settled, after creates, after GETs; edges keep nothing
            "heap_held_by_file": held,
        }
    finally:
        await server.close()
