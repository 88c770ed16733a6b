"""QEMU for microVMs: the command line, the accelerator choice, and a QMP client.

The machine is QEMU's ``microvm`` (no PCI, no firmware: the kernel boots directly) with
virtio-mmio devices: one virtio-blk per layer (read-only, the layer's EROFS file as it is in
the store: no conversion per VM), one writable virtio-blk (the sandbox's upper layer, ext4), and
a virtio-serial port for the guest agent whose host end is a unix socket (or, where the host
has vhost-vsock, a vhost-vsock device instead: :mod:`dsec.backends.microvm.vsock`). No network device
unless the sandbox names network rules: then a virtio-net card on a tap the edge made.
``-nodefaults`` keeps QEMU from adding any.

The accelerator is KVM when the host's KVM boots a stock guest, else TCG. On these machines
``/dev/kvm`` is a PVM host that hangs stock kernels, so :func:`detect_accel` boots the kit's
kernel once under KVM with a deadline and falls back to TCG; the answer is a node capability.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsec.backends.microvm.kit import CMDLINE
from dsec.native import spawner
from dsec.protocol.errors import InfraFailure, InfraReason

QEMU = "qemu-system-x86_64"
Accel = Literal["kvm", "tcg"]
# TCG only: pin the TSC frequency so the guest skips calibration (which hung some TCG boots).
# clearcpuid=cx16: SLUB's per-CPU fast path (this_cpu_try_cmpxchg128, Linux >= 6.8) corrupts
# the guest's slabs under Debian 12's QEMU 7.2 TCG: 6.12 kernels oopsed early in 2 boots of 3
# (6 of 6 with nokaslr), none of 6 without CX16. A boot option, not a CPU model change: a VM
# paused before keeps its CPU (its resumed kernel still uses the instruction).
_TCG_CMDLINE = "tsc_early_khz=2000000 tsc=reliable clearcpuid=cx16"


@dataclass
class MicroVMConfig:
    kernel: Path
    initramfs: Path
    agent_socket: Path
    qmp_socket: Path
    serial_log: Path
    layers: list[Path]  # EROFS files, base first
    rw_disk: Path | None
    memory_mb: int = 512
    cpus: int = 1
    accel: Accel = "tcg"
    rw_format: str = "raw"  # qcow2 for a clone's copy-on-write overlay of its template's disk
    # Guest RAM as a file: shared for a template (its RAM ends up in the file), private for a
    # clone (a copy-on-write mapping of the template's file: untouched pages cost nothing).
    mem_path: Path | None = None
    mem_shared: bool = False
    incoming: bool = False  # wait for migrate-incoming (a clone, or a resume from a snapshot)
    # "q35": a full VM (PCI devices, a VGA display the guest draws on, its root a disk image)
    machine: Literal["microvm", "q35"] = "microvm"
    root_disk: Path | None = None  # a full VM's root (qcow2 over the shared base image)
    idle: bool = False  # best effort: QEMU (and so every vCPU thread) under SCHED_IDLE
    # A user's image booted by its own bootloader (q35 firmware), instead of our kernel.
    boot_disk: Path | None = None
    # A network card on this host tap device (made by the edge's egress policy), and what the
    # guest's init configures on it: "address,gateway" (the gateway also answers DNS).
    tap: str | None = None
    guest_net: str | None = None
    # The agent over vsock instead of virtio-serial: the guest's CID (unique on the host).
    vsock_cid: int | None = None
    extra: list[str] = field(default_factory=list)


def microvm_argv(c: MicroVMConfig) -> list[str]:
    full = c.machine == "q35"
    cmdline = CMDLINE + ("" if c.accel == "kvm" else " " + _TCG_CMDLINE)
    # vga=791: 1024x768 at 16 bits through the VESA BIOS, the framebuffer the kernel keeps.
    cmdline += " vga=791" if full else ""
    cmdline += f" dsec.net={c.guest_net}" if c.guest_net else ""
    # init starts the agent listening on vsock instead of opening the virtio-serial port.
    cmdline += " dsec.channel=vsock" if c.vsock_cid is not None else ""
    machine = "q35" if full else "microvm,rtc=on,pic=off,pit=on"
    machine += ",memory-backend=mem" if c.mem_path else ""
    bus = "pci" if full else "device"  # virtio over PCI on q35, over MMIO on microvm
    argv = [
        QEMU,
        "-M", machine,
        "-accel", c.accel,
        "-cpu", "host" if c.accel == "kvm" else "max",
        "-m", str(c.memory_mb),
        "-smp", str(c.cpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{c.serial_log}",
        "-qmp", f"unix:{c.qmp_socket},server=on,wait=off",
    ]  # fmt: skip
    if c.vsock_cid is None:
        argv += [
            "-device", f"virtio-serial-{bus}",
            "-chardev", f"socket,id=agent,path={c.agent_socket},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=dsec.agent",
        ]  # fmt: skip
    else:
        # QEMU opens /dev/vhost-vsock and sets the CID; the host kernel then carries the bytes.
        # The CID is a device property, not migrated state: a restore takes it from this line.
        argv += ["-device", f"vhost-vsock-{bus},guest-cid={c.vsock_cid}"]
    if c.tap is not None:
        # The tap exists already (persistent, the edge's); QEMU only opens it, runs no script.
        # romfile= : no PXE option ROM (the kernel is loaded directly; no ipxe files needed).
        rom = ",romfile=" if full else ""
        argv += [
            "-netdev", f"tap,id=net0,ifname={c.tap},script=no,downscript=no",
            "-device", f"virtio-net-{bus},netdev=net0{rom}",
        ]  # fmt: skip
    if c.boot_disk is None:
        argv += ["-kernel", str(c.kernel), "-initrd", str(c.initramfs), "-append", cmdline]
    else:  # SeaBIOS (q35's default firmware) boots the image's own bootloader
        argv += [
            "-drive", f"if=none,id=boot,file={c.boot_disk},format=qcow2,cache=unsafe,discard=unmap",
            "-device", "virtio-blk-pci,drive=boot,bootindex=0,serial=dsec-image",
        ]  # fmt: skip
    if c.mem_path is not None:
        share = "on" if c.mem_shared else "off"
        argv += [
            "-object",
            f"memory-backend-file,id=mem,size={c.memory_mb}M,mem-path={c.mem_path},share={share}",
        ]
    if c.incoming:
        argv += ["-incoming", "defer"]
    if full:
        # A PS/2 keyboard and mouse come with the machine; the tablet points absolutely.
        argv += ["-vga", "std", "-device", "virtio-tablet-pci"]
    if c.root_disk is not None:
        argv += [
            "-drive", f"if=none,id=root,file={c.root_disk},format=qcow2,cache=unsafe,discard=unmap",
            "-device", f"virtio-blk-{bus},drive=root,serial=dsec-root",
        ]  # fmt: skip
    if c.rw_disk is not None:
        argv += [
            "-drive", f"if=none,id=rw,file={c.rw_disk},format={c.rw_format},cache=unsafe,discard=unmap",
            "-device", f"virtio-blk-{bus},drive=rw,serial=dsec-rw",
        ]  # fmt: skip
    for i, layer in enumerate(c.layers):
        argv += [
            "-drive", f"if=none,id=l{i},file={layer},format=raw,readonly=on",
            "-device", f"virtio-blk-{bus},drive=l{i},serial=dsec-layer-{i}",
        ]  # fmt: skip
    return argv + c.extra


class Qmp:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: Path, timeout: float = 10.0) -> Qmp:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.005)  # QEMU creates the socket as it starts
            qmp = cls(reader, writer)
            await qmp._read()  # the greeting
            await qmp.execute("qmp_capabilities")
            return qmp

    async def _read(self) -> dict[str, Any]:
        line = await self._reader.readline()
        if not line:
            raise InfraFailure("QEMU closed its QMP socket", reason=InfraReason.runtime)
        message: dict[str, Any] = json.loads(line)
        return message

    async def execute(self, command: str, **arguments: Any) -> Any:
        async with self._lock:
            body: dict[str, Any] = {"execute": command}
            if arguments:
                body["arguments"] = arguments
            self._writer.write(json.dumps(body).encode() + b"\n")
            await self._writer.drain()
            while True:
                reply = await self._read()
                if "event" in reply:
                    continue
                if "error" in reply:
                    raise InfraFailure(
                        f"QMP {command}: {reply['error'].get('desc')}", reason=InfraReason.runtime
                    )
                return reply.get("return")

    async def migrate(self, command: str, uri: str, *, timeout: float = 120.0) -> None:
        """``migrate`` (save) or ``migrate-incoming`` (load) over ``uri``, to completion.

        ``x-ignore-shared``: RAM in a shared memory file is not streamed (a template's RAM is
        the file itself)."""
        await self.execute(
            "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}]
        )
        await self.execute(command, uri=uri)
        async with asyncio.timeout(timeout):
            while True:
                status = (await self.execute("query-migrate")).get("status")
                if status == "completed":
                    return
                if status in ("failed", "cancelled"):
                    raise InfraFailure(f"QEMU {command} {status}", reason=InfraReason.runtime)
                await asyncio.sleep(0.005)  # QMP has no "wait": completion is polled

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


def kvm_present() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


async def start_daemon(config: MicroVMConfig, pidfile: Path, logfile: Path) -> int:
    """Start QEMU daemonized (it outlives the edge); returns its pid once the VM is set up
    (QEMU's parent exits only then). Where a spawner runs, QEMU's parent is the spawner's
    child, so the daemon is reparented to the spawner (a child subreaper) and reaped there,
    not by the host's init; to the host's init only once the edge (and its spawner) ends."""
    argv = [*microvm_argv(config), "-daemonize", "-pidfile", str(pidfile)]
    if config.idle:
        argv = ["chrt", "--idle", "0", *argv]
    log = await asyncio.to_thread(open, logfile, "ab")
    try:
        code = await _run_adopted(argv, log.fileno())
        if code is None:  # no spawner (a bare backend): a plain child, the daemon init's
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
            code = await proc.wait()
    finally:
        log.close()
    if code != 0:
        raise InfraFailure(
            f"qemu failed to start (exit {code}): {_tail(logfile)}", reason=InfraReason.runtime
        )
    return int((await asyncio.to_thread(pidfile.read_text)).strip())


async def _run_adopted(argv: list[str], log: int) -> int | None:
    """Run ``argv`` as the spawner's child (stdout and stderr to ``log``) to its exit code;
    None when no spawner runs."""
    exe = shutil.which(argv[0]) or argv[0]
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        child = spawner.spawn_adopted(exe, argv, dict(os.environ), {0: null, 1: log, 2: log}, setsid=True)
    finally:
        os.close(null)
    if child is None:
        return None
    try:
        return await child.wait()
    finally:
        child.close()  # (cancelled: QEMU goes on as it did as asyncio's child; the caller cleans up)


def _tail(path: Path, limit: int = 1000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


async def detect_accel(kit: Any, state_dir: Path, deadline_s: float = 20.0) -> Accel:
    """KVM if this host's KVM boots the kit's kernel to its init within the deadline, else TCG.

    The kernel boots with no disks, so its init reports the missing root and powers off: a VM
    that ends by itself in time proves the accelerator works. The answer is cached in
    ``state_dir`` (give the node's data directory: every VM backend of the node shares it).
    """
    if not kvm_present():
        return "tcg"
    # Whether KVM boots a stock kernel is the host's property: one probe serves every backend.
    cache = state_dir / "accel.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        cached: Accel = json.loads(cache.read_text())["accel"]
        return cached
    probe = Path(tempfile.mkdtemp(prefix="dsec-accel-"))  # short: unix socket paths are capped
    config = MicroVMConfig(
        kernel=kit.kernel,
        initramfs=kit.initramfs,
        agent_socket=probe / "agent.sock",
        qmp_socket=probe / "qmp.sock",
        serial_log=probe / "console.log",
        layers=[],
        rw_disk=None,
        memory_mb=256,
        accel="kvm",
    )
    proc = await asyncio.create_subprocess_exec(
        *microvm_argv(config),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with asyncio.timeout(deadline_s):
            code = await proc.wait()
        accel: Accel = "kvm" if code == 0 else "tcg"
    except TimeoutError:
        accel = "tcg"  # a hung guest: KVM here cannot boot a stock kernel (a PVM host)
        proc.kill()
        await proc.wait()
    await asyncio.to_thread(_remember, probe, cache, accel)
    return accel


def _remember(probe: Path, cache: Path, accel: Accel) -> None:
    shutil.rmtree(probe, ignore_errors=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"accel": accel}))
