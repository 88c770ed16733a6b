"""Host-side helpers shared by the VM backends: where a VM's sockets live, running a tool,
where its agent answers, refreshing a restored guest."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
from pathlib import Path

from dsec import _linux
from dsec.backends.microvm import qemu
from dsec.backends.microvm.channel import AgentAddr, AgentChannel
from dsec.backends.microvm.handle import MicroVmHandle
from dsec.backends.microvm.vsock import VsockAddr
from dsec.protocol.errors import InfraFailure, InfraReason

SOCKET_ROOT = Path("/run/dsec-vm")
GUEST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def socket_dir(workdir: Path) -> Path:
    """Where a VM's unix sockets live: a short path (the kernel caps one at 107 bytes, which a
    deep data directory would exceed), derived from the sandbox's work directory."""
    return SOCKET_ROOT / hashlib.sha256(str(workdir).encode()).hexdigest()[:24]


async def gone(pid: int, within_s: float = 30.0) -> bool:
    """Wait for ``pid`` to end (QEMU releases a big guest's memory as it exits)."""
    for _ in range(int(within_s * 100)):
        if _linux.proc_start_time(pid) is None:
            return True
        await asyncio.sleep(0.01)  # a process's end cannot be awaited unless it is our child
    return False


def agent_addr(handle: MicroVmHandle) -> AgentAddr:
    """Where a VM's agent answers: its journaled vsock CID, else its virtio-serial socket."""
    cid = None if handle.vm is None else handle.vm.vsock_cid
    if cid is not None:
        return VsockAddr(cid)
    return socket_dir(Path(handle.dir)) / "agent.sock"


def config_addr(config: qemu.MicroVMConfig) -> AgentAddr:
    return config.agent_socket if config.vsock_cid is None else VsockAddr(config.vsock_cid)


async def run_tool(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise InfraFailure(
            f"{argv[0]} failed: {out.decode(errors='replace').strip()}", reason=InfraReason.runtime
        )


async def refresh_guest(channel: AgentChannel) -> None:
    """A clone (or a restored VM) wakes with its template's clock and random state: set the
    clock, and stir fresh entropy into the guest's pool so clones do not share random numbers."""
    script = f"date -u -s @{time.time():.3f} >/dev/null 2>&1; cat > /dev/urandom"
    proc = await channel.spawn(["sh", "-c", script], env={"PATH": GUEST_PATH}, cwd="/", uid=0, gid=0)
    assert proc.stdin is not None
    proc.stdin.write(os.urandom(256))
    proc.stdin.close()
    await proc.wait()


def make_rw_disk(path: Path, size_mb: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size_mb << 20)  # sparse: only what the guest writes takes host disk
    done = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "nodiscard,lazy_itable_init=1", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise InfraFailure(
            f"mkfs.ext4 of the microVM's disk failed: {done.stderr.strip()}", reason=InfraReason.runtime
        )


def tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return "(no console output)"


async def export_upper(disk: Path, disk_format: str, dest: Path) -> None:
    """Copy ``upper`` of a VM's (stopped, synced) ext4 disk to ``dest/upper``, whiteouts and
    overlay xattrs included. The disk is mounted read-only in a mount namespace of its own (a
    qcow2 overlay is first flattened to a sparse raw file), so the host's table never sees it."""
    await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
    image = disk
    if disk_format != "raw":
        image = dest / "disk.raw"
        # -U: QEMU holds the image open; the guest's sync made it flush its qcow2 metadata out.
        await run_tool("qemu-img", "convert", "-U", "-O", "raw", str(disk), str(image))
    mnt = dest / "mnt"
    await asyncio.to_thread(mnt.mkdir)
    script = f'mount -t ext4 -o ro,loop,noload "{image}" "{mnt}" && cp -a "{mnt}/upper" "{dest}/upper"'
    try:
        await run_tool("unshare", "--mount", "--propagation", "private", "sh", "-c", script)
    finally:
        if image != disk:
            await asyncio.to_thread(image.unlink, True)
        await asyncio.to_thread(mnt.rmdir)
