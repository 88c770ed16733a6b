"""Nodes on demand: the :class:`NodeProvider` seam, and edges started in network namespaces.

A provider starts a node (an edge that registers with the cluster's apiservers) with labels
and a size, stops it, and lists what it started. What decides *when* (scale out while the
cluster stays past its threshold, drain and stop idle provider nodes, never one holding a
running or paused sandbox) sits above this seam; a provider only does what it is told.

:class:`LocalNetnsProvider` is the implementation for tests and single-host labs: each node is
a ``dsec edge`` process in a network namespace of its own, joined to the host by a veth pair in
a private /30, reaching the apiservers at the host end of its link only (as across machines).
A node's size is emulated by the edge's admission caps (``--admission cpu=R,memory=R``: the
sum of its sandboxes' limits stays within ``cpus`` cores and ``memory_mib``). It needs root,
iproute2 and util-linux's ``nsenter``. :class:`~dsec.node.libvirt_provider.LibvirtProvider`
implements the same Protocol over libvirt VMs; the policy is :mod:`dsec.apiserver.scaling`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.ids import validate_node_name

NodeState = Literal["starting", "running", "stopped", "failed"]
_UP_RE = re.compile(r"\bis up\b.*?\bat\s+(https?://\S+)", re.DOTALL)
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_NETNS_DIR = Path("/run/netns")
_PREFIX = "10.214"  # of the private 10/8; the third octet is one no host address or route uses


@dataclass(frozen=True)
class NodeRequest:
    """A node to start: its name (None: the provider picks one), labels sandboxes can ask for
    (``Hardware.node_labels``), and a size (None: what the machine has)."""

    name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mib: int | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            validate_node_name(self.name)
        for k, v in self.labels.items():
            if not _LABEL_RE.fullmatch(k) or not 0 < len(v) <= 256 or "=" in k:
                raise InvalidRequest(f"node label {k}={v!r}: keys 1-63 of A-Za-z0-9._/-, values 1-256")
        if self.cpus is not None and not 0 < self.cpus <= 4096:
            raise InvalidRequest("cpus must be above 0 and at most 4096")
        if self.memory_mib is not None and not 0 < self.memory_mib <= 1 << 30:
            raise InvalidRequest("memory_mib must be above 0 and at most 2^30")


@dataclass
class ProvidedNode:
    name: str
    labels: dict[str, str]
    state: NodeState
    url: str = ""  # where apiservers reach its edge, once running
    started_at: float = field(default_factory=time.time)
    detail: str = ""  # why it failed


class NodeProvider(Protocol):
    async def start(self, request: NodeRequest) -> ProvidedNode:
        """Start a node and return once its edge serves (it registers by itself); a node that
        could not start is stopped again and raised as ``InfraFailure``."""
        ...

    async def stop(self, name: str) -> ProvidedNode:
        """Stop node ``name`` (its edge ends; the caller drained it first) and release it."""
        ...

    async def list(self) -> list[ProvidedNode]: ...

    async def close(self) -> None:
        """Stop every node this provider started."""
        ...


def _ip(*argv: str) -> str:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise InfraFailure(
            f"ip {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}",
            reason=InfraReason.network,
        )
    return done.stdout


@dataclass(frozen=True)
class _Link:
    netns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    def create(self) -> None:
        _ip("netns", "add", self.netns)
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.netns)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.netns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            _ip("-n", self.netns, "link", "set", self.ns_if, "up")
            _ip("-n", self.netns, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        if Path(f"/sys/class/net/{self.host_if}").exists():
            _ip("link", "del", self.host_if)  # takes its peer with it
        if (_NETNS_DIR / self.netns).exists():
            _ip("netns", "del", self.netns)


@dataclass
class _Started:
    node: ProvidedNode
    link: _Link
    proc: subprocess.Popen[bytes]
    log: Path


class LocalNetnsProvider:
    """Edges started as ``dsec edge`` processes, each in a network namespace of its own.

    ``apiserver_ports``: the cluster's apiservers, listening on every address of this host
    (an edge reaches them at the host end of its veth); ``shared_layers`` and ``secret_file``:
    the cluster's; ``data_root``: where each node's data directory and log go;
    ``edge_args``: more ``dsec edge`` options for every node (e.g. ``--no-microvm``).
    """

    def __init__(
        self,
        apiserver_ports: Sequence[int],
        shared_layers: Path,
        secret_file: Path,
        data_root: Path,
        *,
        edge_args: Sequence[str] = (),
        edge_port: int = 8643,
        start_timeout_s: float = 60.0,
        dsec: str | None = None,
    ) -> None:
        if not apiserver_ports:
            raise InvalidRequest("a node provider needs at least one apiserver to register with")
        self.apiserver_ports = list(apiserver_ports)
        self.shared_layers = shared_layers
        self.secret_file = secret_file
        self.data_root = data_root
        self.edge_args = list(edge_args)
        self.edge_port = edge_port
        self.start_timeout_s = start_timeout_s
        self.dsec = dsec or str(Path(sys.executable).with_name("dsec"))
        self._nodes: dict[str, _Started] = {}
        self._slots: set[int] = set()  # /30s in use, 1..63 of the provider's /24
        self._octet: int | None = None
        self._count = 0

    # -- the seam -------------------------------------------------------------------------------

    async def start(self, request: NodeRequest) -> ProvidedNode:
        self.require_tools()
        name = request.name or self._next_name()
        if name in self._nodes and self._nodes[name].node.state in ("starting", "running"):
            raise InvalidRequest(f"node {name!r} is already started by this provider")
        link = await asyncio.to_thread(self._plan_and_create, name)
        data = self.data_root / name
        data.mkdir(parents=True, exist_ok=True)
        log = self.data_root / f"{name}.log"
        node = ProvidedNode(name, dict(request.labels), "starting")
        try:
            proc = self._spawn(name, link, data, log, request)
        except BaseException:
            await asyncio.to_thread(self._release, link)
            raise
        self._nodes[name] = started = _Started(node, link, proc, log)
        try:
            node.url = await self._wait_up(started)
        except BaseException as exc:
            node.state, node.detail = "failed", str(exc)
            await self._end(started)
            raise
        node.state = "running"
        return node

    async def stop(self, name: str) -> ProvidedNode:
        started = self._nodes.get(name)
        if started is None:
            raise InvalidRequest(f"node {name!r} was not started by this provider")
        await self._end(started)
        if started.node.state != "failed":
            started.node.state = "stopped"
        return started.node

    async def list(self) -> list[ProvidedNode]:
        for started in self._nodes.values():  # one that died by itself is failed, not running
            if started.node.state == "running" and started.proc.poll() is not None:
                started.node.state = "failed"
                started.node.detail = f"the edge exited with {started.proc.returncode}"
        return [s.node for s in self._nodes.values()]

    async def close(self) -> None:
        for name, started in list(self._nodes.items()):
            if started.node.state in ("starting", "running"):
                await self.stop(name)

    # -- plumbing -------------------------------------------------------------------------------

    @staticmethod
    def require_tools() -> None:
        """``InfraFailure`` unless this host can run the provider's nodes (root, ip, nsenter)."""
        missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
        if missing or os.geteuid() != 0:
            why = f"{', '.join(missing)} not found" if missing else "network namespaces need root"
            raise InfraFailure(f"local node provider: {why}", reason=InfraReason.network)

    def _next_name(self) -> str:
        while True:
            self._count += 1
            name = f"prov{os.getpid() % 100000}-{self._count}"
            if name not in self._nodes:
                return name

    def _plan_and_create(self, name: str) -> _Link:
        if self._octet is None:
            used = _ip("-4", "-o", "addr", "show") + _ip("-4", "route", "show", "table", "all")
            start = os.getpid() % 256
            octets = ((start + step) % 256 for step in range(256))
            self._octet = next((o for o in octets if f"{_PREFIX}.{o}." not in used), None)
            if self._octet is None:
                raise InfraFailure(
                    f"every {_PREFIX}.x.0/24 is in use on this host", reason=InfraReason.network
                )
        slot = next((s for s in range(1, 64) if s not in self._slots), None)
        if slot is None:
            raise InfraFailure("this provider runs 63 nodes already", reason=InfraReason.network)
        net = ipaddress.ip_network(f"{_PREFIX}.{self._octet}.{4 * slot}/30")
        host, inside = (str(a) for a in net.hosts())
        tag = f"{os.getpid() % 100000}p{slot}"  # interface names are at most 15 bytes
        link = _Link(f"dsecp-{os.getpid()}-{slot}", f"dsp{tag}h", f"dsp{tag}n", host, inside)
        link.create()
        self._slots.add(slot)
        return link

    def _release(self, link: _Link) -> None:
        link.delete()
        slot = int(link.netns.rsplit("-", 1)[1])
        self._slots.discard(slot)

    def _spawn(
        self, name: str, link: _Link, data: Path, log: Path, request: NodeRequest
    ) -> subprocess.Popen[bytes]:
        argv = [
            self.dsec, "edge",
            "--node", name,
            "--data-dir", str(data),
            "--host", link.ns_ip,
            "--port", str(self.edge_port),
            "--shared-layers", str(self.shared_layers),
            "--secret-file", str(self.secret_file),
            *self.edge_args,
        ]  # fmt: skip
        for port in self.apiserver_ports:
            argv += ["--apiserver", f"http://{link.host_ip}:{port}"]
        for k, v in request.labels.items():
            argv += ["--label", f"{k}={v}"]
        caps = []
        if request.cpus is not None:
            caps.append(f"cpu={request.cpus / (os.cpu_count() or 1):.6f}")
        if request.memory_mib is not None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
            caps.append(f"memory={request.memory_mib / max(1, total):.6f}")
        if caps:
            argv += ["--admission", ",".join(caps)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env.update(PYTHONUNBUFFERED="1", COLUMNS="400", NO_COLOR="1")
        with open(log, "wb") as out:
            return subprocess.Popen(
                ["nsenter", f"--net={_NETNS_DIR / link.netns}", "--", *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a signal to the provider's group never reaches it
            )

    async def _wait_up(self, started: _Started) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            text = started.log.read_text(errors="replace") if started.log.exists() else ""
            m = _UP_RE.search(text)
            if m:
                return m.group(1).rstrip(".,;)")
            if started.proc.poll() is not None:
                tail = "\n".join(text.splitlines()[-20:])
                raise InfraFailure(
                    f"node {started.node.name}: the edge exited with {started.proc.returncode}\n{tail}",
                    reason=InfraReason.registration,
                )
            if time.monotonic() > deadline:
                raise InfraFailure(
                    f"node {started.node.name} did not come up in {self.start_timeout_s} s",
                    reason=InfraReason.registration,
                )
            await asyncio.sleep(0.1)  # polling the edge's log: it says when it serves

    async def _end(self, started: _Started, timeout: float = 60.0) -> None:
        proc = started.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # by PID: only the edge this provider started
            try:
                await asyncio.to_thread(proc.wait, timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 30)
        await asyncio.to_thread(self._release, started.link)
