"""A sandbox's link to the host: a veth pair, the host end in the node's namespace and
``eth0`` in the sandbox's own network namespace (entered through its init's PID, or, for a
runtime that reads its links once at start, a fresh namespace made here for it to join: see
:func:`new_netns`); for a VM, a tap device its QEMU attaches to the guest's virtio-net card.

Every host end carries the same gateway address (a /32), and each sandbox a /32 of its own
with a host route to it, so links need no bridge and no per-link subnet; which sandbox a
packet came from is the interface it arrived on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

from dsec import _linux
from dsec.native import spawner
from dsec.protocol.errors import InfraFailure, InfraReason


def link_name(sandbox_id: str) -> str:
    """The host end's name: stable for a sandbox, unique across edges, within IFNAMSIZ."""
    return "dsv" + hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]


async def _run(argv: list[str], script: str | None = None) -> None:
    proc = await spawner.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if script is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate(script.encode() if script is not None else None)
    if proc.returncode != 0:
        raise InfraFailure(
            f"{' '.join(argv[:3])}: {err.decode(errors='replace').strip()[-500:]}", reason=InfraReason.network
        )


def _host_end(ifname: str, gateway: str, address: str) -> str:
    """The host end's setup, the same for a veth and a tap: up, the gateway, a route to the sandbox."""
    return f"link set {ifname} up\naddr add {gateway}/32 dev {ifname}\nroute add {address}/32 dev {ifname}\n"


async def create(ifname: str, netns: int | str, gateway: str, address: str) -> None:
    """Make the link of the sandbox whose network namespace is ``netns``: the PID of a process
    in it (its init), or the path of the namespace (see :func:`new_netns`). On failure nothing
    is left."""
    # ip takes a PID, or a path when the name has a slash; nsenter one or the other.
    enter = ["nsenter", "-t", str(netns), "-n"] if isinstance(netns, int) else ["nsenter", f"--net={netns}"]
    await _run(["ip", "link", "add", ifname, "type", "veth", "peer", "name", "eth0", "netns", str(netns)])
    try:
        await _run(["ip", "-batch", "-"], _host_end(ifname, gateway, address))
        inside = (
            "link set lo up\n"
            f"addr add {address}/32 dev eth0\n"
            "link set eth0 up\n"
            f"route add {gateway}/32 dev eth0\n"
            f"route add default via {gateway} dev eth0\n"
        )
        await _run([*enter, "ip", "-batch", "-"], inside)
    except BaseException:
        await remove(ifname)
        raise


def new_netns() -> int:
    """A fresh network namespace, as an open file descriptor (the namespace lives as long as the
    descriptor or a process in it; others reach it as ``/proc/<edge pid>/fd/<fd>``). Made by a
    thread that ends at once: unshare(2) moves only the calling thread, and a pooled thread
    left in the namespace would take the edge's later work there. Blocks: run it off the loop."""
    made: list[int] = []
    failed: list[OSError] = []

    def make() -> None:
        try:
            _linux.unshare(_linux.CLONE_NEWNET)
            made.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=make, name="dsec-new-netns")
    thread.start()
    thread.join()
    if failed or not made:
        raise InfraFailure(
            f"cannot make a network namespace: {failed[0] if failed else '?'}", reason=InfraReason.network
        )
    return made[0]


def fd_path(fd: int) -> str:
    """How another process (ip, nsenter, a runtime) names this process's descriptor ``fd``."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def is_hosts_netns(path: str) -> bool:
    """Whether ``path`` is the network namespace this process runs in (the node's)."""
    ours, theirs = os.stat("/proc/self/ns/net"), os.stat(path)
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


async def create_tap(ifname: str, gateway: str, address: str) -> None:
    """Make a VM's link: a persistent tap QEMU opens by name (``-netdev tap,ifname=``), its
    host side addressed as a veth's host end. The guest configures its own end (its init is
    told the address). Persistent, so it outlives a QEMU that quits for a snapshot pause."""
    await _run(["ip", "tuntap", "add", "dev", ifname, "mode", "tap", "vnet_hdr"])
    try:
        await _run(["ip", "-batch", "-"], _host_end(ifname, gateway, address))
    except BaseException:
        await remove(ifname)
        raise


async def remove(ifname: str) -> None:
    """Delete the link (both ends); a link already gone with its sandbox is not an error."""
    if exists(ifname):
        with contextlib.suppress(InfraFailure):
            await _run(["ip", "link", "del", ifname])


def exists(ifname: str) -> bool:
    return Path("/sys/class/net", ifname).exists()


def ifindex(ifname: str) -> int | None:
    try:
        return int(Path("/sys/class/net", ifname, "ifindex").read_text())
    except (OSError, ValueError):
        return None


async def host_addresses() -> list[str]:
    """The node's own IPv4 addresses (a name pointing at one of them is rebinding)."""
    proc = await spawner.create_subprocess_exec(
        "ip", "-j", "-4", "addr", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    try:
        return sorted({a["local"] for link in json.loads(out or b"[]") for a in link.get("addr_info", [])})
    except (ValueError, KeyError, TypeError):
        return []
