"""Phase B: the real create path over HTTP, driven by an open-loop ladder of arrival rates.

Each step holds one arrival rate for a few seconds; a step passes when every request was
answered, the achieved rate kept up (>= 95% of the offered one) and p99 stayed under 100 ms.
The ladder stops after two failing steps in a row, or one that could not even drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import secrets
from multiprocessing.connection import Connection
from typing import Any

from _controlplane.apiproc import ServerConfig, serve
from _controlplane.loadgen import LoadGen, Run
from _stats import pct
from dsec.iam import Quota, open_iam_store
from dsec.protocol.models import BatchCreateRequest, ContainerSpec, CreateRequest

P99_LIMIT_S = 0.100
STEPS = [250, 500, 1000, 1500, 2000, 2500, 3000, 4000, 5000, 6000, 8000, 10000, 12000, 16000, 20000]
QUICK_STEPS = [500, 1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000]
SPAWN = mp.get_context("spawn")  # a fresh interpreter: no inherited event loop or threads


def http_request(method: str, path: str, url: str, key: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\nAuthorization: Bearer {key}\r\n"
    )
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def row(run: Run) -> str:
    cpu = run.server_cpu_s / run.done * 1e6 if run.done else float("nan")
    loop = run.server_loop_cpu_s / run.done * 1e6 if run.done else float("nan")
    offered = f"{run.offered:10,.0f}" if run.offered is not None else "    closed"
    errors = sum(run.errors.values())
    return (
        f"  {offered} {run.achieved:11,.0f} {pct(run.latencies, 50) * 1000:8.2f} "
        f"{pct(run.latencies, 99) * 1000:8.2f} {max(run.latencies, default=0) * 1000:8.1f} "
        f"{errors:7d} {cpu:7.0f} us {loop:7.0f} us  {'ok' if run.ok(P99_LIMIT_S) else 'FAIL'}"
    )


HEADER = "  offered/s  achieved/s   p50 ms   p99 ms   max ms  errors  server CPU/req (loop)"


async def setup_iam(url: str, quota: bool) -> tuple[str, str, str]:
    """A project for the load and an admin key; returns (project, key, what the quota is)."""
    iam = await open_iam_store(url)
    try:
        name = "bench-" + secrets.token_hex(4)
        # Large enough never to bind, small enough for PostgreSQL's 32-bit counters.
        q = Quota(sandboxes=1_000_000, cpu_cores=1_000_000, memory_mib=2_000_000_000) if quota else None
        info = await iam.create_project("root", name, q)
        key = await iam.issue_key(admin=True, name="bench controlplane")
    finally:
        await iam.close()
    what = f"quota {q} (the ledger path)" if q else "no finite quota along its chain"
    return info.id, key, what


class Servers:
    """The apiserver processes, driven over pipes."""

    def __init__(self, configs: list[ServerConfig]) -> None:
        self.procs: list[Any] = []
        self.pipes: list[Connection] = []
        self.urls: list[str] = []
        for cfg in configs:
            parent, child = SPAWN.Pipe()
            p = SPAWN.Process(target=serve, args=(cfg, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.pipes.append(parent)

    async def start(self) -> None:
        for pipe in self.pipes:
            if not await asyncio.to_thread(pipe.poll, 60):
                raise RuntimeError("an apiserver process did not start within 60 s")
            self.urls.append(pipe.recv())

    async def ask(self, i: int, *cmd: Any) -> Any:
        self.pipes[i].send(cmd)
        return await asyncio.to_thread(self.pipes[i].recv)

    async def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    await self.ask(i, "stop")
                except (EOFError, OSError):
                    pass
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)


async def ladder(gen: LoadGen, label: str, steps: list[int], duration: float, expected: int) -> list[Run]:
    print(f"  {label}\n{HEADER}")
    runs, failed = [], 0
    for rate in steps:
        run = await gen.open_loop(label, rate, duration, expected)
        print(row(run), flush=True)
        if run.error_sample:
            print(f"    first error: {run.error_sample[:200]}")
        runs.append(run)
        failed = 0 if run.ok(P99_LIMIT_S) else failed + 1
        if failed >= 2 or not run.drained:  # broken twice in a row, or hopelessly behind
            break
        await asyncio.sleep(0.5)
    return runs


def best(runs: list[Run]) -> Run | None:
    passing = [r for r in runs if r.ok(P99_LIMIT_S)]
    return max(passing, key=lambda r: r.offered or 0) if passing else None


async def phase_http(a: argparse.Namespace, iam_url: str, project: str, key: str) -> dict[str, Any]:
    configs = [
        ServerConfig(
            iam_url,
            index=i,
            nodes=a.nodes,
            capacity=a.capacity,
            edge_latency_s=a.edge_latency_ms / 1000,
            wire=not a.no_wire,
            poll_s=a.poll_s,
            reconcile=not a.no_reconcile,
        )
        for i in range(a.apiservers)
    ]
    servers = Servers(configs)
    out: dict[str, Any] = {}
    try:
        await servers.start()
        body = CreateRequest(spec=ContainerSpec(image="debian:bookworm"), project=project).model_dump_json()
        creates = [http_request("POST", "/v1/sandboxes", u, key, body.encode()) for u in servers.urls]
        pids = [p.pid for p in servers.procs]
        gen = LoadGen(servers.urls, a.connections)
        gen.watch_cpu(pids)
        await gen.open(creates)
        steps, dur = (QUICK_STEPS, 1.5) if a.quick else (STEPS, a.step_s)
        await gen.open_loop("warm-up", steps[0], 1.0, 201)  # first requests pay imports, caches
        print(f"\n== B. create path over HTTP: {a.apiservers} apiserver process(es), {a.connections} conns")
        print("  (server CPU/req: all apiserver threads, then the event loops alone, per answered request;")
        print(
            "   background work included: watcher polls, quota reconciliation. Latency from scheduled send)"
        )
        out["create_steps"] = await ladder(gen, "POST /v1/sandboxes (create)", steps, dur, 201)
        sat = LoadGen(servers.urls, a.saturation_conns)
        sat.watch_cpu(pids)
        await sat.open(creates)
        await servers.ask(0, "stages")  # forget the ladder's
        out["create_saturation"] = await sat.closed_loop("create", dur, 201)
        out["stages"] = await servers.ask(0, "stages")
        print(f"  create at saturation ({a.saturation_conns} connections, closed loop)\n{HEADER}")
        print(row(out["create_saturation"]))
        print("  where a create's time goes at saturation (wall time in apiserver 0, queueing included):")
        for name, st in out["stages"].items():
            ms = f"mean {st['mean_ms']:7.2f} ms  p50 {st['p50_ms']:7.2f}  p99 {st['p99_ms']:7.2f}"
            print(f"    {name:<18} {ms}")
        out["batch"] = await batch_phase(a, servers, project, key, dur)
        if not a.no_profile:
            await servers.ask(0, "profile-start")
            await sat.closed_loop("create (profiled)", dur, 201)
            out["profile"] = await servers.ask(0, "profile-stop", 14)
        # One live sandbox per apiserver to read back: its node belongs to that process.
        ids = [json.loads(await one_create(u, creates[i]))["id"] for i, u in enumerate(servers.urls)]
        gets = [
            http_request("GET", f"/v1/sandboxes/{sid}", u, key)
            for sid, u in zip(ids, servers.urls, strict=True)
        ]
        await gen.open(gets)
        await sat.open(gets)
        out["get_steps"] = await ladder(gen, "GET /v1/sandboxes/{id} (baseline)", steps, dur, 200)
        out["get_saturation"] = await sat.closed_loop("get", dur, 200)
        print(f"  GET at saturation ({a.saturation_conns} connections, closed loop)\n{HEADER}")
        print(row(out["get_saturation"]))
        await gen.close()
        await sat.close()
        out["servers"] = [await servers.ask(i, "stats") for i in range(len(servers.procs))]
    finally:
        await servers.stop()
    for i, st in enumerate(out.get("servers", [])):
        rec = st["reconcile"].get("reconcile pass")
        passes = (
            f"quota reconcile passes {rec['n']}, mean {rec['mean_ms']:.0f} ms, max {rec['max_ms']:.0f} ms"
            if rec
            else "no quota reconcile pass"
        )
        print(f"  apiserver {i}: {st['live']:,} live at the end, RSS {st['rss_mib']:.0f} MiB; {passes}")
    if "profile" in out:
        print("  apiserver event loop at create saturation (cProfile, CPU time of the loop's thread)")
        for title, part in (("most own time", "own"), ("dsec functions, with callees", "dsec_cumulative")):
            print(f"   {title}:")
            for f in out["profile"][part][:12]:
                print(f"    {f['own_share']:6.1%} own {f['cumulative_share']:6.1%} cum  {f['function']}")
    return out


async def batch_phase(a: argparse.Namespace, servers: Servers, project: str, key: str, dur: float) -> Run:
    """Batch creates (one request, ``a.batch`` sandboxes), closed loop: sandboxes/s and the
    request's latency, which bounds every sandbox's in it."""
    spec = ContainerSpec(image="debian:bookworm")
    body = BatchCreateRequest(spec=spec, project=project, count=a.batch).model_dump_json().encode()
    gen = LoadGen(servers.urls, a.batch_conns)
    gen.watch_cpu([p.pid for p in servers.procs])
    await gen.open([http_request("POST", "/v1/sandboxes/batch", u, key, body) for u in servers.urls])
    run = await gen.closed_loop(f"batch of {a.batch}", dur, 201)
    await gen.close()
    print(f"  batch creates ({a.batch_conns} connections, {a.batch} sandboxes per request, closed loop)")
    p50, p99 = pct(run.latencies, 50) * 1e3, pct(run.latencies, 99) * 1e3
    verdict = "ok" if run.ok(0.1) else "FAIL"
    print(
        f"    {run.achieved * a.batch:9,.0f} sandboxes/s   request p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"
        f"  (each sandbox's create ends within its request)  {verdict}"
    )
    return run


async def one_create(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
    response = await reader.read()
    writer.close()
    return response.split(b"\r\n\r\n", 1)[1]
