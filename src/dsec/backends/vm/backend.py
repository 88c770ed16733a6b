"""Full-VM sandboxes: QEMU q35 booting Debian's full kernel from a disk image, with a display.

The root disk is built from the sandbox's layers once per (layers, size): the layers are
stacked with overlayfs in a throw-away mount namespace and copied into an ext4 image
(``mkfs.ext4 -d``), converted to qcow2, and shared by every VM of that kind; each sandbox gets a
copy-on-write qcow2 overlay over it. The guest runs the same initramfs and agent as a microVM
(a ``dsec-root`` disk instead of layers), so processes, files, pause and restarts work the same.
The machine has a VGA display (1024x768, the guest's VESA framebuffer) and a PS/2 keyboard and
mouse: :meth:`screenshot` and :meth:`send_input` go through QMP. Not yet: importing a user's own
bootable image (it would need firmware boot instead of our kernel), an absolute pointer.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from dsec.backends.base import CreateContext
from dsec.backends.microvm import qemu
from dsec.backends.microvm.backend import BOOT_TIMEOUT_S, DEFAULT_DISK_MB, MicroVMBackend
from dsec.backends.microvm.channel import AgentChannel
from dsec.backends.microvm.host import run_tool, socket_dir
from dsec.backends.microvm.vmm import QemuVmm, QmpControl
from dsec.backends.vm.display import qmp_events
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import InputEvent


class FullVMBackend(MicroVMBackend):
    name = "vm"
    flavour = "generic"  # Debian's full kernel: it has the VESA framebuffer the display needs

    def __init__(
        self, data_dir: Path, *, accel: qemu.Accel | None = None, kit_dir: Path | None = None
    ) -> None:
        super().__init__(data_dir, accel=accel, kit_dir=kit_dir, use_templates=False)
        self.bases = self.state_dir / "bases"
        self._base_locks: dict[str, asyncio.Lock] = {}

    async def _boot(self, ctx: CreateContext, config: qemu.MicroVMConfig, handle: dict[str, Any]) -> None:
        disk_mb = int(getattr(ctx.spec, "disk_mb", DEFAULT_DISK_MB))
        base = await self._base_image(ctx.layer_digests, ctx.layer_dirs, disk_mb)
        root = Path(handle["dir"]) / "root.qcow2"
        await run_tool("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(root))
        config.machine, config.root_disk = "q35", root
        await self._start(ctx.sandbox_id, config, handle)
        self._channels[ctx.sandbox_id] = await AgentChannel.connect(config.agent_socket, BOOT_TIMEOUT_S)

    async def _base_image(self, digests: list[str], dirs: list[Path], disk_mb: int) -> Path:
        """The shared base image of these layers (built on first use, then reused)."""
        key = hashlib.sha256(repr((digests, disk_mb)).encode()).hexdigest()[:24]
        image = self.bases / f"{key}.qcow2"
        async with self._base_locks.setdefault(key, asyncio.Lock()):
            if not image.exists():
                await asyncio.to_thread(_build_base, dirs, disk_mb, image)
        return image

    def qemu(self, handle: dict[str, Any]) -> AbstractAsyncContextManager[QmpControl]:
        """QEMU's own control of the VM: display and input are QEMU calls (no other monitor)."""
        if not isinstance(self.vmm, QemuVmm):
            raise InfraFailure(f"full VMs need QEMU, not {self.vmm.name}", reason="runtime")
        return self.vmm.control(socket_dir(Path(handle["dir"])) / "qmp.sock")

    @asynccontextmanager
    async def writable_layer(
        self, sandbox_id: str, handle: dict[str, Any], workdir: Path
    ) -> AsyncIterator[Path]:
        raise InvalidRequest("a full VM's disk is one image, not layers: it cannot be packed or diffed")
        yield workdir  # (unreachable: makes this the generator asynccontextmanager needs)

    async def screenshot(self, sandbox_id: str, handle: dict[str, Any]) -> bytes:
        """What the VM's display shows now, as a PNG."""
        shot = Path(handle["dir"]) / "screen.png"
        async with self.qemu(handle) as control:
            await control.execute("screendump", filename=str(shot), format="png")
        try:
            return await asyncio.to_thread(shot.read_bytes)
        finally:
            await asyncio.to_thread(shot.unlink, True)

    async def send_input(self, sandbox_id: str, handle: dict[str, Any], events: list[InputEvent]) -> int:
        """Send keyboard and mouse events to the VM; returns how many QEMU input events that was."""
        translated = qmp_events(events)
        async with self.qemu(handle) as control:
            for i in range(0, len(translated), 64):  # QEMU queues them in order
                await control.execute("input-send-event", events=translated[i : i + 64])
        return len(translated)

    def capabilities(self) -> dict[str, Any]:
        inputs = ["key", "text", "move", "point", "click"]
        return {**super().capabilities(), "display": "1024x768", "input": inputs}


def _build_base(dirs: list[Path], disk_mb: int, image: Path) -> None:
    """Layers (base first) -> one ext4 image with their union -> qcow2 at ``image``."""
    image.parent.mkdir(parents=True, exist_ok=True)
    raw = image.with_suffix(".raw.tmp")
    part = image.with_suffix(".qcow2.tmp")
    try:
        with open(raw, "wb") as fh:
            fh.truncate(disk_mb << 20)
        mkfs = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "nodiscard", "-d"]
        if len(dirs) == 1:
            argv = [*mkfs, str(dirs[0]), str(raw)]
        else:
            # overlayfs resolves the layers' whiteouts; mounted where only this command sees it.
            lower = ":".join(str(d) for d in reversed(dirs))
            merged = image.with_suffix(".merged")
            merged.mkdir(exist_ok=True)
            script = (
                f'mount -t overlay overlay -o "lowerdir={lower}" "{merged}" && '
                f'{" ".join(mkfs)} "{merged}" "{raw}"'
            )
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise InfraFailure(
                f"building the VM's disk failed: {done.stderr.strip()[-500:]}", reason="runtime"
            )
        done = subprocess.run(
            ["qemu-img", "convert", "-O", "qcow2", str(raw), str(part)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise InfraFailure(f"qemu-img convert failed: {done.stderr.strip()}", reason="runtime")
        os.replace(part, image)
    finally:
        raw.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        merged = image.with_suffix(".merged")
        if merged.exists():
            merged.rmdir()
