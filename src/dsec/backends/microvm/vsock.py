"""The guest agent's channel over AF_VSOCK, where the host has vhost-vsock.

A VM's agent channel is either the virtio-serial port ``dsec.agent`` (whose host end is a unix
socket QEMU listens on) or, when the host kernel offers ``/dev/vhost-vsock``, a vsock
connection from the host to the agent listening on :data:`AGENT_PORT` of the guest's CID. The
bytes on it are the same either way (``guest/PROTOCOL.md``); only how the host reaches them
differs. vsock skips QEMU on the data path (the host kernel's vhost moves the bytes) and does
not depend on a chardev socket file.

Here:

* :func:`vhost_vsock_present`: whether the device exists and opens, probed once per boot of the
  host and cached in the node's data directory (like the accelerator probe);
* :func:`choose`: the node's channel from the configured ``agent_channel`` and that probe;
* :class:`Cids`: guest CIDs, unique on the host. vhost-vsock's CIDs are one namespace for the
  whole host kernel, so claims live in a host-wide directory (``/run/dsec-vm/cids``), one file
  per CID naming the VM's work directory that holds it; a VM's handle journals its CID, so an
  edge restarted later reconnects to the same address.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

VHOST_VSOCK = Path("/dev/vhost-vsock")
# The agent's vsock port; guest/init starts the agent with ``vsock:1024`` (kept equal by a test).
AGENT_PORT = 1024
# 0-2 are reserved (hypervisor, local, host). Claims are drawn at random from a high range so
# that another user of vhost-vsock on the host, which typically counts up from 3, rarely meets one.
CID_LOW, CID_HIGH = 1 << 16, 1 << 31
Setting = Literal["auto", "vsock", "serial"]
Channel = Literal["vsock", "serial"]
SETTINGS: tuple[Setting, ...] = ("auto", "vsock", "serial")


@dataclass(frozen=True)
class VsockAddr:
    """Where the host reaches a guest's agent over vsock."""

    cid: int
    port: int = AGENT_PORT


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def vhost_vsock_present(state_dir: Path, device: Path = VHOST_VSOCK) -> bool:
    """Whether ``device`` exists and opens read-write (as QEMU opens it for each VM).

    Cached in ``state_dir/vsock.json`` for this boot of the host (a module loaded later shows
    after a reboot, or when the file is removed): every VM backend of the node shares it.
    """
    cache = state_dir / "vsock.json"
    boot = _boot_id()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(cache.read_text())
        if cached["boot_id"] == boot and cached["device"] == str(device):
            return bool(cached["present"])
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
        present = True
    except OSError:
        present = False
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        part = cache.with_suffix(".tmp")
        part.write_text(json.dumps({"present": present, "device": str(device), "boot_id": boot}))
        part.replace(cache)
    return present


def choose(setting: str, present: bool) -> Channel:
    """The channel new VMs get: ``auto`` takes vsock where the host has it."""
    if setting not in SETTINGS:
        raise InvalidRequest(f"agent_channel {setting!r}: say auto, vsock or serial")
    if setting == "serial":
        return "serial"
    if setting == "vsock":
        return "vsock"  # even without the device: creates then say what is missing
    return "vsock" if present else "serial"


def missing(device: Path = VHOST_VSOCK) -> InfraFailure:
    return InfraFailure(
        f"agent_channel is 'vsock' but this host has no usable {device} (load the vhost_vsock"
        " module, or set agent_channel to 'auto' or 'serial')",
        reason=InfraReason.vhost_vsock_missing,
    )


class Cids:
    """Guest CIDs claimed on this host: ``<root>/<cid>`` holds the owner's work directory.

    A claim whose owner directory no longer exists is stale (its VM was removed while no edge
    ran to release it) and is taken over. Claims and releases hold a lock on ``<root>/.lock``:
    edges of several data directories on one host share the root.
    """

    def __init__(self, root: Path, low: int = CID_LOW, high: int = CID_HIGH) -> None:
        if low < 3 or high <= low:
            raise ValueError(f"bad CID range [{low}, {high})")
        self.root, self.low, self.high = root, low, high

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def owner(self, cid: int) -> str | None:
        try:
            return (self.root / str(cid)).read_text()
        except OSError:
            return None

    def claimed(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for path in self.root.glob("[0-9]*") if self.root.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):
                out[int(path.name)] = path.read_text()
        return out

    def claim(self, owner: Path) -> int:
        """A CID nobody on this host holds, now held by ``owner``."""
        with self._locked():
            for _ in range(1000):
                cid = self.low + secrets.randbelow(self.high - self.low)
                held = self.owner(cid)
                if held is not None and os.path.exists(held):
                    continue
                part = self.root / f".{cid}.tmp"
                part.write_text(str(owner))
                part.replace(self.root / str(cid))
                return cid
        raise InfraFailure("no free vsock CID on this host", reason=InfraReason.runtime)

    def release(self, cid: int, owner: Path) -> None:
        """Give ``cid`` back, if ``owner`` still holds it (a stale claim may have moved on)."""
        with self._locked():
            if self.owner(cid) == str(owner):
                (self.root / str(cid)).unlink(missing_ok=True)
