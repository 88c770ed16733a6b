"""MicroVM sandboxes: QEMU ``microvm`` with its own kernel, over the same EROFS layers.

Each sandbox is one daemonized QEMU (it outlives an edge restart, like a container's init),
its layers attached read-only exactly as the store keeps them, an ext4 disk for its writes, and
the guest agent on a virtio-serial port, or on vsock where the host has vhost-vsock
(:mod:`dsec.backends.microvm.vsock`); processes and files go through the agent
(:mod:`dsec.backends.microvm.channel`). The accelerator is chosen once per node
(:meth:`dsec.backends.microvm.vmm.Vmm.detect_accel`); the monitor behind the seam of
:mod:`dsec.backends.microvm.vmm` is QEMU. A VM created with network rules gets a virtio-net
card on a tap the edge made (:class:`~dsec.backends.base.Tapped`); others have no network device.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import HOST_PROCESSES, CreateContext, User
from dsec.backends.handle import Handle
from dsec.backends.microvm import forks, host, qemu, vsock
from dsec.backends.microvm.channel import AgentChannel, VmProcess
from dsec.backends.microvm.files import VmFileOps
from dsec.backends.microvm.forks import VmForks
from dsec.backends.microvm.handle import MicroVmHandle, RecordedVm
from dsec.backends.microvm.kit import GuestKit, ensure_kit
from dsec.backends.microvm.templates import TemplateKey, Templates
from dsec.backends.microvm.vmm import QemuVmm, Vmm
from dsec.executor.file_ops import FileOps
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

log = logging.getLogger("dsec.microvm")
DEFAULT_DISK_MB = 4096
# errno of a failed exec or chdir -> the exit code a shell reports (not found, cannot run).
_EXEC_FAILURES = {errno.ENOENT: 127, errno.ENOTDIR: 127, errno.EACCES: 126, errno.ENOEXEC: 126}
BOOT_TIMEOUT_S = 120.0  # TCG on a loaded 2-core host; a KVM boot takes well under a second


class MicroVMBackend(VmForks):
    name = "microvm"
    handle_type: type[MicroVmHandle] = MicroVmHandle
    flavour = "cloud"  # the guest kernel (kit.FLAVOURS)

    def __init__(
        self,
        data_dir: Path,
        *,
        accel: qemu.Accel | None = None,
        layer_file: Callable[[str], Path] | None = None,
        kit_dir: Path | None = None,
        use_templates: bool = True,
        vmm: Vmm | None = None,
        agent_channel: str = "auto",
        vsock_device: Path = vsock.VHOST_VSOCK,
        cid_root: Path | None = None,
    ) -> None:
        self.vmm: Vmm = vmm or QemuVmm()
        # How new VMs reach their agent: the setting, then (prepare_node) what the host allows.
        self.agent_channel = agent_channel
        self.vsock_device = vsock_device
        self.vhost_vsock = False
        self.channel: vsock.Channel = vsock.choose(agent_channel, False)
        # CIDs are one namespace for the host's kernel: claims are host-wide, not per data dir.
        self.cids = vsock.Cids(cid_root or host.SOCKET_ROOT / "cids")
        self.state_dir = data_dir / self.name
        self.kit_dir = kit_dir or data_dir / "guest-kit"
        self.accel: qemu.Accel = accel or "tcg"
        self._accel_given = accel is not None
        self.kit: GuestKit | None = None
        # digest -> the EROFS file QEMU attaches (the store's blob: no per-VM copy).
        self.layer_file = layer_file
        self.templates = Templates(self.state_dir / "templates")
        self.use_templates = use_templates
        self._channels: dict[str, AgentChannel] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    # -- node ---------------------------------------------------------------------------------

    async def prepare_node(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.kit = await asyncio.to_thread(ensure_kit, self.kit_dir, self.flavour)
        # Templates of an earlier guest kit can never be cloned again (the kit is in their key).
        removed = await asyncio.to_thread(self.templates.forget_other_kits, self.kit.key)
        if removed:
            log.info("removed %d templates of earlier guest kits", removed)
        if not self._accel_given:
            self.accel = await self.vmm.detect_accel(self.kit, self.state_dir.parent)
        await self.detect_channel()
        log.info(
            "microVMs on this node: %s, kernel %s, agent over %s",
            self.accel,
            self.kit.kernel_version,
            self.channel,
        )

    async def detect_channel(self) -> None:
        """Probe vhost-vsock once for the node (cached beside the accelerator's answer)."""
        self.vhost_vsock = await asyncio.to_thread(
            vsock.vhost_vsock_present, self.state_dir.parent, self.vsock_device
        )
        self.channel = vsock.choose(self.agent_channel, self.vhost_vsock)

    def capabilities(self) -> dict[str, Any]:
        return {
            "accel": self.accel,  # tcg: software emulation (slow); kvm: hardware virtualisation
            "kernel": self.kit.kernel_version if self.kit else None,
            "pause": True,  # stop/cont (memory stays resident: snapshot pause is still to come)
            "pack": False,
            "fork_processes": True,  # fork copies memory and processes too
            HOST_PROCESSES: False,  # they run on the guest's kernel: PIDs are the guest's
            "vhost_vsock": self.vhost_vsock,  # the host kernel offers /dev/vhost-vsock
            "agent_channel": self.channel,  # how new VMs reach their agent: vsock or serial
            # Each process the guest agent starts has a Landlock domain of its own.
            "isolated_entrances": bool(self.kit and self.kit.landlock),
        }

    async def detach(self) -> None:
        await self.templates.close()  # a build is this edge's; the next edge builds its own
        # QEMU's socket takes one client at a time: the next edge reconnects after this one.
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def release_node(self) -> None:
        await self.detach()

    async def leftovers(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        return sorted(p.stem for p in self.state_dir.glob("sb-*.json"))

    # -- lifecycle ----------------------------------------------------------------------------

    async def create(self, ctx: CreateContext) -> MicroVmHandle:
        if self.kit is None:
            raise InfraFailure(f"the {self.name} backend was not prepared", reason=InfraReason.runtime)
        # An image booted by its own bootloader has its own kernel command line: init cannot be
        # told to listen on vsock, so such a VM keeps the virtio-serial port.
        use_vsock = self.channel == "vsock" and getattr(ctx.spec, "disk_image", None) is None
        if use_vsock and not self.vhost_vsock:
            raise vsock.missing(self.vsock_device)  # forced by the setting; nothing made yet
        work = ctx.workdir
        work.mkdir(parents=True, exist_ok=True)
        socks = host.socket_dir(work)
        socks.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = self.handle_type(sid=ctx.sandbox_id, dir=str(work), sockets=str(socks))
        config = qemu.MicroVMConfig(
            kernel=self.kit.kernel,
            initramfs=self.kit.initramfs,
            agent_socket=socks / "agent.sock",
            qmp_socket=socks / "qmp.sock",
            serial_log=work / "console.log",
            layers=[],
            rw_disk=None,
            memory_mb=ctx.spec.memory_limit_mb,
            cpus=max(1, round(ctx.spec.cpu_cores_limit)),
            accel=self.accel,
            idle=ctx.spec.cpu_class == "be",
        )
        if ctx.link is not None:  # a network card on the tap the edge made for this VM
            config.tap = ctx.link.ifname
            config.guest_net = f"{ctx.link.address},{ctx.link.gateway}"
        try:
            if use_vsock:  # in the handle at once: a failed create's destroy gives it back
                config.vsock_cid = handle.vsock_cid = await asyncio.to_thread(self.cids.claim, work)
            await self._boot(ctx, config, handle)
            return handle
        except BaseException as exc:
            await asyncio.shield(self.destroy(ctx.sandbox_id, handle, work))
            if isinstance(exc, InfraFailure | InvalidRequest | asyncio.CancelledError):
                raise
            console = host.tail(work / "console.log")
            raise InfraFailure(
                f"the VM did not boot: {exc}; console: {console}", reason=InfraReason.runtime
            ) from exc

    async def _boot(self, ctx: CreateContext, config: qemu.MicroVMConfig, handle: MicroVmHandle) -> None:
        """Layers attached as they are, an ext4 disk for the writes; a clone when a template exists."""
        if self.layer_file is None:
            raise InfraFailure("the microVM backend has no layer store", reason=InfraReason.runtime)
        assert self.kit is not None
        config.layers = [self.layer_file(d) for d in ctx.layer_digests]
        config.rw_disk = Path(handle.dir) / "rw.img"
        disk_mb = int(getattr(ctx.spec, "disk_mb", DEFAULT_DISK_MB))
        # A template's saved devices include its agent channel's: a clone must have the same.
        channel = "serial" if config.vsock_cid is None else "vsock"
        key = TemplateKey(
            self.kit.key, tuple(ctx.layer_digests), config.memory_mb, config.cpus, disk_mb, channel
        )
        # A networked VM boots cold: a template's saved devices have no network card, and its
        # guest was never told an address; nor does it make a template of its own.
        templated = self.use_templates and config.tap is None
        template = self.templates.ready(key) if templated else None
        if template is not None:
            await self._clone(ctx.sandbox_id, config, template, handle)
            handle.template = key.name
            return
        await asyncio.to_thread(host.make_rw_disk, config.rw_disk, disk_mb)
        await self._start(ctx.sandbox_id, config, handle)
        self._channels[ctx.sandbox_id] = await AgentChannel.connect(host.config_addr(config), BOOT_TIMEOUT_S)
        if templated and not self.templates.building(key):
            self.templates.start_build(key, self._build_template(key, config))

    async def _start(self, sandbox_id: str, config: qemu.MicroVMConfig, handle: MicroVmHandle) -> None:
        work = Path(handle.dir)
        pid = await self.vmm.start(config, work)
        # Everything a restart from a pause snapshot needs to rebuild the same machine.
        handle.vm = RecordedVm.of(config)
        handle.pid, handle.start_time = pid, _linux.proc_start_time(pid)
        await self._record(sandbox_id, handle)

    async def _record(self, sandbox_id: str, handle: MicroVmHandle) -> None:
        """The handle in the backend's own state directory (an orphan's destroy reads it)."""
        await asyncio.to_thread((self.state_dir / f"{sandbox_id}.json").write_text, json.dumps(handle.dump()))

    async def _clone(
        self, sandbox_id: str, config: qemu.MicroVMConfig, template: Path, handle: MicroVmHandle
    ) -> None:
        """Start from ``template``'s saved state instead of booting (see templates.py)."""
        overlay = Path(handle.dir) / "rw.qcow2"
        await host.run_tool(
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(template / "rw.img"),
            "-F",
            "raw",
            str(overlay),
        )
        config.rw_disk, config.rw_format = overlay, "qcow2"
        config.mem_path, config.mem_shared, config.incoming = template / "ram", False, True
        await self._start(sandbox_id, config, handle)
        async with self.vmm.control(config.qmp_socket) as control:
            await control.load(template / "state")
            await control.cont()
        channel = await AgentChannel.connect(host.config_addr(config), 30.0, booting=False)
        self._channels[sandbox_id] = channel
        await host.refresh_guest(channel)

    async def _build_template(self, key: TemplateKey, like: qemu.MicroVMConfig) -> None:
        """Boot a template of ``key``'s kind, save it, and publish it (in the background)."""
        final = self.templates.dir(key)
        tdir = final.with_name(final.name + ".building")
        socks = host.socket_dir(tdir)
        pid = 0
        cid: int | None = None
        try:
            await asyncio.to_thread(shutil.rmtree, tdir, True)
            tdir.mkdir(parents=True)
            socks.mkdir(parents=True, exist_ok=True, mode=0o700)
            await asyncio.to_thread(host.make_rw_disk, tdir / "rw.img", key.disk_mb)
            if like.vsock_cid is not None:  # its own CID: the VM it was made for holds that one
                cid = await asyncio.to_thread(self.cids.claim, tdir)
            config = dataclasses.replace(
                like,
                agent_socket=socks / "agent.sock",
                qmp_socket=socks / "qmp.sock",
                serial_log=tdir / "console.log",
                rw_disk=tdir / "rw.img",
                mem_path=tdir / "ram",
                mem_shared=True,
                vsock_cid=cid,
            )
            pid = await self.vmm.start(config, tdir)
            channel = await AgentChannel.connect(host.config_addr(config), BOOT_TIMEOUT_S)
            try:
                sync = await channel.spawn(["sync"], env={"PATH": host.GUEST_PATH}, cwd="/", uid=0, gid=0)
                await sync.wait()  # the disk the clones start from holds what the RAM believes
            finally:
                await channel.close()
            async with self.vmm.control(config.qmp_socket) as control:
                await control.stop()
                await control.save(tdir / "state")
                await control.quit()
            (tdir / "key.json").write_text(json.dumps(dataclasses.asdict(key)))
            (tdir / "complete").write_text("ok\n")
            await asyncio.to_thread(shutil.rmtree, final, True)
            tdir.rename(final)
            log.info("microVM template %s ready", key.name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("building microVM template %s failed (creates keep booting)", key.name)
        finally:
            if pid and _linux.proc_start_time(pid) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(shutil.rmtree, socks, True)
            if cid is not None:
                await asyncio.to_thread(self.cids.release, cid, tdir)
            if tdir.exists():
                await asyncio.to_thread(shutil.rmtree, tdir, True)

    def has_link(self, handle: Handle) -> bool:
        return self.handle_type.of(handle).has_tap()

    async def alive(self, sandbox_id: str, handle: Handle) -> bool:
        h = self.handle_type.of(handle)
        if h.snapshot:  # paused to a file: no process, and that is its state
            return await asyncio.to_thread(os.path.exists, h.snapshot)
        return h.pid > 0 and _linux.proc_start_time(h.pid) == h.start_time

    async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None:
        h = self.handle_type.of(handle)
        channel = self._channels.pop(sandbox_id, None)
        if channel is not None:
            await channel.close()
        state = self.state_dir / f"{sandbox_id}.json"
        if not h.model_fields_set and state.exists():  # an empty handle: the backend's own record
            with contextlib.suppress(ValueError, OSError):
                h = self.handle_type.model_validate_json(state.read_text())
        if h.pid > 0 and _linux.proc_start_time(h.pid) == h.start_time:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.pid, signal.SIGKILL)
            await host.gone(h.pid, 5.0)
        await asyncio.to_thread(shutil.rmtree, workdir, True)
        await asyncio.to_thread(shutil.rmtree, host.socket_dir(workdir), True)
        cid = h.cid()
        if cid is not None:  # only if this VM still holds it (the claim names its directory)
            await asyncio.to_thread(self.cids.release, cid, Path(h.dir or workdir))
        if h.fork_source:
            await asyncio.to_thread(forks.drop, Path(h.fork_source), sandbox_id)
        state.unlink(missing_ok=True)

    # -- inside -------------------------------------------------------------------------------

    async def _channel(self, sandbox_id: str, handle: MicroVmHandle) -> AgentChannel:
        channel = self._channels.get(sandbox_id)
        if channel is not None and not channel.closed and not channel.suspended:
            return channel
        lock = self._connecting.setdefault(sandbox_id, asyncio.Lock())
        async with lock:  # after an edge restart: reconnect once, for every waiting caller
            channel = self._channels.get(sandbox_id)
            if channel is not None and channel.suspended and not handle.snapshot:
                await channel.resume(host.agent_addr(handle))
            elif channel is None or channel.closed:
                # A channel this edge never had: its sessions died with an earlier edge.
                addr = host.agent_addr(handle)  # the journaled CID, after an edge restart too
                channel = await AgentChannel.connect(addr, 30.0, booting=False, forget=True)
                self._channels[sandbox_id] = channel
            return channel

    async def spawn(
        self,
        sandbox_id: str,
        handle: Handle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> VmProcess:
        channel = await self._channel(sandbox_id, self.handle_type.of(handle))
        try:
            return await channel.spawn(argv, env=env, cwd=cwd, uid=user.uid, gid=user.gid)
        except OSError as exc:
            # A program or working directory that is missing or cannot be run is the command's
            # failure (127/126 with the message on stderr), as a container's exec reports it.
            code = _EXEC_FAILURES.get(exc.errno or 0)
            if code is not None and str(exc.strerror).startswith(("exec ", "chdir ")):
                return VmProcess.ended(channel, code, str(exc.strerror))
            raise InvalidRequest(f"cannot run {argv[0]!r} in the microVM: {exc.strerror}") from exc

    def files(self, handle: Handle, user: User) -> FileOps:
        h = self.handle_type.of(handle)
        return VmFileOps(lambda: self._channel(h.sid, h), user.uid, user.gid)

    @asynccontextmanager
    async def writable_layer(self, sandbox_id: str, handle: Handle, workdir: Path) -> AsyncIterator[Path]:
        """A copy of the upper directory on the VM's ext4 disk: the guest syncs, the VM stops
        while the disk is read (in a throw-away mount namespace), then it carries on."""
        h = self.handle_type.of(handle)
        vm = h.recorded()
        channel = await self._channel(sandbox_id, h)
        sync = await channel.spawn(["sync"], env={"PATH": host.GUEST_PATH}, cwd="/", uid=0, gid=0)
        await sync.wait()
        export = workdir / "upper-export"
        async with self.vmm.control(host.socket_dir(Path(h.dir)) / "qmp.sock") as control:
            await control.stop()
            try:
                await host.export_upper(Path(str(vm.rw_disk)), vm.rw_format, export)
            finally:
                await control.cont()
        try:
            yield export / "upper"
        finally:
            await asyncio.to_thread(shutil.rmtree, export, True)

    async def freeze(self, sandbox_id: str, handle: Handle) -> None:
        h = self.handle_type.of(handle)
        if not h.snapshot:  # a VM saved to a file is as frozen as it gets
            await self._qmp(h, "stop")

    async def thaw(self, sandbox_id: str, handle: Handle) -> None:
        h = self.handle_type.of(handle)
        if h.snapshot:
            await self.prefetch(sandbox_id, h)  # a restart re-applying "running"
        await self._qmp(h, "cont")
        resumed = h.resumed
        h.drop("resumed")
        if resumed:
            channel = self._channels.get(sandbox_id)
            if channel is not None and channel.suspended:
                await channel.resume(host.agent_addr(h))
            await host.refresh_guest(await self._channel(sandbox_id, h))

    async def _qmp(self, handle: MicroVmHandle, command: str) -> None:
        async with self.vmm.control(host.socket_dir(Path(handle.dir)) / "qmp.sock") as control:
            await (control.stop() if command == "stop" else control.cont())

    async def page_out(self, sandbox_id: str, handle: Handle) -> int:
        """The microVM pause: save memory and device state to a file, end the QEMU process
        (all of its memory goes back to the host), keep the disk."""
        h = self.handle_type.of(handle)
        if h.snapshot:
            return 0
        resident = self.memory_bytes(sandbox_id)
        snapshot = Path(h.dir) / "paused.state"
        channel = self._channels.get(sandbox_id)
        if channel is not None:
            await channel.suspend()  # its sessions carry on after the resume
        async with self.vmm.control(host.socket_dir(Path(h.dir)) / "qmp.sock") as control:
            await control.save(snapshot)
            await control.quit()
        await host.gone(h.pid)
        h.snapshot, h.pid, h.start_time = str(snapshot), 0, None
        await self._record(sandbox_id, h)
        return resident

    async def prefetch(self, sandbox_id: str, handle: Handle) -> int:
        """Resume's first half: a new QEMU loads the saved state (left stopped: thaw continues it)."""
        h = self.handle_type.of(handle)
        if not h.snapshot:
            return 0
        snapshot = Path(h.snapshot)
        config = h.recorded().config()
        config.incoming = True
        await self._start(sandbox_id, config, h)
        async with self.vmm.control(config.qmp_socket) as control:
            await control.load(snapshot)
        size = (await asyncio.to_thread(os.stat, snapshot)).st_size
        h.drop("snapshot")
        h.resumed = True  # thaw: reconnect and refresh the guest's clock
        await asyncio.to_thread(snapshot.unlink, True)
        await self._record(sandbox_id, h)
        return size

    def memory_bytes(self, sandbox_id: str) -> int:
        state = self.state_dir / f"{sandbox_id}.json"
        try:
            pid = self.handle_type.model_validate_json(state.read_text()).pid
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, KeyError):
            pass
        return 0

    def oom_kills(self, sandbox_id: str) -> int:
        # The guest kernel's count (the VM is the sandbox); compared before and after a command,
        # which always holds a channel (a paused VM's keeps its count across the resume).
        channel = self._channels.get(sandbox_id)
        return channel.oom_kills if channel is not None else 0
