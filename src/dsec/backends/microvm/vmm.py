"""The seam between the VM backends and the virtual machine monitor that runs a guest.

The backends never talk to QEMU directly: they start a machine (:meth:`Vmm.start`) and then
drive it through :class:`VmControl`: stop and continue its vCPUs, save its memory and device
state to a file, load such a file into a machine started to receive it, quit. That is all a
pause, a template, a clone and a fork need, and it is what Firecracker's API offers too (``PUT
/vm`` Paused/Resumed, ``PUT /snapshot/create``, ``PUT /snapshot/load``): a Firecracker driver
is another :class:`Vmm`, with the same guest kit and agent (virtio-mmio, a vsock instead of the
virtio-serial port). :class:`QemuVmm` is the one here. Full VMs use QEMU-only calls as well
(screendump, input events) through :meth:`QmpControl.execute`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

from dsec.backends.microvm import qemu


class VmControl(Protocol):
    async def stop(self) -> None:
        """Stop the vCPUs (the guest is frozen; its memory stays)."""

    async def cont(self) -> None: ...

    async def save(self, path: Path) -> None:
        """Memory and device state to ``path`` (RAM in a shared memory file is left out)."""

    async def load(self, path: Path) -> None:
        """Into a machine started with ``incoming``: take its state from ``path``."""

    async def quit(self) -> None: ...


class Vmm(Protocol):
    name: str

    async def start(self, config: qemu.MicroVMConfig, workdir: Path) -> int:
        """Start the machine detached from the edge (it outlives an edge restart); its pid."""
        ...

    def control(self, socket: Path) -> AbstractAsyncContextManager[VmControl]: ...

    async def detect_accel(self, kit: Any, state_dir: Path) -> qemu.Accel: ...


class QmpControl:
    def __init__(self, qmp: qemu.Qmp) -> None:
        self.qmp = qmp

    async def execute(self, command: str, **arguments: Any) -> Any:
        return await self.qmp.execute(command, **arguments)

    async def stop(self) -> None:
        await self.qmp.execute("stop")

    async def cont(self) -> None:
        await self.qmp.execute("cont")

    async def save(self, path: Path) -> None:
        await self.qmp.migrate("migrate", f"exec:cat > {path}")

    async def load(self, path: Path) -> None:
        await self.qmp.migrate("migrate-incoming", f"exec:cat {path}")

    async def quit(self) -> None:
        await self.qmp.execute("quit")


class QemuVmm:
    name = "qemu"

    async def start(self, config: qemu.MicroVMConfig, workdir: Path) -> int:
        return await qemu.start_daemon(config, workdir / "qemu.pid", workdir / "qemu.log")

    @asynccontextmanager
    async def control(self, socket: Path) -> AsyncIterator[QmpControl]:
        client = await qemu.Qmp.connect(socket)
        try:
            yield QmpControl(client)
        finally:
            await client.close()

    async def detect_accel(self, kit: Any, state_dir: Path) -> qemu.Accel:
        return await qemu.detect_accel(kit, state_dir)
