"""Layer data on demand from a remote filesystem vs eager pulls, measured in the same run.

    .venv/bin/python bench/ondemand.py [--reps 5] [--delay-ms 2] [--burst 64] [--images 8]

Needs root, erofs-utils, openssh-server, openssh-client, sshfs, iproute2. The "remote"
filesystem is sshfs to an OpenSSH server in a network namespace the bench creates (veth pair,
private port, throwaway host and client keys, internal-sftp read-only and chrooted to the blob
directory). This kernel has no ``sch_netem``, so a TCP relay in that namespace delays every
byte by ``--delay-ms`` in each direction (see bench/_ondemand/relay.py).

Layers are split EROFS images (``dsec.images.ondemand``): a small metadata image, copied to
local disk at first use, and a data blob. On demand, the blob is read in place through sshfs;
eager, it is first copied whole to local disk (the metadata image too). Both mount
file-backed, then an overlay with a local upper dir, then ``unshare -m chroot`` runs
/app/workload.py from the image (it prints ``ready`` after interpreter start-up, then reads
< 10% of the image; bench/_ondemand/tree.py describes the images). Every phase starts cold:
sync + drop_caches (server side included).

Prints, with the core count:
  (a) bytes received from the store (host veth rx counter) for start-up plus the workload on a
      >= 2 GiB image, as a share of the image, for three readahead configurations;
      target <= 15%;
  (b) time to first output, on demand vs eager, p50/p99 over --reps cold runs; target >= 5x;
  (c) a burst of --burst sandbox starts over --images distinct images, --concurrency at a time,
      on a cold node: total time and local disk bytes written (write_bytes of /proc/self/io,
      which covers the copies, metadata and the sandboxes' uppers; the disk's machine-wide
      sectors-written counter after sync as a cross-check), eager / on demand.

The eager baseline is favoured: it copies through a second sshfs mount that bypasses the delay
relay (a bulk copy is bandwidth-bound; this spares it the relay's CPU cost), with the store
mount's readahead at 4 MiB, the fastest setting measured here.

Images are built once and cached under --cache-dir (keyed by the generator and workload
sources); later runs reuse them. Cleans up (mounts, namespace, processes, temp files) on
success, failure, Ctrl-C or SIGTERM, and stops itself after --time-limit seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from _ondemand import env
from _ondemand.images import Image, ensure_images
from _stats import pct
from dsec._linux import mount, umount
from dsec.images.mount import unmount_tree
from dsec.images.ondemand import (
    DEFAULT_CHUNK_SIZE,
    mount_split,
    read_split_info,
    set_read_ahead,
    unmount_split,
)

MIB = 1 << 20
EAGER_STORE_READ_AHEAD_KB = 4096  # the best sequential copy rate measured here (vs 128, 1024, 16384)
WORKLOAD_TIMEOUT = 300.0
SANDBOX_ENV = {"PATH": "/usr/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}


# ---------------------------------------------------------------- small helpers


def cold() -> None:
    """Empty the page cache (ours and the 'server's', which shares this kernel)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def disk_sectors_written(path: Path) -> int:
    st = os.stat(path)
    fields = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
    return int(fields[6]) * 512


def self_write_bytes() -> int:
    """Bytes this process (and its reaped children) dirtied for writing to storage."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


def copy_file(src: Path, dst: Path) -> int:
    """A plain sequential copy with big reads, as an eager puller would do."""
    n = 0
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        os.posix_fadvise(fi.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while data := fi.read(4 * MIB):
            fo.write(data)
            n += len(data)
    return n


class Deadline(Exception):
    pass


# ---------------------------------------------------------------- a node


@dataclass(frozen=True)
class OnDemand:
    label: str
    directio: bool
    store_ra_kb: int  # the store mount's (sshfs) readahead window
    layer_ra_kb: int | None  # the layer mount's readahead window; None: kernel default (128)


CONFIGS = [
    OnDemand("buffered, kernel default readahead (128K)", False, 128, None),
    OnDemand("buffered, readahead 1M (store + layer)", False, 1024, 1024),
    OnDemand("erofs directio, layer readahead 1M", True, 128, 1024),
]


@dataclass
class Node:
    """One node's layers for one phase: each image mounted once, shared by its sandboxes."""

    root: Path
    store: env.RemoteStore
    mode: OnDemand | None  # None: eager
    procs: set[subprocess.Popen[bytes]] = field(default_factory=set)
    copied: int = 0  # bytes copied from the store to local disk
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _layers: dict[str, Path] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def __post_init__(self) -> None:
        for sub in ("local", "layers", "sandboxes"):
            (self.root / sub).mkdir(parents=True)
        if self.mode is None:
            set_read_ahead(self.store.bulk_mountpoint, EAGER_STORE_READ_AHEAD_KB)
        else:
            set_read_ahead(self.store.mountpoint, self.mode.store_ra_kb)

    def layer(self, image: Image) -> Path:
        with self._guard:
            lock = self._locks.setdefault(image.name, threading.Lock())
        with lock:
            if self._closed:  # a worker still running after an abort
                raise RuntimeError("node is closed")
            if image.name in self._layers:
                return self._layers[image.name]
            store = self.store.mountpoint if self.mode else self.store.bulk_mountpoint
            remote = store / image.name
            local = self.root / "local" / image.name
            local.mkdir()
            target = self.root / "layers" / image.name
            target.mkdir()
            n = copy_file(remote / "meta.erofs", local / "meta.erofs")
            if self.mode is None:
                n += copy_file(remote / "blob.erofs", local / "blob.erofs")
                mount_split(local / "meta.erofs", local / "blob.erofs", target)
            else:
                mount_split(
                    local / "meta.erofs",
                    remote / "blob.erofs",
                    target,
                    directio=self.mode.directio,
                    read_ahead_kb=self.mode.layer_ra_kb,
                )
            if self._closed:  # closed while we copied: close() may not have seen this mount
                unmount_split(target, lazy=True)
                raise RuntimeError("node is closed")
            with self._guard:
                self.copied += n
            self._layers[image.name] = target
            return target

    def sandbox(self, image: Image, sid: int) -> tuple[float, float, dict[str, int]]:
        """Start one sandbox on ``image`` and run its workload: (first output s, total s, stats)."""
        t0 = time.monotonic()
        lower = self.layer(image)
        d = self.root / "sandboxes" / str(sid)
        if self._closed:
            raise RuntimeError("node is closed")
        for sub in ("upper", "work", "merged"):
            (d / sub).mkdir(parents=True)
        merged = d / "merged"
        mount(
            "overlay", merged, "overlay", 0, f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}"
        )
        try:
            with tempfile.TemporaryFile() as errf:
                p = subprocess.Popen(
                    [
                        "/usr/bin/unshare",
                        "-m",
                        "/usr/sbin/chroot",
                        str(merged),
                        "/usr/bin/python3.11",
                        "/app/workload.py",
                        image.profile,
                    ],
                    env=SANDBOX_ENV,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=errf,
                )
                self.procs.add(p)
                killer = threading.Timer(WORKLOAD_TIMEOUT, p.kill)
                killer.start()
                try:
                    assert p.stdout is not None
                    first = p.stdout.readline()
                    t_first = time.monotonic() - t0
                    rest = p.stdout.read()  # through the same buffer as readline
                    p.wait()
                finally:
                    killer.cancel()
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                    if p.stdout is not None:
                        p.stdout.close()
                    self.procs.discard(p)
                if first.strip() != b"ready" or p.returncode != 0:
                    errf.seek(0)
                    err = errf.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"workload in {image.name} failed ({p.returncode}): {first!r} {err}")
            stats: dict[str, int] = json.loads(rest)
            return t_first, time.monotonic() - t0, stats
        finally:
            with contextlib.suppress(OSError):  # already detached if close() ran first
                umount(merged, lazy=True)
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        self._closed = True
        for p in list(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for target in list(self._layers.values()):
            try:
                unmount_split(target)
            except Exception:
                unmount_split(target, lazy=True)
        self._layers.clear()
        unmount_tree(self.root)
        shutil.rmtree(self.root, ignore_errors=True)  # workers of an aborted burst may race us


@contextlib.contextmanager
def node(root: Path, store: env.RemoteStore, mode: OnDemand | None) -> Iterator[Node]:
    n = Node(root, store, mode)
    try:
        yield n
    finally:
        n.close()


# ---------------------------------------------------------------- the measurements


def store_rtt(store: env.RemoteStore, n: int = 20) -> float:
    """Median time of a stat() that sshfs must ask the server (a missing, never-seen name)."""
    xs = []
    for i in range(n):
        t0 = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            os.stat(store.mountpoint / f".rtt-probe-{os.getpid()}-{i}")
        xs.append(time.monotonic() - t0)
    return pct(xs, 50)


def fig_ab(work: Path, store: env.RemoteStore, big: Image, reps: int) -> None:
    ttfo: dict[str, list[float]] = {c.label: [] for c in CONFIGS}
    total: dict[str, list[float]] = {c.label: [] for c in CONFIGS}
    rx: dict[str, list[int]] = {c.label: [] for c in CONFIGS}
    read_bytes = 0
    e_ttfo: list[float] = []
    e_total: list[float] = []
    e_rx: list[int] = []
    sid = 0
    for rep in range(reps):
        for cfg in CONFIGS:
            cold()
            r0 = store.rx_bytes()
            with node(work / f"ab-{sid}", store, cfg) as n:
                f, t, stats = n.sandbox(big, sid)
            sid += 1
            ttfo[cfg.label].append(f)
            total[cfg.label].append(t)
            rx[cfg.label].append(store.rx_bytes() - r0)
            read_bytes = stats["bytes"]
        cold()
        r0 = store.rx_bytes()
        with node(work / f"ab-{sid}", store, None) as n:
            f, t, stats = n.sandbox(big, sid)
        sid += 1
        e_ttfo.append(f)
        e_total.append(t)
        e_rx.append(store.rx_bytes() - r0)
        print(
            f"  rep {rep + 1}/{reps}: eager first output {f:.2f} s, on demand "
            + ", ".join(f"{ttfo[c.label][-1]:.2f}" for c in CONFIGS)
            + " s",
            flush=True,
        )

    gib = big.size / (1 << 30)
    print(
        f"\n(a) bytes fetched from the store: start-up + workload on a {gib:.2f} GiB image "
        f"({big.blob_size / MIB:.0f} MiB blob + {big.meta_size / MIB:.2f} MiB metadata)"
    )
    print(
        f"    the workload reads {read_bytes / MIB:.0f} MiB = {100 * read_bytes / big.size:.1f}% "
        f"of the image (plus interpreter start-up); target: <= 15% of the image fetched"
    )
    for cfg in CONFIGS:
        b50, b99 = pct([float(x) for x in rx[cfg.label]], 50), pct([float(x) for x in rx[cfg.label]], 99)
        share = 100 * b50 / big.size
        print(
            f"    {cfg.label:<44} p50 {b50 / MIB:7.1f} MiB ({share:4.1f}%)  p99 {b99 / MIB:7.1f} MiB  "
            f"x{b50 / read_bytes:4.2f} of bytes read  [{'OK' if share <= 15 else 'MISSED'}]"
        )
    e50 = pct([float(x) for x in e_rx], 50)
    print(
        f"    {'eager (whole blob + metadata)':<44} p50 {e50 / MIB:7.1f} MiB ({100 * e50 / big.size:5.1f}%)"
    )

    print(f"\n(b) time to first output of a process in an overlay over the layer (cold, {reps} runs)")
    e50, e99 = pct(e_ttfo, 50), pct(e_ttfo, 99)
    print(
        f"    {'eager: copy blob + meta, mount, run':<53} p50 {e50 * 1000:8.0f} ms  "
        f"p99 {e99 * 1000:8.0f} ms  (workload done p50 {pct(e_total, 50):.2f} s)"
    )
    for cfg in CONFIGS:
        o50, o99 = pct(ttfo[cfg.label], 50), pct(ttfo[cfg.label], 99)
        print(
            f"    on demand: {cfg.label:<42} p50 {o50 * 1000:8.0f} ms  p99 {o99 * 1000:8.0f} ms  "
            f"eager/on-demand {e50 / o50:5.1f}x  [{'OK' if e50 / o50 >= 5 else 'MISSED'}]  "
            f"(workload done p50 {pct(total[cfg.label], 50):.2f} s)"
        )


def fig_c(
    work: Path, store: env.RemoteStore, images: list[Image], burst: int, conc: int, cfg: OnDemand
) -> None:
    print(
        f"\n(c) burst of {burst} sandbox starts over {len(images)} images "
        f"({sum(i.size for i in images) / MIB:.0f} MiB in all), {conc} at a time, cold node; "
        f"a start = mount layer if needed + overlay + chroot python3 reading a few files"
    )
    results = {}
    for label, mode in (("on demand", cfg), ("eager", None)):
        cold()
        d0, w0, r0 = disk_sectors_written(work), self_write_bytes(), store.rx_bytes()
        t0 = time.monotonic()
        with node(work / f"burst-{label.replace(' ', '')}", store, mode) as n:
            ex = ThreadPoolExecutor(conc)
            try:
                futs = [ex.submit(n.sandbox, images[i % len(images)], i) for i in range(burst)]
                lat = [f.result()[1] for f in futs]
            finally:
                ex.shutdown(wait=False, cancel_futures=True)
            wall = time.monotonic() - t0
            os.sync()
            written = self_write_bytes() - w0
            device = disk_sectors_written(work) - d0
            copied = n.copied
        results[label] = (wall, written, store.rx_bytes() - r0, device)
        print(
            f"    {label:<10} total {wall:7.2f} s  per start p50 {pct(lat, 50):6.2f} s "
            f"p99 {pct(lat, 99):6.2f} s  "
            f"written {written / MIB:7.1f} MiB (disk counter {device / MIB:7.1f} MiB; "
            f"copies {copied / MIB:6.1f} MiB)  "
            f"fetched {results[label][2] / MIB:8.1f} MiB"
        )
    (tw, dw, fw, xw), (te, de, fe, xe) = results["on demand"], results["eager"]
    print(
        f"    eager / on demand: time {te / tw:.2f}x, local disk bytes written {de / max(dw, 1):.0f}x "
        f"(disk counter {xe / max(xw, 1):.0f}x), bytes fetched {fe / max(fw, 1):.1f}x  "
        f"[on-demand config: {cfg.label}]"
    )
    print(
        "    written = write_bytes of /proc/self/io (the bench and its reaped children, i.e. copies,"
        " metadata, overlay uppers); disk counter = sectors written on the local disk's"
        " /sys/dev/block/*/stat after sync, machine-wide (other work on this machine included)"
    )


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=Path("/var/cache/dsec-bench/ondemand"))
    ap.add_argument("--tmp-dir", type=Path, default=Path("/var/tmp"), help="local disk for copies and uppers")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay to the store")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--burst-config", type=int, default=1, help=f"index into {[c.label for c in CONFIGS]}")
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds, image building included")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (mounts, network namespaces, drop_caches)", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # First signal: unwind (every resource has its cleanup registered); later ones are
        # ignored so that a second Ctrl-C cannot interrupt the cleanup itself.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
            signal.signal(sig, signal.SIG_IGN)
        if signum == signal.SIGALRM:
            raise Deadline(f"time limit of {args.time_limit:.0f} s reached")
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, on_signal)
    signal.alarm(int(args.time_limit))

    print(f"cores: {os.cpu_count()}  kernel: {os.uname().release}")
    for what in env.reap_stale(args.tmp_dir):
        print(f"removed leftover {what}")
    served, big, smalls = ensure_images(args.cache_dir, args.images)
    work = args.tmp_dir / f"{env.WORKDIR_PREFIX}{os.getpid()}"
    work.mkdir(mode=0o700)
    try:
        with env.remote_store(served, work, delay_ms=args.delay_ms, max_seconds=args.time_limit) as store:
            rtt = store_rtt(store)
            print(
                f"store: sshfs -> {store.server_ip} (netns {store.netns}), +{args.delay_ms:g} ms each way; "
                f"metadata round trip p50 {rtt * 1000:.1f} ms; chunk size {DEFAULT_CHUNK_SIZE // 1024} KiB"
            )
            info = read_split_info(store.mountpoint / big.name / "meta.erofs")
            assert info.blob_size == big.blob_size
            print(f"\nrunning (a)+(b): {args.reps} reps x ({len(CONFIGS)} on-demand configs + eager) ...")
            fig_ab(work, store, big, args.reps)
            fig_c(work, store, smalls, args.burst, args.concurrency, CONFIGS[args.burst_config])
    except (KeyboardInterrupt, Deadline) as err:
        print(f"\naborted: {err or 'interrupted'}; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.alarm(0)
        unmount_tree(work)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
