"""MicroVMs on the real runtime, each figure against a baseline measured in the same run.

    ./setup.sh bench vm [--quick] [--n N] [--memory MB] [--reps N] [--cold-reps N] [--data-dir DIR]

Needs root. Runs an embedded node with microVMs (QEMU ``microvm``, TCG: this host's /dev/kvm is
a PVM host that cannot boot a stock kernel) on its own data directory (default
/var/lib/dsec-bench-vm; its first start builds the guest kit there: Debian's cloud kernel via
``apt-get download``, needs the network once), over the layer store of ``dsec up``
(/var/lib/dsec/layers; the base layer is built there if missing). No swap. Prints, with the core
count, p50/p99 where there are repetitions, a ratio to the baseline, and which figures TCG
bounds:

  1. cold create-to-first-output (``run_microvm`` + ``run_shell("true")``) of a kind with no
     template: the bench deletes ``<data_dir>/microvm/templates/*`` before each cold sample
     (same kind, same disk, same work each time; the template the previous sample built in the
     background is waited for, then removed); vs a container's create-to-first-output.
  2. create-to-first-output once the kind's template exists (a clone of it); vs cold, target
     p50 <= 1 s.
  3. ``pause()`` (snapshot to a file, QEMU ends) and ``resume()`` (a new QEMU from the file) of a
     clone: times, snapshot size, the QEMU's RSS before the pause and after; vs a plain copy of
     the snapshot file (the I/O floor of a pause) and a fresh clone (what not resuming costs).
  4. host memory per idle microVM: N clones of one template, the sum of their QEMUs' PSS and
     RSS / N (split: guest RAM, TCG translation cache, the rest of QEMU); vs one idle container
     (its memory cgroup's usage).
  5. KSM over the same N clones (ksmd turned on, its settings restored afterwards): pages
     merged, memory saved, PSS after / before.

A final line holds every figure as JSON. Every sandbox is stopped, the node closed, the
templates removed and KSM's settings restored, also on failure or Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from _rl.host import cgroups_of, dist_ms, memory_stat, timing, usage, wait_until
from _stats import pct
from _vm.host import (
    PAGE,
    Ksm,
    KsmUnavailable,
    MiB,
    Split,
    copy_plain,
    ksm_counter,
    ksm_merged,
    ksm_of,
    page_cache_bytes,
    qemu_processes,
    read_through,
    rollup,
    smaps_split,
    status_bytes,
)
from dsec import DSecClient, DSecContainerRunArgs, DSecMicroVMRunArgs, Sandbox, _linux
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.handle import MicroVmHandle
from dsec.density.swap import SwapConfig
from dsec.images.base import ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig

TCG = "[TCG-bound]"
PARTLY = "[partly TCG-bound]"
NOT_TCG = "[not TCG-bound]"
BUILD_TIMEOUT_S = 300.0  # a template boots a VM under TCG on a loaded 2-core host
KSM_PAGES_TO_SCAN = 5000
KSM_SLEEP_MS = 20
KSM_SCANS = 2


@dataclass
class Options:
    cold_reps: int
    reps: int
    pause_reps: int
    n: int
    memory_mb: int
    disk_mb: int
    image: str


@dataclass
class Made:
    """Every sandbox the bench made, so that all of them are stopped whatever happens."""

    client: DSecClient
    node: EmbeddedNode
    live: dict[str, Sandbox] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    vm_dirs: set[Path] = field(default_factory=set)  # each VM's work and socket directories

    def _adopt(self, sb: Sandbox) -> Sandbox:
        self.live[sb.id] = sb
        self.ids.add(sb.id)
        return sb

    async def vm(self, args: DSecMicroVMRunArgs) -> Sandbox:
        sb = self._adopt(await self.client.run_microvm(args))
        handle = self.handle(sb)
        self.vm_dirs.update(Path(p) for p in (handle.dir, handle.sockets))
        return sb

    async def container(self, args: DSecContainerRunArgs) -> Sandbox:
        return self._adopt(await self.client.run_container(args))

    def handle(self, sb: Sandbox) -> MicroVmHandle:
        record = self.node.edge.journal.get(sb.id)
        assert record is not None, sb.id
        return MicroVmHandle.of(record.handle)

    def qemu_pid(self, sb: Sandbox) -> int:
        return self.handle(sb).pid

    async def stop(self, *sandboxes: Sandbox) -> None:
        await asyncio.gather(*(sb.stop() for sb in sandboxes))
        for sb in sandboxes:
            self.live.pop(sb.id, None)

    async def stop_all(self) -> None:
        for sb in list(self.live.values()):
            with contextlib.suppress(Exception):
                await sb.stop()
            self.live.pop(sb.id, None)


@dataclass
class Ctx:
    made: Made
    backend: MicroVMBackend
    o: Options
    scratch: Path
    ksm: Ksm
    out: dict[str, Any]
    vm_args: DSecMicroVMRunArgs
    ct_args: DSecContainerRunArgs

    @property
    def templates(self) -> Path:
        return self.backend.templates.root


def target(text: str) -> str:
    return f"[target {text}]"


def mib(x: float) -> str:
    return f"{x / MiB:.1f} MiB"


async def create_first_output(make: Any, args: Any) -> tuple[Sandbox, float]:
    t = time.perf_counter()
    sb: Sandbox = await make(args)
    await sb.run_shell("true")
    return sb, time.perf_counter() - t


# ---------------------------------------------------------------- templates on disk


def complete_templates(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("*/complete"))


def template_builder_alive(root: Path, since: int) -> bool:
    """A template build still under way: its directory, or its QEMU (named by its paths)."""
    return any(root.glob("*.building")) or bool(qemu_processes(str(root), since))


def clear_templates(root: Path) -> int:
    """Delete every template (no clone of them runs when this is called)."""
    n = 0
    for child in list(root.iterdir()) if root.is_dir() else []:
        shutil.rmtree(child, ignore_errors=True)
        n += 1
    return n


async def await_template(ctx: Ctx, since: int) -> float:
    """Wait (polling) until the template of the kind is complete and its builder has ended;
    returns how long that took."""
    t = time.perf_counter()
    await wait_until(lambda: bool(complete_templates(ctx.templates)), "the template", BUILD_TIMEOUT_S)
    await wait_until(lambda: not template_builder_alive(ctx.templates, since), "the template builder", 30)
    return time.perf_counter() - t


# ---------------------------------------------------------------- figure 1 and 2


async def fig_cold(ctx: Ctx, since: int) -> list[float]:
    made, o = ctx.made, ctx.o
    cold, built, base, booted = [], [], [], 0
    for _ in range(o.cold_reps):
        await wait_until(lambda: not template_builder_alive(ctx.templates, since), "no template build", 30)
        clear_templates(ctx.templates)
        vm, dt = await create_first_output(made.vm, ctx.vm_args)
        cold.append(dt)
        booted += made.handle(vm).template is None
        built.append(await await_template(ctx, since))  # the build it started, in the background
        await made.stop(vm)
        # Interleaved, with nothing in the background, so machine noise falls on both alike.
        ct, dt = await create_first_output(made.container, ctx.ct_args)
        base.append(dt)
        await made.stop(ct)

    c50, b50 = pct(cold, 50), pct(base, 50)
    print(
        f"[1] cold create-to-first-output: run_microvm + run_shell('true'), {o.memory_mb} MiB,"
        f" {o.disk_mb} MiB disk, no template"
    )
    print(
        "    (cold: the bench deletes <data_dir>/microvm/templates/* before each sample and waits out"
        " the template build each cold create starts; page cache warm)"
    )
    print(timing("microVM cold boot", cold) + f"   ratio {c50 / b50:6.1f}x   {TCG}")
    print(timing("baseline: container create", base))
    print(f"    cold boots (no template used): {booted}/{len(cold)}")
    print(timing("template ready after the first output", built) + f"   (background) {TCG}")
    ctx.out["cold"] = {
        "how": "templates deleted before each sample; same kind and disk size",
        "microvm_cold": dist_ms(cold),
        "container": dist_ms(base),
        "ratio_cold_vs_container": round(c50 / b50, 2),
        "cold_boots": f"{booted}/{len(cold)}",
        "template_ready_after_output": dist_ms(built),
        "tcg_bound": True,
    }
    return cold


async def fig_template(ctx: Ctx, cold: list[float]) -> list[float]:
    made, o = ctx.made, ctx.o
    assert complete_templates(ctx.templates), "the cold samples left the kind's template"
    clone, base, cloned = [], [], 0
    for _ in range(o.reps):
        vm, dt = await create_first_output(made.vm, ctx.vm_args)
        clone.append(dt)
        cloned += made.handle(vm).template is not None
        await made.stop(vm)
        ct, dt = await create_first_output(made.container, ctx.ct_args)
        base.append(dt)
        await made.stop(ct)

    t50, c50, b50 = pct(clone, 50), pct(cold, 50), pct(base, 50)
    print("[2] create-to-first-output from the kind's template (a clone: private RAM mapping, qcow2 overlay)")
    print(
        timing("microVM from template", clone)
        + f"   ratio vs cold {t50 / c50:5.3f}x   {target('p50 <= 1 s')}   {PARTLY}"
    )
    print(timing("baseline: container create", base) + f"   template/container {t50 / b50:5.1f}x")
    print(
        f"    created from the template: {cloned}/{len(clone)}; cold p50 {c50 * 1e3:.1f} ms from [1]"
        f"   speed-up {c50 / t50:.1f}x"
    )
    ctx.out["template"] = {
        "microvm_template": dist_ms(clone),
        "container": dist_ms(base),
        "ratio_template_vs_cold": round(t50 / c50, 4),
        "ratio_template_vs_container": round(t50 / b50, 2),
        "cloned": f"{cloned}/{len(clone)}",
        "target_p50_ms": 1000,
        "tcg_bound": "partly",
    }
    return clone


# ---------------------------------------------------------------- figure 3


async def fig_pause(ctx: Ctx, clone: list[float]) -> None:
    made, o = ctx.made, ctx.o
    sb, _ = await create_first_output(made.vm, ctx.vm_args)
    template = made.handle(sb).template
    ram = ctx.templates / str(template) / "ram"
    await sb.run_shell("counter=41")
    paused, resumed, resumed_true, copied, sizes = [], [], [], [], []
    rss_before: list[int] = []
    after, ended = [], 0
    first_split = smaps_split(made.qemu_pid(sb), ram)
    last_split = first_split
    for i in range(o.pause_reps):
        pid = made.qemu_pid(sb)
        rss_before.append(status_bytes(pid).get("VmRSS", 0))
        t = time.perf_counter()
        await sb.pause()
        paused.append(time.perf_counter() - t)
        ended += _linux.proc_start_time(pid) is None
        after.append(ctx.backend.memory_bytes(sb.id))
        snapshot = Path(str(made.handle(sb).snapshot))
        sizes.append(snapshot.stat().st_size)
        dst = ctx.scratch / f"snapshot-copy-{i}"
        t = time.perf_counter()
        await asyncio.to_thread(copy_plain, snapshot, dst)
        copied.append(time.perf_counter() - t)
        dst.unlink()

        t = time.perf_counter()
        await sb.resume()
        resumed.append(time.perf_counter() - t)
        await sb.run_shell("true")
        resumed_true.append(time.perf_counter() - t)
        last_split = smaps_split(made.qemu_pid(sb), ram)
    rss_resumed = status_bytes(made.qemu_pid(sb)).get("VmRSS", 0)
    kept = (await sb.run_shell("echo $((counter + 1))")).stdout == "42\n"
    await made.stop(sb)

    ref_pause, ref_resume = [], []
    ct, _ = await create_first_output(made.container, ctx.ct_args)
    for _ in range(o.pause_reps):
        t = time.perf_counter()
        await ct.pause()
        ref_pause.append(time.perf_counter() - t)
        t = time.perf_counter()
        await ct.resume()
        ref_resume.append(time.perf_counter() - t)
    await made.stop(ct)

    p50, r50, rt50, cl50 = pct(paused, 50), pct(resumed, 50), pct(resumed_true, 50), pct(clone, 50)
    size, cp50 = pct(sizes, 50), pct(copied, 50)
    print(
        f"[3] pause (snapshot to a file, QEMU ends) and resume (new QEMU from the file) of a microVM,"
        f" {o.memory_mb} MiB ({'a template clone' if template else 'cold-booted'})"
    )
    print(timing("pause()", paused) + f"   ratio vs copy {p50 / cp50:5.1f}x   {PARTLY}")
    print(
        timing("baseline: plain copy of the snapshot file", copied)
        + f"   {size / MiB / cp50:6.0f} MiB/s (read + write, no fsync: a pause's I/O floor)"
    )
    print(f"    snapshot size p50 {mib(size)} (non-zero guest pages + device state)")
    print(timing("resume()", resumed) + f"   ratio vs fresh clone {r50 / cl50:5.2f}x   {PARTLY}")
    print(
        timing("resume() + run_shell('true')", resumed_true) + f"   ratio vs fresh clone {rt50 / cl50:5.2f}x"
    )
    print(timing("baseline: create from template + 'true' [2]", clone) + "   (a fresh clone loses the state)")
    print(
        f"    host RSS of the VM's QEMU (VmRSS) before pause: first {mib(rss_before[0])}, p50"
        f" {mib(pct(rss_before, 50))}; after pause: {mib(max(after))} (QEMU ended {ended}/{len(paused)})"
        f"   {NOT_TCG}"
    )
    print(
        f"    guest RAM mapping before the first pause: RSS {mib(first_split.guest_ram.rss)}"
        f" (anon {mib(first_split.guest_ram.anon)}); after a resume: RSS {mib(last_split.guest_ram.rss)}"
        f" (anon {mib(last_split.guest_ram.anon)}), VmRSS {mib(rss_resumed)}: loading the snapshot"
        " writes its pages and reads the rest, so a resumed clone no longer shares untouched RAM"
    )
    print(f"    shell state kept across {len(paused)} pause/resume cycles: {kept}")
    print(
        timing("reference: container pause() (freezer)", ref_pause)
        + f"   resume() p50 {pct(ref_resume, 50) * 1e3:.1f} ms (no swap: its memory stays)"
    )
    ctx.out["pause"] = {
        "from_template": bool(template),
        "pause": dist_ms(paused),
        "resume": dist_ms(resumed),
        "resume_then_true": dist_ms(resumed_true),
        "snapshot_mib_p50": round(size / MiB, 1),
        "baseline_copy_snapshot": dist_ms(copied),
        "ratio_pause_vs_copy": round(p50 / cp50, 2),
        "ratio_resume_vs_fresh_clone": round(r50 / cl50, 3),
        "ratio_resume_true_vs_fresh_clone": round(rt50 / cl50, 3),
        "rss_before_first_pause_mib": round(rss_before[0] / MiB, 1),
        "rss_before_pause_mib_p50": round(pct(rss_before, 50) / MiB, 1),
        "rss_after_pause_mib_max": round(max(after) / MiB, 1),
        "qemu_ended": f"{ended}/{len(paused)}",
        "rss_after_resume_mib": round(rss_resumed / MiB, 1),
        "guest_ram_rss_first_mib": round(first_split.guest_ram.rss / MiB, 1),
        "guest_ram_rss_resumed_mib": round(last_split.guest_ram.rss / MiB, 1),
        "state_kept": kept,
        "container_pause": dist_ms(ref_pause),
        "container_resume": dist_ms(ref_resume),
        "tcg_bound": "partly",
    }


# ---------------------------------------------------------------- figure 4 and 5


@dataclass
class Memory:
    pss: int
    rss: int
    splits: list[Split]

    def part(self, name: str, what: str) -> int:
        return sum(getattr(getattr(s, name), what) for s in self.splits)


def measure(pids: list[int], ram: Path) -> Memory:
    rolls = [rollup(p) for p in pids]
    return Memory(
        pss=sum(r["Pss"] for r in rolls),
        rss=sum(r["Rss"] for r in rolls),
        splits=[smaps_split(p, ram) for p in pids],
    )


async def settled(pids: list[int], ram: Path, within_s: float = 15.0) -> Memory:
    """The VMs' memory once idle: re-read every 0.5 s (a measuring interval, not a wait for an
    event) until the sum of PSS moves by less than 1%."""
    last = await asyncio.to_thread(measure, pids, ram)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = await asyncio.to_thread(measure, pids, ram)
        if abs(now.pss - last.pss) < 0.01 * last.pss:
            return now
        last = now
    return last


async def fig_idle(ctx: Ctx) -> None:
    made, o = ctx.made, ctx.o
    vms = [(await create_first_output(made.vm, ctx.vm_args))[0] for _ in range(o.n)]
    names = {made.handle(v).template for v in vms}
    assert len(names) == 1 and None not in names, f"all {o.n} from one template: {names}"
    ram = ctx.templates / str(names.pop()) / "ram"
    pids = [made.qemu_pid(v) for v in vms]
    mem = await settled(pids, ram)
    cached = page_cache_bytes(ram)
    meminfo = (await vms[0].run_shell("cat /proc/meminfo")).stdout
    info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in meminfo.splitlines() if ln.endswith("kB")}
    guest_used = info["MemTotal"] - info["MemAvailable"]

    ct, _ = await create_first_output(made.container, ctx.ct_args)
    ct_usage, ct_stat = usage(ct.id), memory_stat(ct.id)
    await made.stop(ct)

    n = o.n
    per_pss, per_rss = mem.pss / n, mem.rss / n
    print(f"[4] host memory per idle microVM: {n} clones of one template, {o.memory_mb} MiB each  {NOT_TCG}")
    print(
        f"    PSS per VM {mib(per_pss)}   RSS per VM {mib(per_rss)}   (sum over the {n} QEMUs /"
        f" {n}: PSS {mib(mem.pss)}, RSS {mib(mem.rss)})   ratio PSS/container {per_pss / ct_usage:6.1f}x"
    )
    print(
        f"    baseline: one idle container  {mib(ct_usage)} (memory.usage_in_bytes;"
        f" rss {mib(ct_stat.get('rss', 0))}, cache {mib(ct_stat.get('cache', 0))})"
    )
    print(
        f"    PSS per VM by mapping: guest RAM {mib(mem.part('guest_ram', 'pss') / n)}"
        f" (of which anonymous = pages the clone wrote {mib(mem.part('guest_ram', 'anon') / n)}),"
        f" TCG translation cache {mib(mem.part('tcg', 'pss') / n)} (none under KVM),"
        f" rest of QEMU {mib(mem.part('qemu', 'pss') / n)}"
    )
    print(
        f"    guest RAM mapped per VM: RSS {mib(mem.part('guest_ram', 'rss') / n)}; the guest itself counts"
        f" {mib(guest_used)} of its {o.memory_mb} MiB used (MemTotal - MemAvailable)"
    )
    if cached is not None:
        print(
            f"    clones map the template's RAM file privately: unwritten pages are its page cache, one copy"
            f" for all clones ({mib(cached)} resident, in PSS only where mapped; counted whole and"
            f" shared by {n}: at most +{mib(cached / n)} per VM)"
        )
    ctx.out["idle_memory"] = {
        "n": n,
        "pss_per_vm_mib": round(per_pss / MiB, 2),
        "rss_per_vm_mib": round(per_rss / MiB, 2),
        "pss_guest_ram_per_vm_mib": round(mem.part("guest_ram", "pss") / n / MiB, 2),
        "anon_guest_ram_per_vm_mib": round(mem.part("guest_ram", "anon") / n / MiB, 2),
        "pss_tcg_cache_per_vm_mib": round(mem.part("tcg", "pss") / n / MiB, 2),
        "pss_qemu_rest_per_vm_mib": round(mem.part("qemu", "pss") / n / MiB, 2),
        "rss_guest_ram_per_vm_mib": round(mem.part("guest_ram", "rss") / n / MiB, 2),
        "template_ram_cached_mib": None if cached is None else round(cached / MiB, 1),
        "guest_used_mib": round(guest_used / MiB, 1),
        "container_usage_mib": round(ct_usage / MiB, 2),
        "ratio_pss_vs_container": round(per_pss / ct_usage, 2),
        "tcg_bound": False,
    }
    try:
        await fig_ksm(ctx, pids, ram, mem)
    finally:
        await made.stop(*vms)
        ctx.ksm.restore()  # after the VMs: an unmerge then has nothing of theirs left to copy


async def fig_ksm(ctx: Ctx, pids: list[int], ram: Path, before: Memory) -> None:
    n = len(pids)
    mergeable = sum(s.ram_mergeable for s in before.splits)
    try:
        ctx.ksm.enable(KSM_PAGES_TO_SCAN, KSM_SLEEP_MS)
    except KsmUnavailable as exc:
        print(f"[5] KSM: skipped: {exc}")
        ctx.out["ksm"] = {"skipped": str(exc)}
        return
    try:
        start = ksm_counter("full_scans")
        t = time.perf_counter()
        with contextlib.suppress(TimeoutError):  # reported below: how many scans it got through
            await wait_until(lambda: ksm_counter("full_scans") >= start + KSM_SCANS, "KSM full scans", 240)
        took = time.perf_counter() - t
        scans = ksm_counter("full_scans") - start
    finally:
        ctx.ksm.stop_scanning()  # merged pages stay merged: read a state that no longer moves
    merged = ksm_merged()
    was = ctx.ksm.merged_before  # counters before ksmd ran (0 unless something else merged)
    sharing = merged["pages_sharing"] - was.get("pages_sharing", 0)
    shared = merged["pages_shared"] - was.get("pages_shared", 0)
    stats = [ksm_of(p) for p in pids]
    ours = sum(x.get("ksm_merging_pages", 0) for x in stats)
    profit = sum(x.get("ksm_process_profit", 0) for x in stats)
    after = await asyncio.to_thread(measure, pids, ram)
    saved = sharing * PAGE
    anon_before = before.part("guest_ram", "anon")
    print(
        f"[5] KSM over the same {n} idle microVMs (run 1, pages_to_scan {KSM_PAGES_TO_SCAN},"
        f" sleep_millisecs {KSM_SLEEP_MS}; the previous settings restored after)  {NOT_TCG}"
    )
    print(
        f"    {scans} full scans in {took:.1f} s. Host-wide (ksmd scans every mergeable process):"
        f" pages_shared {shared}, pages_sharing {sharing}:"
        f" saved {mib(saved)} (pages_sharing x {PAGE // 1024} KiB);"
        f" of the {shared + sharing} merged page sites, {ours} are our QEMUs'"
        f" ({shared + sharing - ours} other processes')"
    )
    print(
        f"    ours: PSS sum without KSM (baseline) {mib(before.pss)} -> with {mib(after.pss)}"
        f"   ratio after/before {after.pss / before.pss:5.3f}"
        f"   saved {mib(before.pss - after.pss)} = {mib((before.pss - after.pss) / n)} per VM"
        f"   (kernel's ksm_process_profit, sum: {mib(profit)})"
    )
    print(
        f"    guest RAM marked mergeable by QEMU (VmFlags mg): {mergeable}/{n}; but clones map the template's"
        f" RAM file privately, so only pages a clone wrote are anonymous and KSM candidates"
        f" ({mib(anon_before / n)} per VM); the unwritten rest is already one copy in the page cache"
    )
    ctx.out["ksm"] = {
        "full_scans": scans,
        "seconds": round(took, 1),
        "pages_shared": shared,
        "pages_sharing": sharing,
        "saved_mib_host_wide": round(saved / MiB, 1),
        "our_pss_saved_per_vm_mib": round((before.pss - after.pss) / n / MiB, 2),
        "our_ksm_process_profit_mib": round(profit / MiB, 1),
        "our_merging_pages": ours,
        "pss_before_mib": round(before.pss / MiB, 1),
        "pss_after_mib": round(after.pss / MiB, 1),
        "ratio_pss_after_vs_before": round(after.pss / before.pss, 4),
        "anon_guest_ram_per_vm_mib": round(anon_before / n / MiB, 2),
        "ram_mergeable": f"{mergeable}/{n}",
        "tcg_bound": False,
    }


# ---------------------------------------------------------------- main


def options(a: argparse.Namespace) -> Options:
    return Options(
        cold_reps=a.cold_reps if a.cold_reps is not None else (3 if a.quick else 10),
        reps=a.reps if a.reps is not None else (10 if a.quick else 30),
        pause_reps=a.pause_reps if a.pause_reps is not None else (4 if a.quick else 10),
        n=a.n,
        memory_mb=a.memory,
        disk_mb=a.disk,
        image=a.image,
    )


def qemu_version() -> str:
    with contextlib.suppress(OSError, IndexError):
        done = subprocess.run(
            ["qemu-system-x86_64", "--version"], capture_output=True, text=True, check=False
        )
        return done.stdout.splitlines()[0].split("version")[-1].strip()
    return "?"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~1-2 minutes)")
    ap.add_argument("--cold-reps", type=int, default=None, help="cold boots in [1] (default 10, quick 3)")
    ap.add_argument("--reps", type=int, default=None, help="template creates in [2] (default 30, quick 10)")
    ap.add_argument("--pause-reps", type=int, default=None, help="pause cycles in [3] (default 10, quick 4)")
    ap.add_argument("--n", type=int, default=8, help="idle microVMs in [4] and [5] (default 8)")
    ap.add_argument("--memory", type=int, default=256, help="memory_limit_mb of every sandbox (default 256)")
    ap.add_argument("--disk", type=int, default=4096, help="disk_mb of the microVMs (default 4096)")
    ap.add_argument("--data-dir", type=Path, default=Path("/var/lib/dsec-bench-vm"))
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--image", default="debian:bookworm")
    a = ap.parse_args()
    o = options(a)
    if os.geteuid() != 0:
        sys.exit("bench/vm.py: run as root (sandboxes need mounts, namespaces, cgroups)")
    if shutil.which("qemu-system-x86_64") is None:
        sys.exit("bench/vm.py: qemu-system-x86_64 is not installed (./setup.sh bench vm installs it)")
    if min(o.cold_reps, o.reps, o.pause_reps, o.n) < 1:
        sys.exit("bench/vm.py: every count must be at least 1")
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    since = _linux.proc_start_time(os.getpid())
    assert since is not None

    data: Path = a.data_dir.resolve()
    with LayerStore(a.layers) as store:
        if a.image == "debian:bookworm":
            base = await asyncio.to_thread(
                ensure_base_layer, store, a.image, progress=lambda m: print(f"base layer: {m}", flush=True)
            )
        else:
            base = store.resolve(a.image)
        layer_file = store.blob_path(base.digest)
    scratch = data / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    node = EmbeddedNode(
        NodeConfig(
            data_dir=data,
            layer_dir=a.layers,
            port=0,
            node="bench-vm",
            config_file=data / "config.json",
            microvm=True,
            microvm_accel="tcg",
            edge={"swap": SwapConfig("none")},
        )
    )
    out: dict[str, Any] = {
        "bench": "vm",
        "cores": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "quick": a.quick,
        "memory_mb": o.memory_mb,
        "disk_mb": o.disk_mb,
        "n": o.n,
    }
    t0 = time.perf_counter()
    ksm = Ksm(data)
    made: Made | None = None
    await node.start()
    backend = cast(MicroVMBackend, next(b for b in node.more_backends if b.name == "microvm"))
    try:
        assert backend.kit is not None
        out.update(accel=backend.accel, guest_kernel=backend.kit.kernel_version, qemu=qemu_version())
        print(
            f"cores {os.cpu_count()}  {out['date']}  kernel {platform.release()}"
            f"  python {sys.version.split()[0]}  QEMU {out['qemu']}"
            f"  guest kernel {backend.kit.kernel_version}"
        )
        print(
            f"image {a.image} ({base.size / 1e6:.0f} MB EROFS)  memory {o.memory_mb} MiB"
            f"  disk {o.disk_mb} MiB"
            f"  cold reps {o.cold_reps}  reps {o.reps}  pause reps {o.pause_reps}  n {o.n}"
            f"{'  (quick)' if a.quick else ''}  node up in {time.perf_counter() - t0:.2f} s"
        )
        print(
            f"accel {backend.accel}: software emulation (this host's /dev/kvm is a PVM host that cannot"
            f" boot a stock kernel). {TCG}: boot and command latency; {PARTLY}: template clones, pause and"
            f" resume; {NOT_TCG}: memory (but for TCG's own translation cache, shown apart)"
        )
        await asyncio.to_thread(read_through, [backend.kit.kernel, backend.kit.initramfs, layer_file])
        ctx = Ctx(
            made=Made(DSecClient(node.url, node.api_key), node),
            backend=backend,
            o=o,
            scratch=scratch,
            ksm=ksm,
            out=out,
            vm_args=DSecMicroVMRunArgs(
                container_image=a.image, memory_limit_mb=o.memory_mb, disk_mb=o.disk_mb
            ),
            ct_args=DSecContainerRunArgs(container_image=a.image, memory_limit_mb=o.memory_mb),
        )
        made = ctx.made
        async with made.client:
            try:
                # Warm the container path (layer mount) once, untimed.
                await made.stop((await create_first_output(made.container, ctx.ct_args))[0])
                cold = await fig_cold(ctx, since)
                clone = await fig_template(ctx, cold)
                await fig_pause(ctx, clone)
                await fig_idle(ctx)
            finally:
                await made.stop_all()
    finally:
        ksm.restore()
        await node.close(stop_sandboxes=True)
        left_qemu = qemu_processes(str(data), since)
        for pid in left_qemu:  # started by this run (its data dir, after its start): ours to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        removed = clear_templates(backend.templates.root)
        shutil.rmtree(scratch, ignore_errors=True)
        ids = made.ids if made is not None else set()
        left = cgroups_of(ids)
        left_dirs = [d for d in (made.vm_dirs if made is not None else set()) if d.exists()]
        ksm_now = ksm.state()
        ksm_ok = ksm_now == ksm.saved
        print(
            f"cleanup: {len(ids)} sandboxes made and stopped, leftover QEMU processes {len(left_qemu)}"
            f"{' (killed: ' + ', '.join(map(str, left_qemu)) + ')' if left_qemu else ''},"
            f" leftover cgroups {len(left)}, leftover VM work/socket dirs {len(left_dirs)},"
            f" {removed} templates removed,"
            f" KSM {'restored ' + str(ksm_now) if ksm.saved else 'untouched'}"
            f"{' ' + str(ksm_merged()) if ksm.saved else ''}"
            f"{'' if ksm_ok else ' (NOT as saved: ' + str(ksm.saved) + ')'};"
            f" total {time.perf_counter() - t0:.0f} s"
        )
        for p in [*left, *left_dirs]:
            print(f"  leftover: {p}")
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
