"""Forking a running VM: one snapshot restored n times over copy-on-write disks.

The source VM is stopped for a moment: its memory and device state go to a file and its
writable disk is copied (sparse), then it continues. Each copy is a new QEMU that loads that
state over a qcow2 overlay of the copied disk, and gets its clock and entropy refreshed. The
copies share the source's files until the last of them stops: each holds a reference in
``<source>/refs``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.backends.base import CreateContext
from dsec.backends.handle import ForkSource, Handle
from dsec.backends.microvm import host, qemu
from dsec.backends.microvm.channel import AgentChannel
from dsec.backends.microvm.handle import MicroVmForkSource, MicroVmHandle, RecordedVm
from dsec.backends.microvm.vmm import Vmm
from dsec.backends.microvm.vsock import Cids
from dsec.protocol.errors import InvalidRequest


def new_source_dir(root: Path) -> Path:
    source = root / secrets.token_hex(8)
    (source / "refs").mkdir(parents=True)
    return source


def take(source: Path, sandbox_id: str) -> None:
    (source / "refs" / sandbox_id).touch()


def drop(source: Path, sandbox_id: str | None) -> None:
    """Forget one copy's reference (None: none); remove the source when none is left."""
    refs = source / "refs"
    if sandbox_id is not None:
        (refs / sandbox_id).unlink(missing_ok=True)
    try:
        left = os.listdir(refs)
    except FileNotFoundError:
        return
    if not left:
        shutil.rmtree(source, ignore_errors=True)


def describe(source: Path, disk: Path, disk_format: str, vm: RecordedVm) -> MicroVmForkSource:
    return MicroVmForkSource(
        dir=str(source), state=str(source / "state"), disk=str(disk), format=disk_format, vm=vm
    )


class VmForks:
    """Mixed into :class:`~dsec.backends.microvm.backend.MicroVMBackend`."""

    if TYPE_CHECKING:
        state_dir: Path
        handle_type: type[MicroVmHandle]
        vmm: Vmm
        cids: Cids
        _channels: dict[str, AgentChannel]

        async def prefetch(self, sandbox_id: str, handle: Handle) -> int: ...
        async def thaw(self, sandbox_id: str, handle: Handle) -> None: ...
        async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None: ...
        async def _start(
            self, sandbox_id: str, config: qemu.MicroVMConfig, handle: MicroVmHandle
        ) -> None: ...
        async def _record(self, sandbox_id: str, handle: MicroVmHandle) -> None: ...

    async def fork_source(self, sandbox_id: str, handle: Handle) -> MicroVmForkSource:
        h = self.handle_type.of(handle)
        if h.has_tap():
            # Copies would share its tap and the address its guest configured: not yet.
            raise InvalidRequest("a VM with a network card (created with network rules) cannot be forked yet")
        if h.snapshot:
            await self.prefetch(sandbox_id, h)  # a paused VM: bring it back first
            await self.thaw(sandbox_id, h)
        source = new_source_dir(self.state_dir / "forks")
        vm = h.recorded().model_copy()
        disk = Path(str(vm.root_disk or vm.rw_disk))
        fmt = "qcow2" if vm.root_disk else vm.rw_format
        copy = source / f"disk.{fmt}"
        async with self.vmm.control(host.socket_dir(Path(h.dir)) / "qmp.sock") as control:
            await control.stop()
            try:
                await control.save(source / "state")
                # A qcow2 copy keeps pointing at the same backing file (a template's disk or
                # a VM's base image), which outlives it.
                await host.run_tool("cp", "--sparse=always", str(disk), str(copy))
            finally:
                await control.cont()
        return describe(source, copy, fmt, vm)

    async def create_fork(self, ctx: CreateContext, source: ForkSource) -> MicroVmHandle:
        assert isinstance(source, MicroVmForkSource), "a fork source of this backend's"
        work = ctx.workdir
        work.mkdir(parents=True, exist_ok=True)
        socks = host.socket_dir(work)
        socks.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = self.handle_type(sid=ctx.sandbox_id, dir=str(work), sockets=str(socks))
        try:
            config = source.vm.config()
            overlay = work / "disk.qcow2"
            await host.run_tool(
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                source.disk,
                "-F",
                source.format,
                str(overlay),
            )
            if config.root_disk is not None:
                config.root_disk = overlay
            else:
                config.rw_disk, config.rw_format = overlay, "qcow2"
            config.agent_socket, config.qmp_socket = socks / "agent.sock", socks / "qmp.sock"
            config.serial_log, config.incoming = work / "console.log", True
            if config.vsock_cid is not None:
                # The same device as the source (its saved state has it), at a CID of its own:
                # the CID is QEMU's command line, not migrated state, and the guest learns the
                # new one from the transport reset vhost-vsock sends after the load.
                config.vsock_cid = handle.vsock_cid = await asyncio.to_thread(self.cids.claim, work)
            await self._start(ctx.sandbox_id, config, handle)
            async with self.vmm.control(config.qmp_socket) as control:
                await control.load(Path(source.state))
                await control.cont()
            channel = await AgentChannel.connect(host.config_addr(config), 30.0, booting=False)
            self._channels[ctx.sandbox_id] = channel
            await host.refresh_guest(channel)
            take(Path(source.dir), ctx.sandbox_id)
            handle.fork_source = source.dir
            await self._record(ctx.sandbox_id, handle)
            return handle
        except BaseException:
            await asyncio.shield(self.destroy(ctx.sandbox_id, handle, work))
            raise

    async def release_fork_source(self, source: ForkSource) -> None:
        assert isinstance(source, MicroVmForkSource), "a fork source of this backend's"
        await asyncio.to_thread(drop, Path(source.dir), None)
