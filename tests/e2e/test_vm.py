"""Full VMs on the real runtime: QEMU q35 booting Debian's full kernel from a disk image made
of the layers, the same SDK calls as a container, and a display the guest draws on."""

from __future__ import annotations

import asyncio
import shutil
import struct
import time
import uuid
import zlib
from pathlib import Path

import pytest

from dsec import DSecClient, DSecVMRunArgs, InvalidRequest, SandboxState
from dsec.apiserver.vm_images import vm_image_store
from dsec.backends.vm.backend import FullVMBackend
from dsec.backends.vm.handle import VmHandle
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, Sandboxes
from tests.e2e import bootable
from tests.support import eventually

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
]


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB pixels) of an 8-bit RGB/RGBA PNG (what QEMU writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 3
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * channels, [], bytearray(width * channels)
    for y in range(height):
        line = raw[y * (stride + 1) : (y + 1) * (stride + 1)]
        kind, row = line[0], bytearray(line[1:])
        for i in range(stride):
            left = row[i - channels] if i >= channels else 0
            up, corner = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                row[i] = (row[i] + left) & 0xFF
            elif kind == 2:
                row[i] = (row[i] + up) & 0xFF
            elif kind == 3:
                row[i] = (row[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                row[i] = (row[i] + pred) & 0xFF
        rows.append(bytes(b for x in range(width) for b in row[x * channels : x * channels + 3]))
        prev = row
    return width, height, rows


async def test_a_full_vm_boots_its_disk_runs_the_sdk_and_shows_what_it_draws(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    vm: Sandbox = await client.run_vm(DSecVMRunArgs(container_image=BASE, memory_limit_mb=512, disk_mb=2048))
    try:
        assert vm.info.backend == "vm"
        # The base it boots from survives a collection with no grace at all: its handle names it.
        backend = next(b for b in node.more_backends if isinstance(b, FullVMBackend))
        record = node.edge.journal.get(vm.id)
        assert record is not None and VmHandle.of(record.handle).base in backend.bases_in_use()
        backend.base_grace_s, grace = 0.0, backend.base_grace_s
        try:
            assert backend.collect_unused() == []
        finally:
            backend.base_grace_s = grace
        assert backend.bases.image(str(VmHandle.of(record.handle).base)).exists()
        kernel = (await vm.run_shell("uname -r")).stdout.strip()
        assert kernel.endswith("-amd64") and "cloud" not in kernel, "Debian's full kernel"
        assert (await vm.run_shell("df --output=fstype / | tail -1")).stdout.strip() == "ext4"
        await vm.write_file("/root/note", "on the VM's own disk")
        assert await vm.read_file("/root/note") == b"on the VM's own disk"

        # The guest paints the top 100 rows of its 1024x768x16 framebuffer white...
        drawn = await vm.run_shell("head -c 204800 /dev/zero | tr '\\000' '\\377' > /dev/fb0 && echo ok")
        assert drawn.stdout == "ok\n", drawn
        width, height, rows = decode_png(await vm.screenshot())
        assert (width, height) == (1024, 768)
        # ...and the screenshot shows exactly that: white above, the console's black below.
        assert set(rows[50]) == {0xFF} and rows[150].count(0xFF) < len(rows[150]) // 10

        # A key pressed on the host arrives on the guest's keyboard as input events.
        # The device is opened before the file is made: once it is there, dd holds it open.
        # (Its /proc/PID/fd is not this test's to look at: each session has a Landlock domain.)
        wait_key = "{ : >/root/opened; dd bs=24 count=2 of=/root/keys 2>/dev/null; } </dev/input/event0"
        reader = asyncio.ensure_future(vm.run_shell(wait_key, session="keys", timeout=60))

        async def reading() -> bool:
            if reader.done():  # it should be waiting for the key: surface why it is not
                raise AssertionError(f"the key reader ended early: {reader.result()}")
            # Once the device is open (a key pressed before that is nobody's).
            return (await vm.run_shell("test -e /root/opened && echo yes")).stdout == "yes\n"

        await eventually(reading, "the guest to wait for a key", 30)
        assert await vm.press("a") > 0
        assert (await reader).exit_code == 0
        assert (await vm.stat("/root/keys")).size == 48, "two input events (the key, a sync) arrived"

        # The tablet points absolutely: the guest reads the very coordinates the host sent.
        find = "grep -A4 'Virtio Tablet' /proc/bus/input/devices | grep -o 'event[0-9]*'"
        tablet = (await vm.run_shell(find)).stdout.strip()
        assert tablet.startswith("event"), tablet
        wait_point = "{ : >/root/opened2; dd bs=24 count=3 of=/root/point 2>/dev/null; } "
        wait_point += f"</dev/input/{tablet}"
        pointer = asyncio.ensure_future(vm.run_shell(wait_point, session="point", timeout=60))

        async def pointing() -> bool:
            if pointer.done():
                raise AssertionError(f"the pointer reader ended early: {pointer.result()}")
            return (await vm.run_shell("test -e /root/opened2 && echo yes")).stdout == "yes\n"

        await eventually(pointing, "the guest to wait for the pointer", 30)
        await vm.point(512, 384)
        await pointer
        raw = await vm.read_file("/root/point")
        events = [struct.unpack_from("<HHi", raw, 16 + 24 * i) for i in range(3)]
        got = {code: value for kind, code, value in events if kind == 3}  # EV_ABS: ABS_X 0, ABS_Y 1
        assert got == {0: 512 * 0x7FFF // 1023, 1: 384 * 0x7FFF // 767}, events
        with pytest.raises(InvalidRequest):
            await vm.point(2000, 10)  # off the screen

        with pytest.raises(InvalidRequest):  # one disk image, not layers: said, not faked
            await vm.pack_diff("test/full-vm")
        with pytest.raises(InvalidRequest):  # a container has no screen: said, not faked
            await (await make_sandbox()).screenshot()
        assert (await vm.pause()).state is SandboxState.paused
        assert (await vm.read_file("/root/note")) == b"on the VM's own disk"  # resumed from the file
    finally:
        await vm.stop()


@pytest.mark.skipif(not bootable.can_build(), reason="syslinux, mtools or dosfstools is not installed")
async def test_a_vm_boots_a_users_imported_image_through_its_own_bootloader(
    client: DSecClient, node: EmbeddedNode, tmp_path: Path
) -> None:
    backend = next(b for b in node.more_backends if isinstance(b, FullVMBackend))
    assert backend.kit is not None
    # A disk no DSec code prepared: an MBR, a FAT partition, SYSLINUX, a kernel and initramfs
    # (ours, so the agent answers inside; init finds no DSec disks and keeps the initramfs as root).
    disk = tmp_path / "desk.raw"
    append = "console=ttyS0 vga=791 panic=-1 tsc_early_khz=2000000 tsc=reliable dsec.root=initramfs"
    await asyncio.to_thread(bootable.build, disk, backend.kit.kernel, backend.kit.initramfs, append)
    images = vm_image_store(node.store)
    info = await client.import_vm_image(disk, "test/bootable:1")
    vm = None
    try:
        assert info.virtual_size == disk.stat().st_size
        vm = await client.run_vm(DSecVMRunArgs(disk_image="test/bootable:1", memory_limit_mb=384))
        assert "dsec.root=initramfs" in (await vm.exec(["cat", "/proc/cmdline"], timeout=120)).stdout
        # What the guest draws is what the screenshot shows (the console alone may be blank:
        # its kernel messages go to the serial port, its cursor blinks).
        drawn = await vm.exec(
            ["sh", "-c", "head -c 204800 /dev/zero | tr '\\000' '\\377' > /dev/fb0"], timeout=60
        )
        assert drawn.exit_code == 0, drawn
        width, height, rows = decode_png(await vm.screenshot())
        assert (width, height) == (1024, 768)
        assert set(rows[50]) == {0xFF}, "the guest's white band is on the screen"
        await vm.write_file("/note", "written through the agent")
        assert (await vm.pause()).state is SandboxState.paused
        assert await vm.read_file("/note") == b"written through the agent"
        assert info.digest in await asyncio.to_thread(backend.images_in_use)
    finally:
        if vm is not None:
            await vm.stop()
        images.remove("test/bootable:1")
        images.blob(info.digest).unlink(missing_ok=True)


async def test_layer_gc_removes_vm_bases_nobody_uses_once_idle_or_orphaned(
    client: DSecClient, node: EmbeddedNode
) -> None:
    # No VM booted: bases planted beside the real ones, collected through the API's gc round.
    backend = next(b for b in node.more_backends if isinstance(b, FullVMBackend))
    bases = backend.bases
    bases.root.mkdir(parents=True, exist_ok=True)
    base_digest = node.store.resolve_image(BASE)[0].digest
    gone_digest = "sha256:" + uuid.uuid4().hex * 2  # a layer no store holds
    orphan = bases.key([gone_digest], 16)
    young = bases.key([base_digest], 16)
    stale = bases.key([base_digest], 17)
    planted = (orphan, young, stale)
    try:
        for key, layers in ((orphan, [gone_digest]), (young, [base_digest]), (stale, [base_digest])):
            bases.image(key).write_bytes(b"not a disk")
            bases.used(key, layers, 16)
        bases.used(stale, [base_digest], 17, now=time.time() - 2 * backend.base_grace_s)
        await client.gc_layers()
        assert [bases.image(k).exists() for k in planted] == [False, True, False]
        assert not bases.sidecar(orphan).exists() and bases.read(young) is not None
    finally:
        for key in planted:
            bases.image(key).unlink(missing_ok=True)
            bases.sidecar(key).unlink(missing_ok=True)
