"""DSec's RL co-design features on the real runtime, each against a baseline measured in the same run.

    ./setup.sh bench rl [--quick] [--reps N] [--sandboxes R] [--data-dir DIR] [--layers DIR]

Needs root (crun containers over EROFS layers, cgroup v1). Runs an embedded node on its own
data directory (default /var/lib/dsec-bench-rl) with a swap file there that the node turns on
(and off again at close), over the layer store of `dsec up` (/var/lib/dsec/layers; the base
layer is built there if missing). Prints, with the core count, p50/p99 where there are
repetitions and the issue's target next to each figure (printed, not asserted):

  1. memory returned per paused sandbox (R sandboxes holding 256 MiB each: cgroup usage before
     and after `pause()`), vs the cgroup freezer alone; pause time.
  2. `resume()` latency of such a sandbox, alone, followed by `run_shell("true")`, and as the
     transparent resume of a `run_shell` on a paused sandbox, vs create-to-first-output of a
     fresh sandbox (what a trainer pays without pause). Then the time of a first command that
     touches all 256 MiB again (a shell variable), after `resume()` (prefetch) vs after a thaw
     without prefetch (the same freeze + memory.force_empty done by hand, then THAWED) vs hot.
  3. `fork(8)` of a sandbox with a ~1 MB diff vs `run_containers(args, 8)` from scratch.
  4. `pack_diff` of a 100 MiB diff vs a durable read+write of the same amount of data on the
     host (and, for reference, `mkfs.erofs` of that host tree as the layer store runs it); then
     the restore (create from the packed layer + sha256sum) and whether it is byte-identical.

A final line holds every figure as JSON. Every sandbox is stopped and the layers the bench
packed are removed from the store, also on failure or Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _rl.host import (
    MiB,
    cgroups_of,
    copy_fsync,
    dist_ms,
    frozen_by_hand,
    has_process,
    make_tree,
    memory_dir,
    memory_stat,
    mkfs_fsync,
    remove_layers,
    set_freezer,
    timing,
    usage,
    wait_until,
)
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs, Sandbox
from dsec.density import memory
from dsec.density.swap import SwapConfig, active_swaps
from dsec.images.base import ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig

# A process holding N MiB of incompressible memory: sort keeps all it read while it waits for EOF.
HOLD = "{{ head -c {mb}M /dev/urandom; sleep 100000; }} | sort -S {buf}M > /dev/null & echo $!"
# The same amount held by the session shell itself, so that a later command can touch it all.
FILL_VAR = "export LC_ALL=C; x=$(head -c {mb}M /dev/urandom | tr '\\0' z); echo ${{#x}}"
TOUCH_VAR = "echo ${#x}"  # strlen over the whole value: reads every page
FREEZE_DWELL_S = 0.5
PACK_CHECK = "sha256sum /root/blob; cat /root/small/* | sha256sum; cat /root/rep"


@dataclass
class Options:
    reps: int
    sandboxes: int
    hold_mb: int
    touch_reps: int
    fork_n: int
    pack_mb: int
    pack_reps: int
    memory_mb: int
    image: str


@dataclass
class Made:
    """Every sandbox the bench made, so that all of them are stopped whatever happens."""

    client: DSecClient
    live: dict[str, Sandbox] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)

    def adopt(self, sandboxes: list[Sandbox]) -> list[Sandbox]:
        for sb in sandboxes:
            self.live[sb.id] = sb
            self.ids.add(sb.id)
        return sandboxes

    async def one(self, args: DSecContainerRunArgs) -> Sandbox:
        return self.adopt([await self.client.run_container(args)])[0]

    async def many(self, args: DSecContainerRunArgs, n: int) -> list[Sandbox]:
        return self.adopt(await self.client.run_containers(args, n))

    async def stop(self, *sandboxes: Sandbox) -> None:
        await asyncio.gather(*(sb.stop() for sb in sandboxes))
        for sb in sandboxes:
            self.live.pop(sb.id, None)

    async def stop_all(self) -> None:
        for sb in list(self.live.values()):
            with contextlib.suppress(Exception):
                await set_freezer(sb.id, "THAWED")  # a hand-frozen one could not be stopped
            with contextlib.suppress(Exception):
                await sb.stop()
            self.live.pop(sb.id, None)


def target(text: str) -> str:
    return f"[target {text}]"


# ---------------------------------------------------------------- figure 1 and 2


async def hold_memory(sb: Sandbox, mb: int) -> int:
    """Start the sort holder and wait until its memory is charged; returns its PID."""
    r = await sb.run_shell(HOLD.format(mb=mb, buf=2 * mb + 100))
    pid = int(r.stdout.split()[-1])
    await wait_until(
        lambda: not has_process(sb.id, "head") and usage(sb.id) >= mb * MiB, f"{sb.id} to hold {mb} MiB"
    )
    last = [usage(sb.id)]

    def settled() -> bool:  # sort may still be taking in the pipe's last bytes
        now = usage(sb.id)
        done = abs(now - last[0]) < MiB
        last[0] = now
        return done

    await wait_until(settled, f"{sb.id}'s memory to settle")
    return pid


def returned_pct(before: int, after: int) -> float:
    return 100.0 * (before - after) / before


async def fig_pause(made: Made, o: Options, out: dict[str, Any]) -> None:
    args = DSecContainerRunArgs(container_image=o.image, memory_limit_mb=o.memory_mb)
    sbs = [await made.one(args) for _ in range(o.sandboxes)]
    pids = await asyncio.gather(*(hold_memory(sb, o.hold_mb) for sb in sbs))

    freeze_before, freeze_after, before, after, swapped, first_pause = [], [], [], [], [], []
    for sb in sbs:
        freeze_before.append(usage(sb.id))
        async with frozen_by_hand(sb.id):
            # Held frozen a while (a dwell, not a wait for anything): the freezer alone gives
            # nothing back, however long it holds.
            await asyncio.sleep(FREEZE_DWELL_S)
            freeze_after.append(usage(sb.id))
        before.append(usage(sb.id))
        t = time.perf_counter()
        await sb.pause()
        first_pause.append(time.perf_counter() - t)
        after.append(usage(sb.id))
        swapped.append(memory_stat(sb.id).get("swap", 0))

    got = [returned_pct(b, a) for b, a in zip(before, after, strict=True)]
    base = [returned_pct(b, a) for b, a in zip(freeze_before, freeze_after, strict=True)]
    kept, kept_frozen = pct(after, 50), pct(freeze_after, 50)
    print(f"[1] memory returned per paused sandbox ({o.sandboxes} sandboxes holding {o.hold_mb} MiB each)")
    print(
        f"    pause() (freeze + page-out)   returned p50 {pct(got, 50):5.1f}%  min {min(got):5.1f}%"
        f"   resident {pct(before, 50) / MiB:6.1f} -> {kept / MiB:6.1f} MiB"
        f"   in swap {pct(swapped, 50) / MiB:6.1f} MiB   {target('>= 90%')}"
    )
    print(
        f"    baseline: freezer only        returned p50 {pct(base, 50):5.1f}%  min {min(base):5.1f}%"
        f"   resident {pct(freeze_before, 50) / MiB:6.1f} -> {kept_frozen / MiB:6.1f} MiB"
        f"   (frozen {FREEZE_DWELL_S} s, no page-out)"
    )
    print(
        f"    RAM still held, pause / freezer only: {kept / MiB:.1f} / {kept_frozen / MiB:.1f} MiB"
        f" = ratio {kept / kept_frozen:.3f}x"
    )
    print(timing("pause() time (first pause, pages written out)", first_pause))
    out["memory_returned"] = {
        "hold_mib": o.hold_mb,
        "sandboxes": o.sandboxes,
        "returned_pct_p50": round(pct(got, 50), 2),
        "returned_pct_min": round(min(got), 2),
        "freeze_only_returned_pct_p50": round(pct(base, 50), 2),
        "resident_before_mib_p50": round(pct(before, 50) / MiB, 1),
        "resident_after_mib_p50": round(kept / MiB, 1),
        "resident_after_ratio_vs_freeze_only": round(kept / kept_frozen, 4),
        "pause_first": dist_ms(first_pause),
        "target_pct": 90,
    }
    await fig_resume(made, o, args, sbs, pids, before, out)
    await made.stop(*sbs)


async def fig_resume(
    made: Made,
    o: Options,
    args: DSecContainerRunArgs,
    sbs: list[Sandbox],
    pids: list[int],
    resident: list[int],
    out: dict[str, Any],
) -> None:
    back, first_resume = [], []
    for sb, was in zip(sbs, resident, strict=True):
        t = time.perf_counter()
        await sb.resume()
        first_resume.append(time.perf_counter() - t)
        back.append(100.0 * usage(sb.id) / was)

    repause, repause_ret, resume_only, resume_true, transparent, fresh, hot = [], [], [], [], [], [], []

    async def pause(sb: Sandbox) -> None:
        was = usage(sb.id)
        t = time.perf_counter()
        await sb.pause()
        repause.append(time.perf_counter() - t)
        repause_ret.append(returned_pct(was, usage(sb.id)))

    # Interleaved, so that the machine's noise falls on the figures and the baseline alike.
    for i in range(o.reps):
        sb = sbs[i % len(sbs)]
        await pause(sb)
        t = time.perf_counter()
        await sb.resume()
        resume_only.append(time.perf_counter() - t)

        await pause(sb)
        t = time.perf_counter()
        await sb.resume()
        await sb.run_shell("true")
        resume_true.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.run_shell("true")
        hot.append(time.perf_counter() - t)

        await pause(sb)
        t = time.perf_counter()
        await sb.run_shell("true")  # a paused sandbox resumes by itself
        transparent.append(time.perf_counter() - t)

        t = time.perf_counter()
        new = await made.one(args)
        await new.run_shell("true")
        fresh.append(time.perf_counter() - t)
        await made.stop(new)

    alive = [
        (await sb.run_shell(f"kill -0 {pid} && echo alive")).stdout == "alive\n"
        for sb, pid in zip(sbs, pids, strict=True)
    ]
    f50 = pct(fresh, 50)
    print(f"[2] resume of a paused sandbox holding {o.hold_mb} MiB (memory prefetched, then thawed)")
    print(timing("resume() (first, after the pause of [1])", first_resume) + f"   {target('p50 <= 200 ms')}")
    print(timing("resume()", resume_only) + f"   ratio {pct(resume_only, 50) / f50:5.2f}x")
    print(
        timing("resume() + run_shell('true')", resume_true) + f"   ratio {pct(resume_true, 50) / f50:5.2f}x"
    )
    print(
        timing("run_shell('true') on the paused sandbox", transparent)
        + f"   ratio {pct(transparent, 50) / f50:5.2f}x"
    )
    print(timing("baseline: fresh create + run_shell('true')", fresh) + "   (ratios: p50 / this p50)")
    print(timing("reference: run_shell('true'), running sandbox", hot))
    print(
        f"    resident after resume() p50 {pct(back, 50):.0f}% of before the pause;"
        f" holder processes alive after all cycles: {sum(alive)}/{len(alive)}"
    )
    print(
        timing("pause() time (again: pages already in swap)", repause)
        + f"   returned p50 {pct(repause_ret, 50):.1f}%"
    )
    out["resume"] = {
        "hold_mib": o.hold_mb,
        "resume_first": dist_ms(first_resume),
        "resume": dist_ms(resume_only),
        "resume_then_true": dist_ms(resume_true),
        "transparent_resume_true": dist_ms(transparent),
        "fresh_create_true": dist_ms(fresh),
        "running_true": dist_ms(hot),
        "ratio_resume_vs_fresh": round(pct(resume_only, 50) / f50, 3),
        "ratio_resume_true_vs_fresh": round(pct(resume_true, 50) / f50, 3),
        "resident_after_resume_pct_p50": round(pct(back, 50), 1),
        "holders_alive": f"{sum(alive)}/{len(alive)}",
        "pause_again": dist_ms(repause),
        "target_p50_ms": 200,
    }


async def fig_touch(made: Made, o: Options, out: dict[str, Any]) -> None:
    """First command touching all the memory after a resume, with and without prefetch."""
    args = DSecContainerRunArgs(container_image=o.image, memory_limit_mb=o.memory_mb)
    sb = await made.one(args)
    want = f"{o.hold_mb * MiB}\n"
    r = await sb.run_shell(FILL_VAR.format(mb=o.hold_mb), session="mem", timeout=300)
    assert r.stdout == want, (r.stdout, r.stderr[-500:])
    cgroup = memory_dir(sb.id)

    async def touch() -> float:
        t = time.perf_counter()
        r = await sb.run_shell(TOUCH_VAR, session="mem")
        dt = time.perf_counter() - t
        assert r.stdout == want, r.stdout
        return dt

    await touch()
    hot, with_prefetch, resume_part, without, ret_sdk, ret_hand = [], [], [], [], [], []
    for _ in range(o.touch_reps):
        hot.append(await touch())

        was = usage(sb.id)
        await sb.pause()
        ret_sdk.append(returned_pct(was, usage(sb.id)))
        t = time.perf_counter()
        await sb.resume()
        resume_part.append(time.perf_counter() - t)
        with_prefetch.append(resume_part[-1] + await touch())

        # The same page-out as pause() (memory.force_empty of the frozen cgroup), then a thaw
        # without prefetch; the edge never knew, so the command below does not resume anything.
        was = usage(sb.id)
        async with frozen_by_hand(sb.id):
            await asyncio.to_thread(memory.page_out, cgroup)
            ret_hand.append(returned_pct(was, usage(sb.id)))
        without.append(await touch())
    await made.stop(sb)

    w50 = pct(with_prefetch, 50)
    print(f"    first command touching all {o.hold_mb} MiB again (`echo ${{#x}}` of a shell variable):")
    print(
        timing("resume() + touch (prefetch)", with_prefetch)
        + f"   of which resume() p50 {pct(resume_part, 50) * 1e3:.1f} ms"
    )
    print(
        timing("baseline: thaw without prefetch + touch", without)
        + f"   ratio prefetch/none {w50 / pct(without, 50):5.2f}x"
    )
    print(timing("never paused: touch", hot))
    print(
        f"    returned by the page-out: pause() p50 {pct(ret_sdk, 50):.1f}%,"
        f" by hand p50 {pct(ret_hand, 50):.1f}% (the same kernel operation)"
    )
    out["touch_after_resume"] = {
        "hold_mib": o.hold_mb,
        "prefetch_resume_then_touch": dist_ms(with_prefetch),
        "no_prefetch_thaw_then_touch": dist_ms(without),
        "hot_touch": dist_ms(hot),
        "ratio_prefetch_vs_none": round(w50 / pct(without, 50), 3),
    }


# ---------------------------------------------------------------- figure 3


async def fig_fork(made: Made, o: Options, out: dict[str, Any], fork_names: list[str]) -> None:
    args = DSecContainerRunArgs(container_image=o.image, memory_limit_mb=o.memory_mb)
    src = await made.one(args)
    fork_names.append(f"dsec-fork/{src.id}")
    r = await src.run_shell(
        "mkdir -p /root/work && head -c 1M /dev/urandom > /root/work/data.bin"
        " && for i in $(seq 1 20); do echo file $i > /root/work/f$i.txt; done"
        " && sha256sum /root/work/data.bin"
    )
    digest = r.stdout.split()[0]
    # Warm both paths once (layer mounts, page cache).
    await made.stop(*made.adopt(await src.fork(o.fork_n)))
    await made.stop(*await made.many(args, o.fork_n))

    forked, batch, same = [], [], True
    for i in range(o.reps):
        # A new diff each time (as after an agent's step): every fork packs fresh bytes.
        await src.run_shell(f"echo {i} > /root/work/rep")
        t = time.perf_counter()
        copies = made.adopt(await src.fork(o.fork_n))
        forked.append(time.perf_counter() - t)
        if i == 0:
            check = await copies[-1].run_shell("sha256sum /root/work/data.bin; cat /root/work/rep")
            same = check.stdout.split() == [digest, "/root/work/data.bin", "0"]
        await made.stop(*copies)

        t = time.perf_counter()
        fresh = await made.many(args, o.fork_n)
        batch.append(time.perf_counter() - t)
        await made.stop(*fresh)
    await made.stop(src)

    b50 = pct(batch, 50)
    print(f"[3] fork into {o.fork_n} of a sandbox with a ~1 MB diff (pack once + batch create)")
    print(
        timing(f"fork({o.fork_n})", forked)
        + f"   ratio {pct(forked, 50) / b50:5.2f}x   {target('<= 300 ms')}"
    )
    print(timing(f"baseline: run_containers(args, {o.fork_n}) from scratch", batch))
    print(f"    a fork has the source's files: {same}")
    out["fork"] = {
        "n": o.fork_n,
        "fork": dist_ms(forked),
        "batch_create": dist_ms(batch),
        "ratio_fork_vs_batch": round(pct(forked, 50) / b50, 3),
        "fork_has_source_files": same,
        "target_ms": 300,
    }


# ---------------------------------------------------------------- figure 4


async def fig_pack(made: Made, o: Options, out: dict[str, Any], scratch: Path, pack_name: str) -> None:
    args = DSecContainerRunArgs(container_image=o.image, memory_limit_mb=o.memory_mb)
    sb = await made.one(args)
    small, small_bytes = 100, 8192
    await sb.run_shell(
        f"head -c {o.pack_mb}M /dev/urandom > /root/blob && mkdir -p /root/small"
        f" && for i in $(seq 1 {small}); do head -c {small_bytes} /dev/urandom > /root/small/f$i; done",
        timeout=300,
    )
    host_src = scratch / "pack-src"
    diff_bytes = await asyncio.to_thread(make_tree, host_src, o.pack_mb, small, small_bytes)

    packed, copied, mkfs, restore, check_src, sizes, identical = [], [], [], [], [], [], []
    for i in range(o.pack_reps):
        await sb.run_shell(f"echo {i} > /root/rep")  # a new diff each time: a fresh blob each pack
        t = time.perf_counter()
        expected = (await sb.run_shell(PACK_CHECK)).stdout
        check_src.append(time.perf_counter() - t)

        await asyncio.to_thread(os.sync)  # both start with nothing dirty
        t = time.perf_counter()
        layer = await sb.pack_diff(pack_name)
        packed.append(time.perf_counter() - t)
        sizes.append(layer.size)

        dst = scratch / f"pack-dst-{i}"
        await asyncio.to_thread(os.sync)
        t = time.perf_counter()
        await asyncio.to_thread(copy_fsync, host_src, dst)
        copied.append(time.perf_counter() - t)
        await asyncio.to_thread(shutil.rmtree, dst)

        await asyncio.to_thread(os.sync)
        t = time.perf_counter()
        await asyncio.to_thread(mkfs_fsync, host_src, scratch / "ref.erofs")
        mkfs.append(time.perf_counter() - t)
        (scratch / "ref.erofs").unlink()

        t = time.perf_counter()
        restored = await made.one(
            DSecContainerRunArgs(layers=[*sb.info.layers, layer.digest], memory_limit_mb=o.memory_mb)
        )
        got = (await restored.run_shell(PACK_CHECK)).stdout
        restore.append(time.perf_counter() - t)
        identical.append(got == expected and expected.count("\n") == 3)
        await made.stop(restored)
    await made.stop(sb)

    mb = diff_bytes / MiB
    p50, c50 = pct(packed, 50), pct(copied, 50)
    print(f"[4] pack_diff of a {mb:.1f} MiB diff ({o.pack_mb} MiB incompressible file + {small} small files)")
    print(timing("pack_diff()", packed) + f"   {mb / p50:6.1f} MiB/s   layer {pct(sizes, 50) / MiB:.1f} MiB")
    print(
        timing("baseline: read + write once + fsync (host)", copied)
        + f"   {mb / c50:6.1f} MiB/s   ratio pack/baseline {p50 / c50:5.2f}x"
    )
    print(
        timing("reference: mkfs.erofs (store's flags) + fsync", mkfs)
        + f"   {mb / pct(mkfs, 50):6.1f} MiB/s   pack/mkfs {p50 / pct(mkfs, 50):5.2f}x"
    )
    print(
        "    (baseline: the same amount of data, same file layout, same filesystem, copied with plain"
        " read/write and fsynced: a lower bound for any packing)"
    )
    print(
        timing("restore: create from the layer + sha256sums", restore)
        + f"   byte-identical {sum(identical)}/{len(identical)}"
    )
    print(
        timing("  vs the same sha256sum in the source sandbox", check_src)
        + f"   ratio {pct(restore, 50) / pct(check_src, 50):5.2f}x"
    )
    out["pack_diff"] = {
        "diff_mib": round(mb, 1),
        "pack": dist_ms(packed),
        "pack_mib_s": round(mb / p50, 1),
        "layer_mib": round(pct(sizes, 50) / MiB, 1),
        "baseline_copy_fsync": dist_ms(copied),
        "baseline_mib_s": round(mb / c50, 1),
        "ratio_pack_vs_copy": round(p50 / c50, 3),
        "reference_mkfs_fsync": dist_ms(mkfs),
        "restore_create_sha256": dist_ms(restore),
        "source_sha256": dist_ms(check_src),
        "restore_byte_identical": all(identical),
    }


# ---------------------------------------------------------------- main


def options(a: argparse.Namespace) -> Options:
    reps = a.reps if a.reps is not None else (6 if a.quick else 20)
    return Options(
        reps=reps,
        sandboxes=a.sandboxes if a.sandboxes is not None else (2 if a.quick else 4),
        hold_mb=256,
        touch_reps=max(2, reps // 2),
        fork_n=8,
        pack_mb=100,
        pack_reps=2 if a.quick else 5,
        memory_mb=1024,
        image=a.image,
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sandboxes (~1 minute)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 20, quick 6)")
    ap.add_argument(
        "--sandboxes", type=int, default=None, help="paused sandboxes in [1] (default 4, quick 2)"
    )
    ap.add_argument("--data-dir", type=Path, default=Path("/var/lib/dsec-bench-rl"))
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--image", default="debian:bookworm")
    a = ap.parse_args()
    o = options(a)
    if os.geteuid() != 0:
        sys.exit("bench/rl.py: run as root (sandboxes need mounts, namespaces, cgroups)")
    if o.sandboxes * (o.hold_mb + 64) > 1800:
        sys.exit("bench/rl.py: --sandboxes too large for the bench's 2 GiB swap file")
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    data: Path = a.data_dir
    swap_path = data / "swap" / "bench.swap"
    swap_was_on = os.path.realpath(swap_path) in active_swaps()
    with LayerStore(a.layers) as store:
        if a.image == "debian:bookworm":
            base = await asyncio.to_thread(
                ensure_base_layer, store, a.image, progress=lambda m: print(f"base layer: {m}", flush=True)
            )
        else:
            base = store.resolve(a.image)
    scratch = data / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    node = EmbeddedNode(
        NodeConfig(
            data_dir=data,
            layer_dir=a.layers,
            port=0,
            node="bench",
            config_file=data / "config.json",
            edge={"swap": SwapConfig("file", 2048, swap_path)},
        )
    )
    run_id = secrets.token_hex(4)
    pack_name = f"bench-rl-{run_id}"
    fork_names: list[str] = []
    out: dict[str, Any] = {
        "bench": "rl",
        "cores": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "quick": a.quick,
        "reps": o.reps,
    }
    print(
        f"cores {os.cpu_count()}  {out['date']}  kernel {platform.release()}  python {sys.version.split()[0]}"
        f"  image {a.image} ({base.size / 1e6:.0f} MB EROFS)  reps {o.reps}{'  (quick)' if a.quick else ''}"
    )
    t0 = time.perf_counter()
    made: Made | None = None
    await node.start()
    try:
        swaps = active_swaps()
        others = [s for s in swaps if s != os.path.realpath(swap_path)]
        print(
            f"swap: {swap_path} ({'already on' if swap_was_on else 'turned on by the node'})"
            + (f"; also on (pages may land there too): {', '.join(others)}" if others else "")
        )
        async with DSecClient(node.url, node.api_key) as client:
            made = Made(client)
            try:
                await fig_pause(made, o, out)
                await fig_touch(made, o, out)
                await fig_fork(made, o, out, fork_names)
                await fig_pack(made, o, out, scratch, pack_name)
            finally:
                await made.stop_all()
    finally:
        await node.close(stop_sandboxes=True)
        shutil.rmtree(scratch, ignore_errors=True)
        tags, freed = remove_layers(a.layers, [pack_name, *fork_names])
        ids = made.ids if made is not None else set()
        left = cgroups_of(ids)
        swap_on = os.path.realpath(swap_path) in active_swaps()
        print(
            f"cleanup: {len(ids)} sandboxes made and stopped, leftover cgroups {len(left)},"
            f" {tags} bench layer tags removed ({freed / MiB:.0f} MiB of blobs),"
            f" bench swap {'on (it was on before the run)' if swap_on else 'off'};"
            f" total {time.perf_counter() - t0:.0f} s"
        )
        for p in left:
            print(f"  leftover cgroup: {p}")
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
