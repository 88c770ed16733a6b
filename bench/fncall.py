"""FnCall calls per second and latency, against running the same code in a container sandbox.

    .venv/bin/python bench/fncall.py [--calls 400] [--concurrency 1,4,16] [--pool-size 2] [--preload numpy]
        [--max-calls N]

Runs an embedded node with `dsec up`'s FnCall pool (its image, preloads and recycling: options
change them) on a scratch data directory that shares the layer store of `dsec up`
(`debian:bookworm-cc` must exist: `./setup.sh up` or `dsec base` builds it).
Through the SDK and the HTTP API it measures, with the core count, p50/p99 and calls/s:
  - `fncall` of a python `print`, at each concurrency;
  - the baseline in the same run: the same program as `exec(["python3", "-c", ...])` in a
    long-lived container sandbox (a process start per call, what a platform without warm
    pools does at best: it does not even create a sandbox per call);
  - one C++ compile-and-run call, and a judged python call, for the record;
  - SandboxFusion's `/run_code` (`--run-code 1,4,16,64`): python `print(1)` in the request
    shape of SandboxFusion's client (every field it sends, `memory_limit_MB` -1), at each
    concurrency, against the floor of the same run: `python3 -c "print(1)"` started as a bare
    subprocess on the host, as many at a time (issue 29's target: >= 300/s and >= 2.5x that
    floor at 4-64 on 2 cores, p50 <= 10 ms at 1). `--only-run-code` skips the rest. `--cpu`
    adds, per level, CPU ms per call by process from /proc (this process: client, apiserver,
    edge; runners; zygotes; call processes; the rest of the machine), steadier than the rates
    on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.edge.fncall.pool import default_pool
from dsec.images.base import TOOLCHAIN_REF
from dsec.protocol.fncall import FnResult

CODE = "print(sum(range(1000)))"
EXPECTED = "499500\n"
CPP = '#include <iostream>\nint main(){long s=0; for(int i=0;i<1000;i++) s+=i; std::cout<<s<<"\\n";}'


async def drive(
    calls: int, concurrency: int, one: Callable[[], Awaitable[None]]
) -> tuple[float, list[float]]:
    """Run ``calls`` calls, ``concurrency`` at a time; returns (calls/s, latencies)."""
    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def timed() -> None:
        async with gate:
            t = time.perf_counter()
            await one()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(timed() for _ in range(calls)))
    return calls / (time.perf_counter() - t0), lat


def row(name: str, rate: float, lat: list[float], base: tuple[float, list[float]] | None) -> None:
    line = f"{name:<30} {rate:8.1f}/s  p50 {pct(lat, 50) * 1e3:7.2f} ms  p99 {pct(lat, 99) * 1e3:7.2f} ms"
    if base is not None:
        b50 = pct(base[1], 50) * 1e3
        line += f"  | baseline {base[0]:7.1f}/s p50 {b50:7.2f} ms  ratio {rate / base[0]:5.2f}x"
    print(line)


# What `sandbox_fusion.RunCodeRequest(code=..., language="python").dict()` posts.
SF_REQUEST = {
    "compile_timeout": 10,
    "run_timeout": 10,
    "memory_limit_MB": -1,
    "code": "print(1)",
    "stdin": None,
    "language": "python",
    "files": {},
    "fetch_files": [],
}


BARE_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable  # no venv startup


async def bare_python() -> None:
    proc = await asyncio.create_subprocess_exec(BARE_PYTHON, "-c", "print(1)", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert out == b"1\n" and proc.returncode == 0


def _stat_cpu(pid: int) -> tuple[float, float]:
    """(own utime+stime, reaped children's cutime+cstime) of ``pid``, in seconds; 0 once it is
    gone (a runner of another node on the host, or a recycled one: its share is then missed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def _runners() -> tuple[list[int], list[int]]:
    """(runner pids, zygote pids) of every FnCall runner on the host (the zygote: a runner's child)."""
    ppid: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"fncall-runner.py" not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            continue
    runners = [p for p, pp in ppid.items() if pp not in ppid]
    return runners, [p for p, pp in ppid.items() if pp in runners and ppid.get(pp) is not None]


def _busy() -> float:
    """Seconds of CPU the whole machine spent (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Where the CPU of a stretch of calls went, per call: this process (the client, the
    apiserver, the edge and the pool share its event loop), the runners (with the helpers they
    fork), the zygotes, the call processes (reaped by the zygotes) and the rest of the machine
    (kernel threads such as network-namespace teardown, and anything else running)."""

    def __enter__(self) -> CpuMeter:
        self.runners, self.zygotes = _runners()
        self.t0, self.busy0 = os.times(), _busy()
        self.r0 = [_stat_cpu(p) for p in self.runners]
        self.z0 = [_stat_cpu(p) for p in self.zygotes]
        return self

    def __exit__(self, *_: object) -> None:
        t1, busy1 = os.times(), _busy()
        r1 = [_stat_cpu(p) for p in self.runners]
        z1 = [_stat_cpu(p) for p in self.zygotes]
        self.own = t1.user + t1.system - self.t0.user - self.t0.system
        children0 = self.t0.children_user + self.t0.children_system
        self.own_children = t1.children_user + t1.children_system - children0
        pairs = [(a, b) for a, b in zip(r1, self.r0, strict=True) if a != (0.0, 0.0)]
        self.runner = sum(a[0] + a[1] - b[0] - b[1] for a, b in pairs)
        zpairs = [(a, b) for a, b in zip(z1, self.z0, strict=True) if a != (0.0, 0.0)]
        self.zygote = sum(a[0] - b[0] for a, b in zpairs)
        self.calls = sum(a[1] - b[1] for a, b in zpairs)
        self.busy = busy1 - self.busy0

    def line(self, n: int) -> str:
        rest = self.busy - self.own - self.own_children - self.runner - self.zygote - self.calls
        parts = (
            ("bench process", self.own),
            ("runners", self.runner),
            ("zygotes", self.zygote),
            ("call processes", self.calls),
            ("bare children", self.own_children),
            ("rest of machine", rest),
            ("all", self.busy),
        )
        return "cpu ms/call: " + ", ".join(f"{name} {v / n * 1e3:.2f}" for name, v in parts)


async def run_code_levels(url: str, levels: list[int], calls: int, cpu: bool = False) -> None:
    body = json.dumps(SF_REQUEST).encode()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                answer = await resp.json()
            assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "1\n", answer

        await drive(16, 4, one)  # warm: connections, every pool sandbox
        await drive(8, 2, bare_python)
        for c in levels:
            nbase = max(40, calls // 4)
            with CpuMeter() as floor_cpu:
                base = await drive(nbase, c, bare_python)
            with CpuMeter() as call_cpu:
                rate, lat = await drive(calls, c, one)
            row(f"/run_code print(1) (conc. {c})", rate, lat, base)
            if cpu:
                print(f"{'':<30} floor {floor_cpu.line(nbase)}")
                print(f"{'':<30} calls {call_cpu.line(calls)}")
            if c > 1:
                bound = c / rate * 1.5 * 1e3
                print(f"{'':<30} p99 bound at this rate (c/throughput x 1.5): {bound:7.2f} ms")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--pool-size", type=int, default=2)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--run-code", default="1,4,16,64", help="concurrencies for /run_code ('' to skip)")
    ap.add_argument("--only-run-code", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="/run_code: CPU per call by process, from /proc")
    preload_help = "modules the pool preloads (default: `dsec up`'s pool's, numpy); '' for none"
    ap.add_argument("--preload", default=None, help=preload_help)
    recycle_help = "calls a pool sandbox serves before it is replaced (default: `dsec up`'s)"
    ap.add_argument("--max-calls", type=int, default=None, help=recycle_help)
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]

    pool = default_pool(a.pool_size)  # what `dsec up` runs, recycling included
    if a.preload is not None:
        pool.preload = [m for m in a.preload.split(",") if m]
    if a.max_calls is not None:
        pool.max_calls = a.max_calls
    print(
        f"cores {os.cpu_count()}  python {sys.version.split()[0]}  pool of {a.pool_size} on {pool.image}"
        f"  preloading {pool.preload or 'nothing'}  replaced after {pool.max_calls} calls"
    )
    async with scratch_node("fncall", a.layers, lambda scratch: {"fncall_pools": [pool]}) as node:
        sf_levels = [int(c) for c in a.run_code.split(",") if c]
        if sf_levels:
            url = f"{node.url}/sandboxfusion/{node.api_key}/run_code"
            await run_code_levels(url, sf_levels, a.calls, a.cpu)
        if a.only_run_code:
            return
        async with DSecClient(node.url, node.api_key) as client:
            sandbox = await client.run_container(DSecContainerRunArgs(container_image=TOOLCHAIN_REF))

            async def fn() -> None:
                r = await client.fncall({"language": "python", "code": CODE})
                assert r.stdout == EXPECTED, r

            async def cold() -> None:
                r = await sandbox.exec(["python3", "-c", CODE])
                assert r.stdout == EXPECTED, r

            await drive(8, 2, fn)  # warm: page cache, connections
            await drive(8, 2, cold)
            for c in levels:
                base = await drive(max(40, a.calls // 4), c, cold)
                rate, lat = await drive(a.calls, c, fn)
                row(f"fncall python (concurrency {c})", rate, lat, base)
            await sandbox.stop()

            for name, task in (
                ("c++ compile + run", {"language": "cpp", "code": CPP}),
                ("python judged", {"language": "python", "code": CODE, "expected_stdout": EXPECTED}),
            ):
                results: list[FnResult] = []

                async def call(task: dict[str, str] = task, results: list[FnResult] = results) -> None:
                    results.append(await client.fncall(task))

                rate, lat = await drive(20, 1, call)
                assert all(r.status == "ok" for r in results), results[-1]
                row(name, rate, lat, None)


if __name__ == "__main__":
    asyncio.run(main())
