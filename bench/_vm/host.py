"""What bench/vm.py reads and does on the host, beside the SDK.

A QEMU process's memory as the host sees it (``/proc/<pid>/status``, ``smaps_rollup``, and
``smaps`` split by mapping: the guest RAM file, TCG's translation cache, the rest of QEMU), the
page-cache residency of a template's RAM file, KSM's knobs (saved, set, and restored) and
counters, the I/O floor of a pause (a plain copy of its snapshot), and the QEMU processes a run
may have left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from dsec import _linux
from dsec.density.ksm import KSM
from dsec.density.ksm import users as ksm_users

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s+(\S+)\s+\S+\s+\S+\s+\S+\s*(.*)$")


# ---------------------------------------------------------------- a process's memory


def _kb_fields(text: str) -> dict[str, int]:
    """``Key:   123 kB`` lines, in bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def status_bytes(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem... of ``/proc/<pid>/status`` in bytes; {} if it is gone."""
    try:
        return _kb_fields(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return {}


def rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` (Rss, Pss, Pss_Anon, Pss_File, Anonymous...) in bytes."""
    return _kb_fields(Path(f"/proc/{pid}/smaps_rollup").read_text())


@dataclass
class Part:
    rss: int = 0
    pss: int = 0
    anon: int = 0


@dataclass
class Split:
    """A QEMU process's memory by mapping."""

    guest_ram: Part = field(default_factory=Part)  # the memory-backend-file mapping of the RAM file
    tcg: Part = field(default_factory=Part)  # anonymous rwx: TCG's translation cache
    qemu: Part = field(default_factory=Part)  # everything else: QEMU's heap, libraries, stacks
    ram_mergeable: bool = False  # VmFlags "mg": madvise(MADV_MERGEABLE), what KSM scans


def smaps_split(pid: int, ram_file: Path) -> Split:
    """Sum ``/proc/<pid>/smaps`` by what each mapping is."""
    split = Split()
    part = split.qemu
    is_ram = False
    ram = str(ram_file)
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            m = _MAPPING.match(line)
            if m is not None:
                perms, path = m.group(3), m.group(4).strip()
                is_ram = path == ram or path == ram + " (deleted)"
                if is_ram:
                    part = split.guest_ram
                elif not path and "w" in perms and "x" in perms:
                    part = split.tcg
                else:
                    part = split.qemu
                continue
            key, _, rest = line.partition(":")
            if key == "VmFlags":
                if is_ram and "mg" in rest.split():
                    split.ram_mergeable = True
                continue
            fields = rest.split()
            if len(fields) != 2 or fields[1] != "kB":
                continue
            value = int(fields[0]) * 1024
            if key == "Rss":
                part.rss += value
            elif key == "Pss":
                part.pss += value
            elif key == "Anonymous":
                part.anon += value
    return split


def page_cache_bytes(path: Path) -> int | None:
    """How much of ``path`` is in the host's page cache (util-linux ``fincore``)."""
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return int(done.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def ksm_of(pid: int) -> dict[str, int]:
    """``/proc/<pid>/ksm_stat`` (ksm_merging_pages, ksm_rmap_items, ksm_process_profit...)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


# ---------------------------------------------------------------- KSM


class KsmUnavailable(Exception):
    pass


def ksm_value(name: str) -> str:
    """A KSM knob as written back to it (``advisor_mode`` reads ``[none] scan-time``)."""
    text = (KSM / name).read_text().strip()
    chosen = re.search(r"\[(\S+)\]", text)
    return chosen.group(1) if chosen else text


def ksm_counter(name: str) -> int:
    return int((KSM / name).read_text())


def ksm_merged() -> dict[str, int]:
    return {k: ksm_counter(k) for k in ("pages_shared", "pages_sharing")}


class Ksm:
    """Turns ksmd on with the bench's settings, and puts every knob it changed back."""

    KNOBS = ("run", "pages_to_scan", "sleep_millisecs")

    def __init__(self, own: Path | None = None) -> None:
        self.own = own  # the bench node's data directory: its own claim is no other node's
        self.saved: dict[str, str] = {}
        self.changed: list[str] = []
        self.merged_before: dict[str, int] = {}

    def enable(self, pages_to_scan: int, sleep_ms: int) -> None:
        """Raises KsmUnavailable (with every knob already put back) if it cannot."""
        if not (KSM / "run").exists():
            raise KsmUnavailable(f"{KSM}/run does not exist (a kernel without CONFIG_KSM)")
        users = [u for u in ksm_users() if self.own is None or Path(u).resolve() != self.own.resolve()]
        if users:  # its scan settings and merged-page counts are theirs too
            raise KsmUnavailable(f"another DSec node on this machine uses ksmd ({', '.join(users)})")
        self.saved = {k: ksm_value(k) for k in self.KNOBS}
        self.merged_before = ksm_merged()
        wanted = [("pages_to_scan", str(pages_to_scan)), ("sleep_millisecs", str(sleep_ms))]
        if (KSM / "advisor_mode").exists() and ksm_value("advisor_mode") != "none":
            # The scan-time advisor would set pages_to_scan by itself.
            self.saved["advisor_mode"] = ksm_value("advisor_mode")
            wanted.insert(0, ("advisor_mode", "none"))
        wanted.append(("run", "1"))
        try:
            for knob, value in wanted:
                try:
                    (KSM / knob).write_text(value)
                except OSError as exc:
                    raise KsmUnavailable(f"cannot write {KSM / knob}: {exc.strerror}") from exc
                self.changed.append(knob)
            if ksm_value("run") != "1":
                raise KsmUnavailable(f"{KSM}/run reads {ksm_value('run')} after writing 1")
        except KsmUnavailable:
            self.restore()
            raise

    def stop_scanning(self) -> None:
        """ksmd back to its saved ``run`` (merged pages stay merged: what it did can be read)."""
        if "run" in self.changed:
            with contextlib.suppress(OSError):
                (KSM / "run").write_text(self.saved["run"])

    def restore(self) -> None:
        """Put back what ``enable`` changed, ``run`` first. If ksmd was off before, first unmerge
        what it merged meanwhile (``run`` = 2, synchronous: every KSM page back to private copies,
        its trees and counters emptied), so that KSM is left as found: only if nothing was merged
        before (else that is someone else's and stays). Idempotent."""
        if "run" in self.changed and self.saved["run"] == "0" and not any(self.merged_before.values()):
            with contextlib.suppress(OSError):
                (KSM / "run").write_text("2")
        for knob in sorted(self.changed, key=lambda k: k != "run"):
            with contextlib.suppress(OSError):
                (KSM / knob).write_text(self.saved[knob])
        self.changed.clear()

    def state(self) -> dict[str, str]:
        return {k: ksm_value(k) for k in self.saved}


# ---------------------------------------------------------------- the pause's floor


def copy_plain(src: Path, dst: Path) -> int:
    """Read ``src`` and write it to ``dst`` in 1 MiB chunks, without fsync: what the snapshot
    write itself is (QEMU streams into ``cat > file``, which does not fsync either)."""
    copied = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(MiB):
            copied += fout.write(chunk)
    return copied


def read_through(paths: list[Path]) -> int:
    """Read files once (into the page cache), as a running node would have them."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(4 * MiB):
                total += len(chunk)
    return total


# ---------------------------------------------------------------- leftovers


def qemu_processes(marker: str, since_ticks: int) -> list[int]:
    """QEMU processes whose command line names ``marker`` (the bench's data directory) and that
    started at or after ``since_ticks`` (the bench's own start): the ones this run started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or b"qemu-system" not in argv[0] or not any(marker.encode() in a for a in argv):
            continue
        started = _linux.proc_start_time(int(entry.name))
        if started is not None and started >= since_ticks:
            found.append(int(entry.name))
    return sorted(found)
