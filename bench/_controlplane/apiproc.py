"""The apiserver under test: the real :class:`~dsec.apiserver.app.ApiServer` over simulated
edges, built the way ``dsec apiserver`` builds one, in a process of its own.

The parent drives it over a pipe: ``("stats",)``, ``("stages",)`` (which also resets them),
``("profile-start",)``, ``("profile-stop", top_n)`` and ``("stop",)``; the first message it
sends is its URL.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _controlplane.procfs import settled_rss_mib
from _controlplane.simedge import SimulatedEdgeLink, simulated_edges
from dsec.apiserver.app import ApiServer
from dsec.edge.link import EdgeLink
from dsec.iam import IamStore, open_iam_store
from dsec.images.store import LayerStore
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.http import listen


@dataclass(frozen=True)
class ServerConfig:
    iam_url: str
    index: int = 0  # which apiserver: its simulated nodes are named s<index>-nNNN
    nodes: int = 160
    capacity: int = 3200
    edge_latency_s: float = 0.0
    wire: bool = True
    poll_s: float = 1.0
    reconcile: bool = True
    stages: bool = True  # time each step of a create (off where memory is measured)


class Stages:
    """Wall time of each step of a create, taken by wrapping the objects the route calls (no
    change to src): where a create's latency goes, queueing included."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner: Callable[..., Awaitable[Any]] | None = getattr(obj, attr, None)
        if inner is None:
            return  # that step is not in this version of the create path
        times = self.times.setdefault(name, [])

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t)

        setattr(obj, attr, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, xs in self.times.items():
            s = sorted(xs)
            if s:
                out[name] = {
                    "n": len(s),
                    "mean_ms": sum(s) / len(s) * 1000,
                    "p50_ms": s[len(s) // 2] * 1000,
                    "p99_ms": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1000,
                    "max_ms": s[-1] * 1000,
                }
            xs.clear()
        return out


class Apiserver:
    """One apiserver as ``dsec apiserver`` assembles it, over simulated edges of its own."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.edges: dict[str, SimulatedEdgeLink] = simulated_edges(
            f"s{cfg.index}-n", cfg.nodes, cfg.capacity, latency_s=cfg.edge_latency_s, wire=cfg.wire
        )
        links: dict[str, EdgeLink] = dict(self.edges)
        self.links = links
        self.watcher = Watcher(links, interval_s=cfg.poll_s)
        self.placement = Placement(self.watcher)
        self._scratch = tempfile.TemporaryDirectory(prefix="dsec-bench-cp-")
        self.stages = Stages()
        self.passes = Stages()  # quota reconciliation, every 5 s: its cost grows with live sandboxes
        self.iam: IamStore
        self.api: ApiServer

    async def start(self) -> None:
        self.iam = await open_iam_store(self.cfg.iam_url)
        store = LayerStore(Path(self._scratch.name) / "layers")
        # Creates name `debian:bookworm` and the apiserver checks the key may use it: a tiny
        # stand-in (the simulated edges never mount it).
        tiny = Path(self._scratch.name) / "tiny"
        tiny.mkdir()
        (tiny / "hello").write_text("stand-in for the base image\n")
        store.import_path(tiny, "debian:bookworm")
        self.api = ApiServer(self.links, self.placement, store, self.iam)
        if self.cfg.stages:
            self._instrument()
        await self.watcher.start()
        if self.cfg.reconcile:
            self.api.tenancy.start(self.links)

    def _instrument(self) -> None:
        routes = self.api.sandboxes
        self.stages.wrap(routes, "create", "handler")  # before app() registers the bound method
        self.stages.wrap(routes.tenancy, "reserve", "iam reserve")
        self.stages.wrap(routes.tenancy, "bind", "iam bind")
        self.stages.wrap(routes.tenancy, "move", "iam move")  # when a retry changes node
        self.stages.wrap(routes.placement, "choose", "placement choose")
        for link in self.edges.values():
            self.stages.wrap(link, "create", "edge create")
        self.passes.wrap(routes.tenancy, "reconcile", "reconcile pass")

    def live(self) -> int:
        return sum(len(e.live) for e in self.edges.values())

    async def close(self) -> None:
        await self.api.tenancy.close()
        await self.watcher.close()
        await self.iam.close()
        self._scratch.cleanup()


def project_cache_size(api: ApiServer) -> int:
    # Private to the create route; read defensively so a rename there does not break the bench.
    cache = getattr(api.sandboxes, "_projects", None)
    return len(cache) if cache is not None else -1


def top_functions(prof: cProfile.Profile, n: int) -> dict[str, list[dict[str, Any]]]:
    """The ``n`` functions with the most own time, and the ``n`` dsec functions with the most
    time including callees, each with its share of the profiled time."""
    raw: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1.0

    def rows(items: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
        return [
            {
                "function": f"{'/'.join(Path(file).parts[-2:])}:{line}({name})",
                "own_share": tt / total,
                "cumulative_share": ct / total,
                "calls": nc,
            }
            for (file, line, name), (_cc, nc, tt, ct, _callers) in items
        ]

    own = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    ours = [kv for kv in raw.items() if "/dsec/" in kv[0][0]]
    cumulative = sorted(ours, key=lambda kv: kv[1][3], reverse=True)[:n]
    return {"own": rows(own), "dsec_cumulative": rows(cumulative)}


def serve(cfg: ServerConfig, conn: Connection) -> None:
    """A process's main: serve on 127.0.0.1 until told to stop."""
    asyncio.run(_serve(cfg, conn))


async def _serve(cfg: ServerConfig, conn: Connection) -> None:
    server = Apiserver(cfg)
    await server.start()
    runner, url = await listen(server.api.app(), "127.0.0.1", 0)
    conn.send(url)
    prof: cProfile.Profile | None = None
    try:
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd[0] == "stats":
                conn.send(
                    {
                        "rss_mib": settled_rss_mib(),
                        "live": server.live(),
                        "project_cache": project_cache_size(server.api),
                        "reconcile": server.passes.summary(),
                    }
                )
            elif cmd[0] == "stages":
                conn.send(server.stages.summary())
            elif cmd[0] == "profile-start":
                # CPU time of this thread (the event loop's): wall time would charge whatever
                # runs when the SQLite thread holds the GIL with the wait.
                prof = cProfile.Profile(time.thread_time)
                prof.enable()
                conn.send(True)
            elif cmd[0] == "profile-stop":
                assert prof is not None
                prof.disable()
                conn.send(top_functions(prof, int(cmd[1])))
                prof = None
            elif cmd[0] == "stop":
                break
    finally:
        await runner.cleanup()
        await server.close()
        conn.send("stopped")
