"""A microVM's handle (and a full VM's, which extends it): where its files are, its QEMU, the
machine it was started as, and whether it is paused to a file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from dsec.backends.handle import ForkSource, Handle
from dsec.backends.microvm import qemu
from dsec.protocol.errors import InfraFailure, InfraReason


class RecordedVm(BaseModel):
    """The machine a VM was started as (``qemu.MicroVMConfig`` with paths as strings), to start
    it again from a pause snapshot or a fork. Keys a handle from before a field lacks take the
    config's defaults."""

    model_config = ConfigDict(extra="allow")

    # Read leniently: a record missing a key still names what it has (a base a collection
    # must keep, a tap); only a restart from it needs the whole machine (config()).
    kernel: str | None = None
    initramfs: str | None = None
    agent_socket: str | None = None
    qmp_socket: str | None = None
    serial_log: str | None = None
    layers: list[str] = []
    rw_disk: str | None = None
    memory_mb: int = 512
    cpus: int = 1
    accel: qemu.Accel = "tcg"
    rw_format: str = "raw"
    mem_path: str | None = None
    mem_shared: bool = False
    incoming: bool = False
    machine: Literal["microvm", "q35"] = "microvm"
    root_disk: str | None = None
    idle: bool = False
    boot_disk: str | None = None
    tap: str | None = None
    guest_net: str | None = None
    vsock_cid: int | None = None
    extra: list[str] = []

    @classmethod
    def of(cls, config: qemu.MicroVMConfig) -> RecordedVm:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls.model_validate(
            {
                k: [str(x) for x in v] if k == "layers" else str(v) if isinstance(v, Path) else v
                for k, v in fields.items()
            }
        )

    def config(self) -> qemu.MicroVMConfig:
        """The machine again (not waiting for an incoming state, and without extra arguments:
        the caller says)."""

        def path(value: str | None) -> Path | None:
            return None if value is None else Path(value)

        def needed(name: str, value: str | None) -> Path:
            if value is None:
                raise InfraFailure(f"the recorded machine has no {name}", reason=InfraReason.runtime)
            return Path(value)

        return qemu.MicroVMConfig(
            kernel=needed("kernel", self.kernel),
            initramfs=needed("initramfs", self.initramfs),
            agent_socket=needed("agent_socket", self.agent_socket),
            qmp_socket=needed("qmp_socket", self.qmp_socket),
            serial_log=needed("serial_log", self.serial_log),
            layers=[Path(x) for x in self.layers],
            rw_disk=path(self.rw_disk),
            memory_mb=self.memory_mb,
            cpus=self.cpus,
            accel=self.accel,
            rw_format=self.rw_format,
            mem_path=path(self.mem_path),
            mem_shared=self.mem_shared,
            machine=self.machine,
            root_disk=path(self.root_disk),
            idle=self.idle,
            boot_disk=path(self.boot_disk),
            tap=self.tap,
            guest_net=self.guest_net,
            vsock_cid=self.vsock_cid,
        )


class MicroVmHandle(Handle):
    # pid/start_time: its QEMU (0/None while paused to a file)
    sid: str = ""
    dir: str = ""  # its work directory (disks, console log, pause snapshot)
    sockets: str = ""  # its agent's and QMP's sockets
    vsock_cid: int | None = None  # claimed before the VM starts: a failed create gives it back
    template: str | None = None  # the template it was cloned from, if any
    vm: RecordedVm | None = None  # the machine, once its QEMU started
    snapshot: str | None = None  # paused: the file its memory and devices were saved to
    resumed: bool = False  # loaded from a snapshot and not yet thawed (then: reconnect)
    fork_source: str | None = None  # a fork's source directory, which it holds a reference on

    def cid(self) -> int | None:
        """The vsock CID it holds: the one claimed, else the machine's."""
        if "vsock_cid" in self.model_fields_set:
            return self.vsock_cid
        return None if self.vm is None else self.vm.vsock_cid

    def has_tap(self) -> bool:
        return self.vm is not None and bool(self.vm.tap)

    def recorded(self) -> RecordedVm:
        """The machine it was started as (a handle whose QEMU never started has none)."""
        if self.vm is None:
            raise InfraFailure(
                f"VM {self.sid} has no recorded machine: it never started", reason=InfraReason.runtime
            )
        return self.vm


class MicroVmForkSource(ForkSource):
    dir: str  # the source directory, removed when its last copy is gone
    state: str  # the saved memory and device state
    disk: str  # the copied writable disk
    format: str  # its format (qcow2 or raw)
    vm: RecordedVm  # the machine the copies start as
