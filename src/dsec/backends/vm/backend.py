"""Full-VM sandboxes: QEMU q35 booting Debian's full kernel from a disk image, with a display.

The root disk is built from the sandbox's layers once per (layers, size): the layers are
stacked with overlayfs in a throw-away mount namespace and copied into an ext4 image
(``mkfs.ext4 -d``), converted to qcow2, and shared by every VM of that kind; each sandbox gets a
copy-on-write qcow2 overlay over it. The guest runs the same initramfs and agent as a microVM
(a ``dsec-root`` disk instead of layers), so processes, files, pause and restarts work the same.
The machine has a VGA display (1024x768, the guest's VESA framebuffer) and a PS/2 keyboard and
mouse: :meth:`screenshot` and :meth:`send_input` go through QMP.

A VM may instead boot a user's imported image (``disk_image``, :mod:`dsec.images.vm_images`):
firmware (SeaBIOS) runs the image's own bootloader from a qcow2 overlay over the shared stored
file. Lifecycle, display, input and pause need nothing inside; processes and files need the
DSec agent on the virtio-serial port, which such an image may not run: the first call waits
for its READY up to the boot deadline, and without it answers that the image has no agent.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from dsec.backends.base import CreateContext
from dsec.backends.handle import Handle
from dsec.backends.microvm import qemu
from dsec.backends.microvm.backend import BOOT_TIMEOUT_S, DEFAULT_DISK_MB, MicroVMBackend
from dsec.backends.microvm.channel import AgentChannel
from dsec.backends.microvm.handle import MicroVmHandle
from dsec.backends.microvm.host import config_addr, run_tool, socket_dir
from dsec.backends.microvm.vmm import QemuVmm, QmpControl
from dsec.backends.vm import bases
from dsec.backends.vm.display import qmp_events
from dsec.backends.vm.handle import VmHandle
from dsec.images.vm_images import VmImageStore
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import InputEvent


class FullVMBackend(MicroVMBackend):
    name = "vm"
    handle_type = VmHandle
    flavour = "generic"  # Debian's full kernel: it has the VESA framebuffer the display needs

    def __init__(
        self,
        data_dir: Path,
        *,
        accel: qemu.Accel | None = None,
        kit_dir: Path | None = None,
        vm_images: VmImageStore | None = None,
        layer_exists: Callable[[str], bool] | None = None,
        base_grace_s: float = bases.GRACE_S,
        agent_channel: str = "auto",
    ) -> None:
        super().__init__(
            data_dir, accel=accel, kit_dir=kit_dir, use_templates=False, agent_channel=agent_channel
        )
        self.bases = bases.Bases(self.state_dir / "bases")
        self.layer_exists = layer_exists  # whether the store still holds a layer (gc of bases)
        self.base_grace_s = base_grace_s
        self._base_locks: dict[str, asyncio.Lock] = {}
        # Bases a create is building or about to boot from (before its handle names them).
        self._taking: Counter[str] = Counter()
        self.vm_images = vm_images
        self._agent_waits: dict[str, asyncio.Task[AgentChannel]] = {}

    async def _boot(self, ctx: CreateContext, config: qemu.MicroVMConfig, handle: MicroVmHandle) -> None:
        handle = VmHandle.of(handle)  # made by handle_type: the same object
        ref = getattr(ctx.spec, "disk_image", None)
        if ref is not None:
            await self._boot_image(ctx.sandbox_id, ref, config, handle)
            return
        disk_mb = int(getattr(ctx.spec, "disk_mb", DEFAULT_DISK_MB))
        key = self.bases.key(ctx.layer_digests, disk_mb)
        self._taking[key] += 1  # a collection now must not take the base from under this create
        try:
            base = await self._base_image(key, ctx.layer_digests, ctx.layer_dirs, disk_mb)
            root = Path(handle.dir) / "root.qcow2"
            await run_tool(
                "qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(root)
            )
            config.machine, config.root_disk = "q35", root
            handle.base = key  # what the collection of bases keeps while this VM lives
            await self._start(ctx.sandbox_id, config, handle)
        finally:
            self._taking[key] -= 1
            if not self._taking[key]:
                del self._taking[key]
        self._channels[ctx.sandbox_id] = await AgentChannel.connect(config_addr(config), BOOT_TIMEOUT_S)

    async def _base_image(self, key: str, digests: list[str], dirs: list[Path], disk_mb: int) -> Path:
        """The shared base image of these layers (built on first use, then reused)."""
        image = self.bases.image(key)
        async with self._base_locks.setdefault(key, asyncio.Lock()):
            if not image.exists():
                await asyncio.to_thread(_build_base, dirs, disk_mb, image)
            await asyncio.to_thread(self.bases.used, key, digests, disk_mb)
        return image

    async def _boot_image(
        self, sandbox_id: str, ref: str, config: qemu.MicroVMConfig, handle: VmHandle
    ) -> None:
        if self.vm_images is None:
            raise InvalidRequest("this node has no VM image store")
        if config.tap is not None:  # our init configures the card; an image's own OS does not know how
            raise InvalidRequest("network rules are not available yet for VMs booting their own image")
        image = await asyncio.to_thread(self.vm_images.resolve, ref)  # LayerNotFound if unknown
        disk = Path(handle.dir) / "image.qcow2"
        base = self.vm_images.blob(image.digest)
        await run_tool("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(disk))
        config.machine, config.boot_disk = "q35", disk
        handle.disk_image = image.digest  # what gc must keep while this VM lives
        await self._start(sandbox_id, config, handle)
        # Created once QEMU runs: whether the image's guest runs our agent shows later.
        wait = asyncio.ensure_future(AgentChannel.connect(config.agent_socket, BOOT_TIMEOUT_S))
        self._agent_waits[sandbox_id] = wait

    async def _channel(self, sandbox_id: str, handle: MicroVmHandle) -> AgentChannel:
        if not VmHandle.of(handle).disk_image:
            return await super()._channel(sandbox_id, handle)
        wait = self._agent_waits.get(sandbox_id)
        try:
            if wait is not None:
                channel = await asyncio.shield(wait)
                if sandbox_id not in self._channels:
                    self._channels[sandbox_id] = channel
            return await super()._channel(sandbox_id, handle)
        except (TimeoutError, OSError) as exc:
            raise InvalidRequest(
                f"VM {sandbox_id} boots its own image, which runs no DSec guest agent (none answered"
                " on the dsec.agent port): processes and files need it; the display, input,"
                " pause and stop work without"
            ) from exc

    async def thaw(self, sandbox_id: str, handle: Handle) -> None:
        h = VmHandle.of(handle)
        if h.disk_image and sandbox_id not in self._channels:
            # No agent to reconnect to (or not known yet): the machine just carries on.
            if h.snapshot:
                await self.prefetch(sandbox_id, h)
            h.drop("resumed")
            await self._qmp(h, "cont")
            return
        await super().thaw(sandbox_id, h)

    async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None:
        wait = self._agent_waits.pop(sandbox_id, None)
        if wait is not None:
            wait.cancel()
            await asyncio.wait({wait})
            if not wait.cancelled() and wait.exception() is None:
                self._channels.setdefault(sandbox_id, wait.result())  # closed by the destroy
        await super().destroy(sandbox_id, handle, workdir)

    def bases_in_use(self) -> set[str]:
        """Keys of the bases this node's VMs (running or paused), fork snapshots and creates
        in flight stand on."""
        found = set(self._taking)
        root = self.bases.root
        for handle in self._journaled():
            key = handle.base
            if key is None and handle.vm is not None and handle.vm.root_disk:
                key = bases.base_of(Path(handle.vm.root_disk), root)  # a VM from before "base"
            if key:
                found.add(str(key))
        # A fork's saved disk is a copy of its VM's overlay, on the same base.
        for disk in (self.state_dir / "forks").glob("*/disk.qcow2"):
            if key := bases.base_of(disk, root):
                found.add(key)
        return found

    def collect_unused(self) -> list[str]:
        """Remove bases nobody uses that are idle past the grace period or lost a layer
        (driven by the layer gc's round through the edges); returns the removed keys."""
        in_use = self.bases_in_use()
        return self.bases.collect(in_use, self.layer_exists, grace_s=self.base_grace_s)

    def images_in_use(self) -> set[str]:
        """Digests of the imported images the VMs of this node boot from."""
        return {h.disk_image for h in self._journaled() if h.disk_image}

    def _journaled(self) -> Iterator[VmHandle]:
        """The handles of this node's VMs as journaled (an unreadable one is skipped)."""
        for state in self.state_dir.glob("sb-*.json") if self.state_dir.is_dir() else []:
            try:
                yield VmHandle.model_validate_json(state.read_text())
            except (OSError, ValueError):
                continue

    def qemu(self, handle: Handle) -> AbstractAsyncContextManager[QmpControl]:
        """QEMU's own control of the VM: display and input are QEMU calls (no other monitor)."""
        if not isinstance(self.vmm, QemuVmm):
            raise InfraFailure(f"full VMs need QEMU, not {self.vmm.name}", reason=InfraReason.runtime)
        return self.vmm.control(socket_dir(Path(VmHandle.of(handle).dir)) / "qmp.sock")

    @asynccontextmanager
    async def writable_layer(self, sandbox_id: str, handle: Handle, workdir: Path) -> AsyncIterator[Path]:
        raise InvalidRequest("a full VM's disk is one image, not layers: it cannot be packed or diffed")
        yield workdir  # (unreachable: makes this the generator asynccontextmanager needs)

    async def screenshot(self, sandbox_id: str, handle: Handle) -> bytes:
        """What the VM's display shows now, as a PNG."""
        shot = Path(VmHandle.of(handle).dir) / "screen.png"
        async with self.qemu(handle) as control:
            await control.execute("screendump", filename=str(shot), format="png")
        try:
            return await asyncio.to_thread(shot.read_bytes)
        finally:
            await asyncio.to_thread(shot.unlink, True)

    async def send_input(self, sandbox_id: str, handle: Handle, events: list[InputEvent]) -> int:
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
                f"building the VM's disk failed: {done.stderr.strip()[-500:]}", reason=InfraReason.runtime
            )
        done = subprocess.run(
            ["qemu-img", "convert", "-O", "qcow2", str(raw), str(part)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise InfraFailure(f"qemu-img convert failed: {done.stderr.strip()}", reason=InfraReason.runtime)
        os.replace(part, image)
    finally:
        raw.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        merged = image.with_suffix(".merged")
        if merged.exists():
            merged.rmdir()
