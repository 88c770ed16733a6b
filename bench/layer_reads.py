"""What the scan behind ``dsec_ondemand_read_bytes`` costs, on a real image's layers.

    .venv/bin/python bench/layer_reads.py [--layers DIR] [--image debian:bookworm] [--reps 20]

Mounts the image's layers from the store (as an edge does, under a mount root of its own),
then times, alternating, a bare walk of the same trees (``os.scandir``, no file opened: what
any ``find`` pays, the baseline) and the scan (``dsec.images.layer_reads.scan``: one open and
one ``cachestat`` per regular file). Prints the core count, the files, p50/p99 wall and CPU
time of both, their ratio, and the scan's share of a core at one scan per minute (the
scanner's most). Needs root (mounts); unmounts everything it mounted, also on failure.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _stats import pct
from dsec.images.layer_reads import SCAN_INTERVAL_S, scan
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore


def walk(roots: list[Path]) -> int:
    files = 0
    for root in roots:
        stack = [os.fspath(root)]
        while stack:
            for entry in list(os.scandir(stack.pop())):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    files += 1
    return files


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def line(name: str, wall: list[float], cpu: list[float]) -> str:
    return (
        f"  {name:28s} wall p50 {pct(wall, 50) * 1e3:8.1f} ms p99 {pct(wall, 99) * 1e3:8.1f} ms"
        f"   CPU p50 {pct(cpu, 50) * 1e3:8.1f} ms p99 {pct(cpu, 99) * 1e3:8.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--image", default="debian:bookworm")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    store = LayerStore(a.layers)
    digests = [layer.digest for layer in store.resolve_image(a.image)]
    with tempfile.TemporaryDirectory(prefix="dsec-bench-reads-") as tmp:
        mounts = LayerMounts(Path(tmp) / "mnt")
        try:
            roots = [mounts.acquire_layer(store, d) for d in digests]
            result = scan(roots)
            files = walk(roots)
            print(f"cores {os.cpu_count()}  image {a.image}: {len(roots)} layers, {files} files")
            print(f"  page cache of its files now {result.cached_bytes / 2**20:.1f} MiB")
            walks: list[tuple[float, float]] = []
            scans: list[tuple[float, float]] = []
            for _ in range(a.reps):
                walks.append(timed(lambda: walk(roots)))
                scans.append(timed(lambda: scan(roots)))
            print(line("walk (baseline)", [w for w, _ in walks], [c for _, c in walks]))
            print(line("scan (open + cachestat)", [w for w, _ in scans], [c for _, c in scans]))
            ratio = pct([c for _, c in scans], 50) / max(pct([c for _, c in walks], 50), 1e-9)
            share = pct([c for _, c in scans], 50) / SCAN_INTERVAL_S * 100
            every = f"at one scan per {SCAN_INTERVAL_S:g} s: {share:.3f} % of a core"
            print(f"  scan / walk CPU {ratio:.2f}x; {every}")
        finally:
            mounts.unmount_all(lazy=True)


if __name__ == "__main__":
    main()
