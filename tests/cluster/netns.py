"""Network namespaces for a cluster on one machine: one per node, wired to the host by a veth.

Each namespace gets a veth pair in a private /30: the host end in the root namespace, the
other end inside, plus loopback. Nothing routes between namespaces; a process inside reaches
the root namespace only at its own host-side address, and the root namespace reaches it only
at its inside address. So an edge that listened on the wrong address, or an apiserver that
tried 127.0.0.1 for an edge, fails here as it would across machines.

Names carry the test process's PID, so concurrent runs cannot collide, and the /24 used is
one with no address or route on the host.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "10.213"  # of the private 10/8; the third octet is picked per run


class NetnsError(RuntimeError):
    pass


def run(*argv: str) -> str:
    """Run an iproute2 command; any failure is an error that names the command and its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def require_tools() -> None:
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"{', '.join(missing)} not found: install iproute2 and util-linux (setup.sh does)")
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root")


def free_octet(start: int) -> int:
    """A third octet for 10.213.<o>.0/24 that no address or route on the host uses."""
    used = run("ip", "-4", "-o", "addr", "show") + run("ip", "-4", "route", "show", "table", "all")
    for step in range(256):
        octet = (start + step) % 256
        if f"{PREFIX}.{octet}." not in used:
            return octet
    raise NetnsError(f"every {PREFIX}.x.0/24 is in use on this host")


@dataclass(frozen=True)
class Netns:
    """One namespace and its veth pair."""

    name: str
    host_if: str  # the root namespace's end
    ns_if: str  # the end inside the namespace
    host_ip: str  # the root namespace's address on this link: what the inside reaches
    ns_ip: str  # the address inside: what the root namespace reaches

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def enter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace's network only.

        Not ``ip netns exec``: that also makes a new mount namespace and remounts /sys, which
        hides /sys/fs/cgroup from the process (an edge's container backend needs it).
        """
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def create(self) -> None:
        run("ip", "netns", "add", self.name)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.name)
        run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        run("ip", "-n", self.name, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        run("ip", "-n", self.name, "link", "set", self.ns_if, "up")
        run("ip", "-n", self.name, "link", "set", "lo", "up")

    def delete(self) -> None:
        """Remove the veth pair and the namespace; idempotent, and safe on a half-made one."""
        if Path(f"/sys/class/net/{self.host_if}").exists():
            run("ip", "link", "del", self.host_if)  # takes its peer with it
        if self.path.exists():
            run("ip", "netns", "del", self.name)

    def leftovers(self) -> list[str]:
        out = []
        if self.path.exists():
            out.append(f"netns {self.name}")
        if Path(f"/sys/class/net/{self.host_if}").exists():
            out.append(f"link {self.host_if}")
        return out


def plan(count: int, pid: int | None = None) -> list[Netns]:
    """``count`` namespaces ``dsect-<pid>-e<i>`` with a /30 each in one unused /24."""
    pid = os.getpid() if pid is None else pid
    octet = free_octet(pid % 256)
    out = []
    for i in range(1, count + 1):
        net = ipaddress.ip_network(f"{PREFIX}.{octet}.{4 * i}/30")
        host, inside = list(net.hosts())
        out.append(
            Netns(
                name=f"dsect-{pid}-e{i}",
                # Interface names are at most 15 bytes: "dst" + 7 PID digits + 2 stays under.
                host_if=f"dst{pid}h{i}",
                ns_if=f"dst{pid}n{i}",
                host_ip=str(host),
                ns_ip=str(inside),
            )
        )
    return out


def create_all(spaces: Sequence[Netns]) -> None:
    """Create every namespace, or none: a failure removes what was made, then raises."""
    require_tools()
    try:
        for ns in spaces:
            ns.create()
    except BaseException:
        delete_all(spaces)
        raise


def delete_all(spaces: Sequence[Netns]) -> list[str]:
    """Delete every namespace (each attempted even if another fails); returns what is left."""
    errors = []
    for ns in spaces:
        try:
            ns.delete()
        except NetnsError as exc:
            errors.append(str(exc))
    return errors + [left for ns in spaces for left in ns.leftovers()]
