"""Nodes on demand as libvirt VMs: a :class:`~dsec.node.provider.NodeProvider` over
``libvirt-python``.

Each node is a libvirt domain booted from a copy-on-write volume over a base image (a disk
with DSec installed whose boot starts ``dsec edge``), in a storage pool and on a network the
host already has. The edge learns who it is from QEMU's ``fw_cfg`` (``opt/dsec/edge.json.b64``:
node name, labels, the apiservers to register with, the cluster secret, its port, as JSON in
base64); the guest reads it from ``/sys/firmware/qemu_fw_cfg/by_name/opt/dsec/edge.json.b64/raw``
(root only; :func:`read_fw_cfg`). Base64, because libvirt (9.0) hands the value to QEMU's
``-fw_cfg name=...,string=...`` without escaping commas, and QEMU splits a JSON value at
them: found booting a real guest (``tests/node/test_libvirt_real.py``). A node's
size is the VM's: ``cpus`` vCPUs (rounded up) and ``memory_mib``. Domains this provider made
carry a metadata element naming it, so :meth:`LibvirtProvider.list` finds them again after a
restart of the apiserver and never touches another domain.

The binding is imported when the provider is made, not with this module: a host without it
gets :class:`~dsec.protocol.errors.InfraFailure` naming the package (see ``docs/overflow.md``).
Every libvirt call blocks, so each runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import math
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dsec.node.provider import NodeRequest, NodeState, ProvidedNode
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.ids import validate_node_name

METADATA_NS = "https://dsec.dev/xmlns/node-provider/1"
FW_CFG_NAME = "opt/dsec/edge.json.b64"
_MISSING = (
    "the libvirt node provider needs the libvirt Python binding: on Debian/Ubuntu"
    " `apt-get install python3-libvirt` (then a venv made with --system-site-packages), or"
    " `pip install libvirt-python` (builds against libvirt-dev with pkg-config and gcc)"
)


def import_libvirt() -> Any:
    """The ``libvirt`` module, or ``InfraFailure`` naming what to install."""
    try:
        import libvirt  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise InfraFailure(f"{_MISSING} ({exc})", reason=InfraReason.runtime) from None
    # Every error also comes back as an exception, which the provider classifies; libvirt's
    # default handler would print each to stderr as well (a lookup of a gone domain included).
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


@dataclass(frozen=True)
class LibvirtSettings:
    """Where and from what the VMs are made (all must exist on the libvirt host)."""

    uri: str = "qemu:///system"
    storage_pool: str = "default"
    base_volume: str = "dsec-node.qcow2"  # a volume of that pool: the image every node boots
    network: str = "default"  # a libvirt network with DHCP (the VM's address comes from its lease)
    disk_gib: int = 40  # the copy-on-write disk's virtual size
    default_cpus: float = 2
    default_memory_mib: int = 4096
    edge_port: int = 8643
    name_prefix: str = "dsec-"  # domain names: <prefix><node>
    start_timeout_s: float = 300.0
    # "kvm" on a host with /dev/kvm; "qemu" where there is none (QEMU's TCG: slower, but the same
    # guest). KVM passes the host's CPU through; TCG emulates the most it can ("maximum").
    domain_type: Literal["kvm", "qemu"] = "kvm"
    # Boot a kernel directly (paths on the libvirt host) instead of the disk's bootloader: a
    # node image with no bootloader, as DSec's own VM images are. ``cmdline`` goes with it.
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str = ""

    def __post_init__(self) -> None:
        if self.domain_type not in ("kvm", "qemu"):
            raise InvalidRequest(f"domain_type must be kvm or qemu, not {self.domain_type!r}")
        if not 1 <= self.disk_gib <= 65536:
            raise InvalidRequest("disk_gib must be 1-65536")
        if not 1 <= self.edge_port <= 65535:
            raise InvalidRequest("edge_port must be 1-65535")
        if (self.initrd or self.cmdline) and not self.kernel:
            raise InvalidRequest("initrd and cmdline go with kernel (a direct kernel boot)")
        if len(self.cmdline) > 2048:
            raise InvalidRequest("cmdline must be at most 2048 characters")


def volume_xml(name: str, base_path: str, disk_gib: int) -> str:
    """A qcow2 volume backed by the base image: a node's disk costs what it writes."""
    vol = ET.Element("volume")
    ET.SubElement(vol, "name").text = name
    ET.SubElement(vol, "capacity", unit="GiB").text = str(disk_gib)
    target = ET.SubElement(vol, "target")
    ET.SubElement(target, "format", type="qcow2")
    backing = ET.SubElement(vol, "backingStore")
    ET.SubElement(backing, "path").text = base_path
    ET.SubElement(backing, "format", type="qcow2")
    return ET.tostring(vol, encoding="unicode")


def edge_config(
    request: NodeRequest, name: str, apiservers: Sequence[str], secret: str, port: int
) -> dict[str, Any]:
    """What the guest's edge is started with (the guest image's unit maps it to options)."""
    return {
        "node": name,
        "labels": dict(request.labels),
        "apiservers": list(apiservers),
        "secret": secret,
        "port": port,
    }


def fw_cfg_value(config: dict[str, Any]) -> str:
    """The edge's settings as the fw_cfg entry holds them: JSON, base64 (no comma)."""
    return base64.b64encode(json.dumps(config, sort_keys=True).encode()).decode()


def read_fw_cfg(value: str | bytes) -> dict[str, Any]:
    """What the guest reads back from the entry (:func:`fw_cfg_value`)."""
    config: dict[str, Any] = json.loads(base64.b64decode(value, validate=True))
    return config


def domain_xml(
    settings: LibvirtSettings, request: NodeRequest, name: str, disk_path: str, config: dict[str, Any]
) -> str:
    """The domain of node ``name``: KVM (or TCG), its size, the disk, the network, fw_cfg, our mark."""
    cpus = math.ceil(request.cpus if request.cpus is not None else settings.default_cpus)
    memory = request.memory_mib if request.memory_mib is not None else settings.default_memory_mib
    dom = ET.Element("domain", type=settings.domain_type)
    ET.SubElement(dom, "name").text = settings.name_prefix + name
    ET.SubElement(dom, "memory", unit="MiB").text = str(memory)
    ET.SubElement(dom, "vcpu").text = str(cpus)
    meta = ET.SubElement(dom, "metadata")
    ET.register_namespace("dsec", METADATA_NS)
    mark = ET.SubElement(meta, f"{{{METADATA_NS}}}node", name=name)
    for k, v in sorted(request.labels.items()):
        ET.SubElement(mark, f"{{{METADATA_NS}}}label", key=k, value=v)
    os_ = ET.SubElement(dom, "os")
    ET.SubElement(os_, "type", arch="x86_64", machine="q35").text = "hvm"
    if settings.kernel:
        ET.SubElement(os_, "kernel").text = settings.kernel
        if settings.initrd:
            ET.SubElement(os_, "initrd").text = settings.initrd
        if settings.cmdline:
            ET.SubElement(os_, "cmdline").text = settings.cmdline
    else:
        ET.SubElement(os_, "boot", dev="hd")
    sysinfo = ET.SubElement(dom, "sysinfo", type="fwcfg")  # libvirt's name for QEMU's fw_cfg
    ET.SubElement(sysinfo, "entry", name=FW_CFG_NAME).text = fw_cfg_value(config)
    if settings.domain_type == "kvm":
        ET.SubElement(dom, "cpu", mode="host-passthrough")  # the edge checks for nested KVM itself
    else:
        ET.SubElement(dom, "cpu", mode="maximum")  # TCG: every feature QEMU can emulate
    features = ET.SubElement(dom, "features")
    ET.SubElement(features, "acpi")
    devices = ET.SubElement(dom, "devices")
    disk = ET.SubElement(devices, "disk", type="file", device="disk")
    ET.SubElement(disk, "driver", name="qemu", type="qcow2", discard="unmap")
    ET.SubElement(disk, "source", file=disk_path)
    ET.SubElement(disk, "target", dev="vda", bus="virtio")
    nic = ET.SubElement(devices, "interface", type="network")
    ET.SubElement(nic, "source", network=settings.network)
    ET.SubElement(nic, "model", type="virtio")
    ET.SubElement(devices, "console", type="pty")
    ET.SubElement(devices, "rng", model="virtio").append(_backend("/dev/urandom"))
    return ET.tostring(dom, encoding="unicode")


def _backend(path: str) -> ET.Element:
    el = ET.Element("backend", model="random")
    el.text = path
    return el


def node_of(xml: str, prefix: str) -> tuple[str, dict[str, str]] | None:
    """(node, labels) of a domain this provider made; None for any other domain."""
    root = ET.fromstring(xml)
    mark = root.find(f"metadata/{{{METADATA_NS}}}node")
    name = root.findtext("name") or ""
    if mark is None or not name.startswith(prefix):
        return None
    labels = {el.get("key", ""): el.get("value", "") for el in mark.findall(f"{{{METADATA_NS}}}label")}
    return mark.get("name", ""), labels


class LibvirtProvider:
    """Nodes as libvirt VMs. ``apiservers``: URLs the guests reach the apiservers on;
    ``secret``: the cluster secret (given to each guest through fw_cfg); ``libvirt``: the
    binding (tests pass a fake; by default it is imported, see :func:`import_libvirt`)."""

    def __init__(
        self,
        settings: LibvirtSettings,
        apiservers: Sequence[str],
        secret: str,
        *,
        libvirt: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not apiservers:
            raise InvalidRequest("a node provider needs at least one apiserver to register with")
        self.settings = settings
        self.apiservers = list(apiservers)
        self.secret = secret
        self.libvirt = libvirt if libvirt is not None else import_libvirt()
        self.clock = clock
        self._conn: Any = None
        self._count = 0
        self.poll_s = 2.0  # how often a starting VM's lease is looked for

    def _connect(self) -> Any:
        if self._conn is None:
            try:
                self._conn = self.libvirt.open(self.settings.uri)
            except self.libvirt.libvirtError as exc:
                raise InfraFailure(
                    f"libvirt {self.settings.uri}: {exc}", reason=InfraReason.runtime
                ) from None
        return self._conn

    async def start(self, request: NodeRequest) -> ProvidedNode:
        self._count += 1
        name = validate_node_name(request.name or f"virt-{self._count}")
        node = ProvidedNode(name, dict(request.labels), "starting")
        made: builtins.list[str] = []  # "disk" once this start made it: a failure removes only that
        try:
            await asyncio.to_thread(self._create, request, name, made)
            node.url = await self._wait_address(name)
        except BaseException as exc:
            node.state, node.detail = "failed", str(exc)
            await asyncio.to_thread(self._destroy, name, disk="disk" in made)
            if isinstance(exc, self.libvirt.libvirtError):
                raise InfraFailure(f"node {name}: libvirt: {exc}", reason=InfraReason.runtime) from None
            raise
        node.state = "running"
        return node

    def _create(self, request: NodeRequest, name: str, made: builtins.list[str]) -> None:
        conn = self._connect()
        pool = conn.storagePoolLookupByName(self.settings.storage_pool)
        base = pool.storageVolLookupByName(self.settings.base_volume)
        vol = pool.createXML(volume_xml(self._disk(name), base.path(), self.settings.disk_gib), 0)
        made.append("disk")
        config = edge_config(request, name, self.apiservers, self.secret, self.settings.edge_port)
        dom = conn.defineXML(domain_xml(self.settings, request, name, vol.path(), config))
        dom.create()

    def _disk(self, name: str) -> str:
        return f"{self.settings.name_prefix}{name}.qcow2"

    async def _wait_address(self, name: str) -> str:
        deadline = self.clock() + self.settings.start_timeout_s
        while True:
            addr = await asyncio.to_thread(self._address, name)
            if addr is not None:
                return f"http://{addr}:{self.settings.edge_port}"
            if self.clock() > deadline:
                raise InfraFailure(
                    f"node {name}: no address within {self.settings.start_timeout_s} s",
                    reason=InfraReason.registration,
                )
            await asyncio.sleep(self.poll_s)  # the lease appears when the guest's DHCP asks

    def _address(self, name: str) -> str | None:
        dom = self._connect().lookupByName(self.settings.name_prefix + name)
        source = self.libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
        for iface in (dom.interfaceAddresses(source, 0) or {}).values():
            for addr in iface.get("addrs") or ():
                if addr.get("type") == self.libvirt.VIR_IP_ADDR_TYPE_IPV4:
                    return str(addr["addr"])
        return None

    async def stop(self, name: str) -> ProvidedNode:
        found = {n.name: n for n in await self.list()}
        if name not in found:
            raise InvalidRequest(f"node {name!r} was not started by this provider")
        await asyncio.to_thread(self._destroy, name)
        node = found[name]
        node.state = "stopped"
        return node

    def _destroy(self, name: str, *, disk: bool = True) -> None:
        """Power off and undefine the domain if it carries this provider's mark for ``name``
        (a domain of that name someone else made is never touched), then delete the disk
        (``disk``: it is this provider's); each step tolerates what is already gone."""
        conn = self._connect()
        err = self.libvirt.libvirtError
        try:
            dom = conn.lookupByName(self.settings.name_prefix + name)
        except err:
            dom = None
        mark = None if dom is None else node_of(dom.XMLDesc(0), self.settings.name_prefix)
        if dom is not None and mark is not None and mark[0] == name:
            if dom.isActive():
                dom.destroy()
            dom.undefine()
        if not disk:
            return
        try:
            pool = conn.storagePoolLookupByName(self.settings.storage_pool)
            pool.storageVolLookupByName(self._disk(name)).delete(0)
        except err:
            pass

    async def list(self) -> list[ProvidedNode]:
        return await asyncio.to_thread(self._list)

    def _list(self) -> builtins.list[ProvidedNode]:
        out: builtins.list[ProvidedNode] = []
        for dom in self._connect().listAllDomains(0):
            mine = node_of(dom.XMLDesc(0), self.settings.name_prefix)
            if mine is not None:
                state: NodeState = "running" if dom.isActive() else "stopped"
                out.append(ProvidedNode(mine[0], mine[1], state))
        return out

    async def disconnect(self) -> None:
        """Close the connection and leave the VMs running (an apiserver that exits: the next
        one adopts them); :meth:`close` destroys them."""
        if self._conn is not None:
            await asyncio.to_thread(self._conn.close)
            self._conn = None

    async def close(self) -> None:
        for node in await self.list():
            await asyncio.to_thread(self._destroy, node.name)
        if self._conn is not None:
            await asyncio.to_thread(self._conn.close)
            self._conn = None
