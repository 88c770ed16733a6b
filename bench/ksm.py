"""FnCall pools under KSM: the memory a pool sandbox holds, merged against unmerged.

    .venv/bin/python bench/ksm.py [--pool-size 8] [--preload MODULES] [--calls 200]

Two embedded nodes, one after the other, each with one FnCall pool of --pool-size sandboxes
preloading --preload (on `debian:bookworm-cc`, which `./setup.sh up` or `dsec base` builds):
  - the baseline: a node with `ksm` off, whose runners are started as before (randomized
    layout, nothing marked mergeable);
  - a node with `ksm` on: it starts ksmd if it is stopped (with the kernel's scan settings,
    printed), and its runners come up `--mergeable`, laid out alike (fncall/runner/layout.py).
For each, with the core count: the anonymous memory each pool sandbox's memory cgroup is
charged (`rss` of memory.stat; a page KSM merged is charged once, to one of them), p50/p99 over
the pool, and the ratio merged / unmerged; what ksmd reports saved (pages_sharing) per
sandbox; how long merging took to settle (no change in pages_sharing over two full scans) and
the CPU ksmd spent on it; and a python call's latency p50/p99 (--calls, one at a time) on each
node, with its ratio: a call writes to the pages it shares, merged or forked.
KSM's `run` is restored at the end, however the bench ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from _node import scratch_node
from _rl.host import memory_stat
from _stats import pct
from _vm.host import ksm_counter
from dsec import DSecClient, _linux
from dsec.density.ksm import KSM
from dsec.density.ksm import users as ksm_users
from dsec.density.swap import SwapConfig
from dsec.edge.fncall.pool import PoolConfig
from dsec.images.base import TOOLCHAIN_REF

PRELOAD = "json,decimal,fractions,statistics,email.parser,http.client,xml.etree.ElementTree,sqlite3,asyncio"
CODE = "print(sum(range(1000)))"
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def ksmd_cpu_s() -> float:
    """CPU seconds the ksmd kernel thread has used (utime + stime)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text() == "ksmd\n" and (fields := _linux.stat_fields(comm.parent.name)):
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


@contextlib.contextmanager
def ksm_run_restored() -> Iterator[str]:
    before = (KSM / "run").read_text().strip()
    try:
        yield before
    finally:
        (KSM / "run").write_text(before)


async def settle(timeout: float) -> tuple[float, float]:
    """Wait until pages_sharing has not changed over two full scans; (seconds, ksmd CPU s)."""
    t0, cpu0 = time.monotonic(), ksmd_cpu_s()
    last, since = ksm_counter("pages_sharing"), ksm_counter("full_scans")
    first = since
    while time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.5)  # a benchmark's sampling interval, not a test's synchronisation
        now, scans = ksm_counter("pages_sharing"), ksm_counter("full_scans")
        if now != last:
            last, since = now, scans
        elif scans >= since + 2 and (now > 0 or scans >= first + 4):
            break
    return time.monotonic() - t0, ksmd_cpu_s() - cpu0


async def measure(node_ksm: bool, a: argparse.Namespace) -> dict[str, object]:
    pool = PoolConfig(size=a.pool_size, image=TOOLCHAIN_REF, max_calls=100_000, preload=a.preload.split(","))
    edge = {"fncall_pools": [pool], "swap": SwapConfig("none"), "ksm": node_ksm}
    async with scratch_node("ksm", a.layers, lambda scratch: edge) as node:
        out: dict[str, object] = {}
        if node_ksm:
            out["settle_s"], out["ksmd_cpu_s"] = await settle(a.settle_timeout)
        sandboxes = list(node.edge.pools["default"]._workers)
        out["rss"] = [memory_stat(sid)["rss"] for sid in sandboxes]  # a page KSM merged: charged once
        out["saved"] = ksm_counter("pages_sharing") * PAGE if node_ksm else 0
        async with DSecClient(node.url, node.api_key) as client:
            lat = []
            for _ in range(a.calls):
                t = time.perf_counter()
                r = await client.fncall({"language": "python", "code": CODE})
                lat.append(time.perf_counter() - t)
                assert r.status == "ok", r
        out["lat"] = lat
    return out


def spread(xs: list[float] | list[int], unit: float, name: str) -> str:
    return f"p50 {pct(xs, 50) / unit:.2f} / p99 {pct(xs, 99) / unit:.2f} {name}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--preload", default=PRELOAD)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--settle-timeout", type=float, default=600.0)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    a = ap.parse_args()
    if not (KSM / "run").exists():
        raise SystemExit("this kernel has no KSM (CONFIG_KSM)")
    users = ksm_users()
    if users:  # it stops and starts the host's one ksmd: theirs too
        raise SystemExit(f"another DSec node on this machine uses ksmd ({', '.join(users)}): stop it first")
    scan = f"pages_to_scan {ksm_counter('pages_to_scan')}, sleep_millisecs {ksm_counter('sleep_millisecs')}"
    print(f"cores {os.cpu_count()}  pool of {a.pool_size} on {TOOLCHAIN_REF}  preload {a.preload}")
    with ksm_run_restored() as before:
        print(f"ksmd found run={before}; kernel scan settings: {scan}")
        (KSM / "run").write_text("0")  # both nodes start from a stopped ksmd and no merged pages
        base = await measure(False, a)
        merged = await measure(True, a)
    b_rss, m_rss = base["rss"], merged["rss"]
    b_lat, m_lat = base["lat"], merged["lat"]
    saved = merged["saved"]
    assert isinstance(b_rss, list) and isinstance(m_rss, list) and isinstance(saved, int)
    assert isinstance(b_lat, list) and isinstance(m_lat, list)
    print(
        f"anonymous memory per pool sandbox: unmerged {spread(b_rss, MIB, 'MiB')},"
        f" merged {spread(m_rss, MIB, 'MiB')}; in all {sum(m_rss) / MIB:.1f} vs"
        f" {sum(b_rss) / MIB:.1f} MiB (ratio {sum(m_rss) / sum(b_rss):.2f}x)"
    )
    print(
        f"ksmd: pages_sharing {saved / MIB / a.pool_size:.2f} MiB per sandbox (counts every mapping:"
        f" a runner and its zygote map the same pages), settled in {merged['settle_s']:.1f} s"
        f" using {merged['ksmd_cpu_s']:.2f} s of CPU"
    )
    print(
        f"python call, one at a time: merged {spread(m_lat, 1e-3, 'ms')}, unmerged"
        f" {spread(b_lat, 1e-3, 'ms')} (ratio {pct(m_lat, 50) / pct(b_lat, 50):.2f}x)"
    )


if __name__ == "__main__":
    asyncio.run(main())
