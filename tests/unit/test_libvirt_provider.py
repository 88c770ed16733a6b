"""The libvirt node provider without a hypervisor: the volume and domain XML it builds, and its
start/list/stop/close over a fake of the binding that keeps domains and volumes in dicts (what
libvirt would be asked, in order). A real libvirt host is needed for the rest (docs/overflow.md)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from dsec.node.libvirt_provider import (
    FW_CFG_NAME,
    METADATA_NS,
    LibvirtProvider,
    LibvirtSettings,
    domain_xml,
    edge_config,
    import_libvirt,
    node_of,
    read_fw_cfg,
    volume_xml,
)
from dsec.node.provider import NodeRequest
from dsec.protocol.errors import InfraFailure, InvalidRequest

SETTINGS = LibvirtSettings(storage_pool="pool", base_volume="base.qcow2", network="lab", edge_port=9000)


class LibvirtError(Exception):
    pass


class FakeVol:
    def __init__(self, pool: FakePool, name: str, path: str) -> None:
        self.pool, self.name, self._path = pool, name, path

    def path(self) -> str:
        return self._path

    def delete(self, flags: int) -> None:
        del self.pool.vols[self.name]


class FakePool:
    def __init__(self) -> None:
        self.vols: dict[str, FakeVol] = {}
        self.vols["base.qcow2"] = FakeVol(self, "base.qcow2", "/pool/base.qcow2")
        self.xml: list[str] = []

    def storageVolLookupByName(self, name: str) -> FakeVol:  # libvirt's names
        if name not in self.vols:
            raise LibvirtError(f"no volume {name}")
        return self.vols[name]

    def createXML(self, xml: str, flags: int) -> FakeVol:
        self.xml.append(xml)
        name = ET.fromstring(xml).findtext("name") or ""
        self.vols[name] = FakeVol(self, name, f"/pool/{name}")
        return self.vols[name]


class FakeDomain:
    def __init__(self, conn: FakeConn, xml: str) -> None:
        self.conn, self.xml, self.active = conn, xml, False
        self.name = ET.fromstring(xml).findtext("name") or ""

    def create(self) -> None:
        if self.conn.refuse_boot:
            raise LibvirtError("KVM is not available")
        self.active = True

    def isActive(self) -> bool:
        return self.active

    def destroy(self) -> None:
        self.active = False

    def undefine(self) -> None:
        del self.conn.domains[self.name]

    def XMLDesc(self, flags: int) -> str:
        return self.xml

    def interfaceAddresses(self, source: int, flags: int) -> dict[str, Any]:
        assert source == FakeLibvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
        return {"vnet0": {"addrs": [{"type": 1, "addr": "fe80::1"}, {"type": 0, "addr": "192.0.2.7"}]}}


class FakeConn:
    def __init__(self) -> None:
        self.pool = FakePool()
        self.domains: dict[str, FakeDomain] = {}
        self.refuse_boot = False
        self.closed = False

    def storagePoolLookupByName(self, name: str) -> FakePool:
        assert name == "pool"
        return self.pool

    def defineXML(self, xml: str) -> FakeDomain:
        dom = FakeDomain(self, xml)
        self.domains[dom.name] = dom
        return dom

    def lookupByName(self, name: str) -> FakeDomain:
        if name not in self.domains:
            raise LibvirtError(f"no domain {name}")
        return self.domains[name]

    def listAllDomains(self, flags: int) -> list[FakeDomain]:
        return list(self.domains.values())

    def close(self) -> None:
        self.closed = True


class FakeLibvirt:
    libvirtError = LibvirtError
    VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE = 0
    VIR_IP_ADDR_TYPE_IPV4 = 0

    def __init__(self) -> None:
        self.conn = FakeConn()
        self.uris: list[str] = []

    def open(self, uri: str) -> FakeConn:
        self.uris.append(uri)
        return self.conn


def test_the_domain_carries_size_disk_network_config_and_our_mark() -> None:
    req = NodeRequest(name="burst-1", labels={"pool": "burst"}, cpus=1.5, memory_mib=2048)
    cfg = edge_config(req, "burst-1", ["http://10.0.0.1:8642"], "s3cret", 9000)
    xml = domain_xml(SETTINGS, req, "burst-1", "/pool/dsec-burst-1.qcow2", cfg)
    root = ET.fromstring(xml)
    assert root.get("type") == "kvm" and root.findtext("name") == "dsec-burst-1"
    assert root.findtext("memory") == "2048" and root.find("memory").get("unit") == "MiB"  # type: ignore[union-attr]
    assert root.findtext("vcpu") == "2", "1.5 cores round up to 2 vCPUs"
    disk = root.find("devices/disk")
    assert disk is not None and disk.find("source").get("file") == "/pool/dsec-burst-1.qcow2"  # type: ignore[union-attr]
    assert root.find("devices/interface/source").get("network") == "lab"  # type: ignore[union-attr]
    entry = root.find("sysinfo/entry")
    assert root.find("sysinfo").get("type") == "fwcfg" and entry is not None  # type: ignore[union-attr]
    assert entry.get("name") == FW_CFG_NAME
    assert read_fw_cfg(entry.text or "") == {
        "node": "burst-1", "labels": {"pool": "burst"}, "apiservers": ["http://10.0.0.1:8642"],
        "secret": "s3cret", "port": 9000,
    }  # fmt: skip
    assert root.find(f"metadata/{{{METADATA_NS}}}node") is not None
    assert node_of(xml, "dsec-") == ("burst-1", {"pool": "burst"})
    assert node_of("<domain><name>dsec-other</name></domain>", "dsec-") is None, "not ours"
    default = ET.fromstring(domain_xml(SETTINGS, NodeRequest(), "n", "/d", {}))
    assert (default.findtext("vcpu"), default.findtext("memory")) == ("2", "4096")


def test_a_host_without_kvm_gets_an_emulated_domain() -> None:
    kvm = ET.fromstring(domain_xml(SETTINGS, NodeRequest(), "n", "/d", {}))
    assert kvm.get("type") == "kvm" and kvm.find("cpu").get("mode") == "host-passthrough"  # type: ignore[union-attr]
    tcg = LibvirtSettings(storage_pool="pool", base_volume="base.qcow2", domain_type="qemu")
    root = ET.fromstring(domain_xml(tcg, NodeRequest(), "n", "/d", {}))
    assert root.get("type") == "qemu" and root.find("cpu").get("mode") == "maximum"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="domain_type must be kvm or qemu"):
        LibvirtSettings(domain_type="xen")  # type: ignore[arg-type]


def test_an_image_without_a_bootloader_boots_its_kernel_directly() -> None:
    direct = LibvirtSettings(kernel="/k/vmlinuz", initrd="/k/initrd.img", cmdline="console=ttyS0 quiet")
    os_ = ET.fromstring(domain_xml(direct, NodeRequest(), "n", "/d", {})).find("os")
    assert os_ is not None and os_.find("boot") is None
    assert [os_.findtext(t) for t in ("kernel", "initrd", "cmdline")] == [
        "/k/vmlinuz",
        "/k/initrd.img",
        "console=ttyS0 quiet",
    ]
    plain = ET.fromstring(domain_xml(SETTINGS, NodeRequest(), "n", "/d", {})).find("os")
    assert plain is not None and plain.find("kernel") is None and plain.find("boot").get("dev") == "hd"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="go with kernel"):
        LibvirtSettings(initrd="/k/initrd.img")
    with pytest.raises(InvalidRequest, match="cmdline must be at most"):
        LibvirtSettings(kernel="/k/vmlinuz", cmdline="x" * 3000)


def test_the_disk_is_a_copy_on_write_volume_over_the_base() -> None:
    vol = ET.fromstring(volume_xml("dsec-n.qcow2", "/pool/base.qcow2", 40))
    assert vol.findtext("name") == "dsec-n.qcow2" and vol.findtext("capacity") == "40"
    assert vol.find("target/format").get("type") == "qcow2"  # type: ignore[union-attr]
    assert vol.findtext("backingStore/path") == "/pool/base.qcow2"


async def test_start_list_stop_close_through_the_binding() -> None:
    lv = FakeLibvirt()
    provider = LibvirtProvider(SETTINGS, ["http://10.0.0.1:8642"], "s3cret", libvirt=lv)
    node = await provider.start(NodeRequest(name="burst-1", labels={"pool": "burst"}))
    assert (node.state, node.url) == ("running", "http://192.0.2.7:9000")
    assert lv.uris == ["qemu:///system"]
    assert set(lv.conn.pool.vols) == {"base.qcow2", "dsec-burst-1.qcow2"}
    lv.conn.defineXML("<domain><name>someone-elses</name></domain>")
    await provider.start(NodeRequest(name="burst-2"))
    assert sorted((n.name, n.state) for n in await provider.list()) == [
        ("burst-1", "running"), ("burst-2", "running")
    ]  # fmt: skip
    stopped = await provider.stop("burst-1")
    assert stopped.state == "stopped" and "dsec-burst-1" not in lv.conn.domains
    assert "dsec-burst-1.qcow2" not in lv.conn.pool.vols, "its disk is deleted with it"
    with pytest.raises(InvalidRequest):
        await provider.stop("someone-elses")
    await provider.close()
    assert set(lv.conn.domains) == {"someone-elses"}, "close stops ours only"
    assert set(lv.conn.pool.vols) == {"base.qcow2"} and lv.conn.closed


async def test_a_vm_that_cannot_boot_is_cleaned_up_and_classified() -> None:
    lv = FakeLibvirt()
    lv.conn.refuse_boot = True
    provider = LibvirtProvider(SETTINGS, ["http://10.0.0.1:8642"], "s3cret", libvirt=lv)
    with pytest.raises(InfraFailure, match="KVM is not available"):
        await provider.start(NodeRequest(name="burst-1"))
    assert lv.conn.domains == {} and set(lv.conn.pool.vols) == {"base.qcow2"}


def test_without_the_binding_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "libvirt", None)  # import libvirt now raises ImportError
    with pytest.raises(InfraFailure, match=r"python3-libvirt.*libvirt-python"):
        import_libvirt()
    with pytest.raises(InfraFailure, match="libvirt-python"):
        LibvirtProvider(SETTINGS, ["http://a:1"], "s")
    with pytest.raises(InvalidRequest):
        LibvirtSettings(disk_gib=0)
