"""Disk quota mechanics: the node's btrfs quota file system and the container backend over it.

Needs root, mkfs.btrfs, loop devices and a kernel with btrfs (see ``diskquota``'s module doc
for why btrfs qgroups and not ext4/XFS project quotas). The sandboxes run the conformance
suite's busybox layers; each test uses its own small quota file system under tmp_path.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec import _linux
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.container.diskquota import QuotaFs, _loop_for
from dsec.images.mount import find_mount, mounts_under
from dsec.protocol.errors import CapacityExhausted
from tests.support import DEADLINE_S, eventually

from .conformance import Made, build_layers, run

if os.geteuid() != 0 or QuotaFs.unsupported() is not None:
    pytest.skip(f"disk quotas need root and btrfs: {QuotaFs.unsupported()}", allow_module_level=True)

MiB = 1 << 20


def _sync(path: Path) -> None:
    # Quota usage is settled at transaction commit; syncfs(2) commits.
    subprocess.run(["sync", "-f", str(path)], check=True)


def _write(path: Path, size: int) -> int:
    """Write ``size`` bytes in 1 MiB chunks; returns the errno that stopped it (0: none)."""
    chunk = b"\xa5" * MiB
    try:
        with open(path, "wb") as f:
            for _ in range(size // MiB):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno or -1
    return 0


@pytest.fixture
def qfs(tmp_path: Path) -> Iterator[QuotaFs]:
    fs = QuotaFs(tmp_path / "dq", size_mb=1024)
    fs.ensure()
    try:
        yield fs
    finally:
        for name in fs.volumes():
            fs.destroy_volume(name)
        assert fs.release()
        assert not mounts_under(tmp_path)
        assert not fs.image.exists(), "an empty quota file system goes with the last volume"


def test_ensure_is_idempotent_and_the_image_sparse(qfs: QuotaFs) -> None:
    first = find_mount(qfs.mnt)
    assert first is not None and first.fstype == "btrfs"
    qfs.ensure()
    QuotaFs(qfs.root).ensure()  # a restarted edge: a new object finds it mounted and uses it
    assert len([m for m in mounts_under(qfs.root)]) == 1
    assert find_mount(qfs.mnt) == first
    assert qfs.size_bytes() > 900 * MiB
    assert qfs.image.stat().st_blocks * 512 < 64 * MiB, "the image must be sparse"
    # Attached with autoclear and direct I/O (no second copy of its pages in the host's cache).
    dev = _loop_for(qfs.image)
    assert dev is not None
    sysfs = Path("/sys/block", Path(dev).name, "loop")
    assert (sysfs / "autoclear").read_text().strip() == "1"


def test_a_volume_stops_writes_at_its_limit_and_deleting_frees_it(qfs: QuotaFs) -> None:
    vol = qfs.create_volume("sb-a", 32 * MiB)
    other = qfs.create_volume("sb-b", 32 * MiB)
    assert _write(vol / "small", 8 * MiB) == 0
    assert _write(vol / "big", 64 * MiB) == errno.EDQUOT
    _sync(qfs.mnt)
    assert 30 * MiB <= qfs.usage("sb-a") <= 33 * MiB
    # The neighbour and the file system are untouched by the full one.
    assert _write(other / "f", 16 * MiB) == 0
    (vol / "big").unlink()
    (vol / "small").unlink()
    _sync(qfs.mnt)
    assert qfs.usage("sb-a") < 1 * MiB
    assert _write(vol / "again", 24 * MiB) == 0
    # Empty files cost metadata bytes, so they run into the same limit (~360 B each here):
    # there is no shared inode table to exhaust, as ext4 would have.
    tiny = qfs.create_volume("sb-tiny", 2 * MiB)
    made = 0
    with pytest.raises(OSError) as exc:
        for made in range(1_000_000):
            (tiny / f"e{made}").touch()
    assert exc.value.errno == errno.EDQUOT and made > 1000
    # Lifted, then set again (what a pack does while the sandbox is frozen).
    qfs.set_limit("sb-a", None)
    assert _write(vol / "past", 16 * MiB) == 0
    qfs.set_limit("sb-a", 32 * MiB)
    assert _write(vol / "more", 8 * MiB) == errno.EDQUOT


async def test_destroy_removes_the_volume_and_the_kernel_drops_its_qgroup(qfs: QuotaFs) -> None:
    vol = qfs.create_volume("sb-gone", 16 * MiB)
    qgroup = qfs.qgroup_dir(qfs.volume_id("sb-gone"))
    assert (qgroup / "max_referenced").read_text().strip() == str(16 * MiB)
    assert _write(vol / "f", 8 * MiB) == 0
    assert qfs.destroy_volume("sb-gone")
    assert not vol.exists() and qfs.volumes() == []
    assert not qfs.destroy_volume("sb-gone")  # idempotent
    qfs.commit()  # what the backend does after a stop: the cleaner drops it now, not in 30 s

    await eventually(lambda: not qgroup.exists(), "the qgroup of a destroyed volume to go")


def test_the_file_system_survives_release_and_a_new_mount(qfs: QuotaFs) -> None:
    vol = qfs.create_volume("sb-keep", 16 * MiB)
    (vol / "kept").write_text("still here\n")
    assert not qfs.release(), "a volume is left: it must stay mounted"
    # As after a reboot: unmounted (the loop device detaches itself), then mounted again.
    _linux.umount(qfs.mnt)
    deadline = time.monotonic() + DEADLINE_S
    while _loop_for(qfs.image) is not None:  # autoclear: no loop device outlives the mount
        assert time.monotonic() < deadline, "the loop device stayed attached"
        time.sleep(0.01)
    qfs.ensure()
    assert (qfs.path("sb-keep") / "kept").read_text() == "still here\n"
    assert _write(qfs.path("sb-keep") / "big", 32 * MiB) == errno.EDQUOT


# -- the container backend over it ------------------------------------------------------------


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ContainerBackend]:
    ct = ContainerBackend(tmp_path / "data", disk_quota_mb=1024)
    await ct.prepare_node()
    assert not ct.disk_quota.image.exists(), "a node makes its quota file system on first use"
    yield ct
    for sid in await ct.leftovers():
        await ct.destroy(sid, {}, tmp_path / "sandboxes" / sid)
    await ct.release_node()
    assert not mounts_under(tmp_path), "the quota file system must go with the last sandbox"
    assert not ct.disk_quota.image.exists()


@pytest.fixture
async def made(backend: ContainerBackend, tmp_path: Path) -> AsyncIterator[Made]:
    m = Made(backend, build_layers(tmp_path / "layers"), tmp_path)
    try:
        yield m
    finally:
        await m.cleanup()


async def test_a_quota_d_sandbox_gets_edquot_inside_and_its_neighbour_does_not(
    backend: ContainerBackend, made: Made
) -> None:
    ctx, handle = await made.create(made.ctx(disk_limit_mb=24))
    plain_ctx, plain = await made.create()
    assert handle.disk_limit_mb == 24 and "disk_limit_mb" not in plain.dump()
    assert ctx.workdir.is_symlink() and ctx.workdir.resolve() == backend.disk_quota.path(ctx.sandbox_id)
    assert plain_ctx.workdir.is_dir() and not plain_ctx.workdir.is_symlink()
    dd = "/bin/busybox dd if=/dev/zero of=/tmp/{} bs=1M count={}"
    _, err, code = await run(backend, ctx, handle, ["sh", "-c", dd.format("small", 8)])
    assert code == 0, err
    _, err, code = await run(backend, ctx, handle, ["sh", "-c", dd.format("big", 64)])
    assert code != 0 and b"Disk quota exceeded" in err, err
    _, err, code = await run(backend, plain_ctx, plain, ["sh", "-c", dd.format("big", 64)])
    assert code == 0, err
    # What a pack does: hard-link the upper directory into the workdir, even when full.
    async with backend.writable_layer(ctx.sandbox_id, handle, ctx.workdir) as upper:
        staging = ctx.workdir / "pack"
        staging.mkdir()
        cp = ["cp", "-a", "--link", f"{upper}/.", f"{staging}/"]
        done = await asyncio.to_thread(subprocess.run, cp, capture_output=True)
        assert done.returncode == 0, done.stderr
        assert (staging / "tmp" / "small").stat().st_nlink == 2
        shutil.rmtree(staging)
    # Thawed with the limit back on.
    _, err, code = await run(backend, ctx, handle, ["sh", "-c", dd.format("big2", 64)])
    assert b"Disk quota exceeded" in err
    _, err, code = await run(backend, ctx, handle, ["sh", "-c", "rm -f /tmp/big /tmp/big2 && sync"])
    assert code == 0, err
    _, err, code = await run(backend, ctx, handle, ["sh", "-c", dd.format("fits", 12)])
    assert code == 0, err
    assert "disk_quota" in backend.capabilities() and backend.capabilities()["disk_quota"]


async def test_destroy_and_orphans_leave_no_volume(backend: ContainerBackend, made: Made) -> None:
    ctx, _ = await made.create(made.ctx(disk_limit_mb=16))
    vid = backend.disk_quota.volume_id(ctx.sandbox_id)
    assert ctx.sandbox_id in await backend.leftovers()
    # A new backend on the same data dir (an edge restart) finds it and can destroy it with
    # nothing but its ID, as the edge does with orphans.
    again = ContainerBackend(backend.data_dir, disk_quota_mb=1024)
    await again.prepare_node()
    assert ctx.sandbox_id in await again.leftovers()
    await again.destroy(ctx.sandbox_id, {}, ctx.workdir)
    assert not ctx.workdir.exists() and not ctx.workdir.is_symlink()
    assert backend.disk_quota.volumes() == []
    qgroup = backend.disk_quota.qgroup_dir(vid)

    def dropped() -> bool:
        _sync(backend.disk_quota.mnt)
        return not qgroup.exists()

    await eventually(dropped, "the destroyed sandbox's qgroup to go", timeout=60)


async def test_a_limit_larger_than_the_node_can_hold_is_refused(
    backend: ContainerBackend, made: Made
) -> None:
    with pytest.raises(CapacityExhausted, match="disk_limit_mb"):
        await made.create(made.ctx(disk_limit_mb=4096))
    assert backend.disk_quota.volumes() == []
    assert not (made.tmp / "sandboxes").exists() or not list((made.tmp / "sandboxes").iterdir())
