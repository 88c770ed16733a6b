"""Collection of full VMs' base images (built from layers): which go, which stay. On files, no
VM booted: the backend's view of what is in use comes from its state files and qcow2 headers."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.backends.vm.backend import FullVMBackend
from dsec.backends.vm.bases import Bases, base_of

A, B, C = (f"sha256:{c * 64}" for c in "abc")
HOUR = 3600.0


def make_base(bases: Bases, layers: list[str], last_used: float, disk_mb: int = 64) -> str:
    key = bases.key(layers, disk_mb)
    bases.root.mkdir(parents=True, exist_ok=True)
    bases.image(key).write_bytes(b"base")
    bases.used(key, layers, disk_mb, now=last_used)
    return key


def test_unused_bases_go_after_the_grace_or_when_a_layer_left_the_store(tmp_path: Path) -> None:
    bases = Bases(tmp_path / "bases")
    now = 1_000_000.0
    idle = make_base(bases, [A], now - 2 * HOUR)
    recent = make_base(bases, [A, B], now - 60)
    orphaned = make_base(bases, [C], now - 60)  # C is no longer in the store
    busy = make_base(bases, [B], now - 5 * HOUR)
    assert bases.read(recent) is not None and bases.read(recent).layers == [A, B]  # type: ignore[union-attr]

    removed = bases.collect({busy}, lambda d: d != C, grace_s=HOUR, now=now)

    assert sorted(removed) == sorted([idle, orphaned])
    left = sorted(p.name for p in bases.root.iterdir())
    assert left == sorted(f"{k}.{ext}" for k in (recent, busy) for ext in ("json", "qcow2"))
    # A base in use counts as used now: its grace starts when its last VM stops.
    info = bases.read(busy)
    assert info is not None and info.last_used == now and info.created_at == now - 5 * HOUR
    assert bases.collect(set(), lambda d: True, grace_s=HOUR, now=now + HOUR - 61) == []
    assert sorted(bases.collect(set(), lambda d: True, grace_s=HOUR, now=now + HOUR + 1)) == sorted(
        [recent, busy]
    )
    assert list(bases.root.iterdir()) == []


def test_a_base_without_sidecar_is_judged_by_age_and_crash_leftovers_are_swept(tmp_path: Path) -> None:
    bases = Bases(tmp_path / "bases")
    bases.root.mkdir()
    legacy = bases.image("0" * 24)
    legacy.write_bytes(b"from before sidecars")
    mtime = legacy.stat().st_mtime
    raw = bases.root / ("2" * 24 + ".raw.tmp")
    raw.write_bytes(b"")
    merged = bases.root / ("2" * 24 + ".merged")
    merged.mkdir()
    stray = bases.sidecar("3" * 24)  # its image is gone
    stray.write_text("{}")
    building = bases.root / ("4" * 24 + ".qcow2.tmp")  # a build in progress (its key is kept)
    building.write_bytes(b"")

    assert bases.collect({"4" * 24}, None, grace_s=HOUR, now=mtime + 60) == []
    assert legacy.exists() and raw.exists() and stray.exists()

    assert bases.collect({"4" * 24}, None, grace_s=HOUR, now=mtime + 2 * HOUR) == ["0" * 24]
    assert sorted(p.name for p in bases.root.iterdir()) == [building.name]


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-utils is not installed")
def test_the_backend_keeps_the_bases_of_its_vms_paused_ones_and_forks(tmp_path: Path) -> None:
    backend = FullVMBackend(tmp_path, layer_exists=lambda d: True, base_grace_s=0.0)
    bases = backend.bases
    running, paused, forked, legacy, unused = (make_base(bases, [d], 0.0, n) for n, d in enumerate([A] * 5))
    state = backend.state_dir

    def overlay(path: Path, backing: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(path)]
        subprocess.run([*argv[:-1], "-u", argv[-1], "64M"], check=True)  # -u: the base is no qcow2
        return path

    def vm(sid: str, **handle: object) -> None:
        (state / f"sb-{sid}.json").write_text(json.dumps({"sid": sid, **handle}))

    vm("run", base=running, vm={"root_disk": "/nowhere"})
    vm("pause", base=paused, snapshot="/x/paused.state", vm={"root_disk": "/nowhere"})
    # From before handles named their base: found through the overlay's backing file.
    vm("old", vm={"root_disk": str(overlay(tmp_path / "old" / "root.qcow2", bases.image(legacy)))})
    vm("micro", vm={"root_disk": None, "rw_disk": "/x/rw.img"})  # a microVM-like handle: no base
    # A fork's saved disk is a copy of its VM's overlay; its copies stand on that disk.
    fork_disk = overlay(state / "forks" / "f1" / "disk.qcow2", bases.image(forked))
    copy = overlay(tmp_path / "copy" / "disk.qcow2", fork_disk)
    assert base_of(copy, bases.root) == forked

    assert backend.bases_in_use() == {running, paused, forked, legacy}
    assert backend.collect_unused() == [unused]
    assert not bases.image(unused).exists() and bases.image(running).exists()
