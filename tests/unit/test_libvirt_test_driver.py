"""The libvirt node provider over the real binding (``libvirt-python``) and libvirt's own test
hypervisor (``test:///default``, in the library: no daemon, no VM boots). libvirt parses and
checks every volume and domain the provider defines as it would for QEMU, keeps them, and
answers for their DHCP leases; the XML is also checked against libvirt's RelaxNG schemas.
What needs a libvirt host with KVM (a guest that boots and runs ``dsec edge``) is in
docs/overflow.md."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt  # type: ignore[import-not-found,import-untyped,unused-ignore]
import pytest

from dsec.node.libvirt_provider import (
    FW_CFG_NAME,
    LibvirtProvider,
    LibvirtSettings,
    domain_xml,
    edge_config,
    read_fw_cfg,
    volume_xml,
)
from dsec.node.provider import NodeRequest
from dsec.protocol.errors import InfraFailure, InvalidRequest

URI = "test:///default"
POOL = "default-pool"  # the test hypervisor's pool and network
SCHEMAS = Path("/usr/share/libvirt/schemas")  # libvirt0's
APISERVERS = ["http://10.0.0.1:8642"]
SETTINGS = LibvirtSettings(uri=URI, storage_pool=POOL, base_volume="base.qcow2", edge_port=9000)
FOREIGN = "dsec-someone"  # named as this provider names its domains, but not marked as one of them


def _volume(name: str) -> str:
    fmt = "<target><format type='qcow2'/></target>"
    return f"<volume><name>{name}</name><capacity unit='GiB'>1</capacity>{fmt}</volume>"


@pytest.fixture
def hypervisor() -> Iterator[Any]:
    """The test hypervisor with a base volume and a domain that is not the provider's. Every
    open of test:///default shares one state while a connection is open; what the test made
    is removed at the end, so the next test starts from libvirt's defaults."""
    conn = libvirt.open(URI)
    pool = conn.storagePoolLookupByName(POOL)
    builtin = {d.name() for d in conn.listAllDomains(0)}
    try:
        pool.createXML(_volume("base.qcow2"), 0)
        hvm = "<memory>1024</memory><os><type>hvm</type></os>"
        conn.defineXML(f"<domain type='kvm'><name>{FOREIGN}</name>{hvm}</domain>")
        yield conn
    finally:
        for dom in conn.listAllDomains(0):
            if dom.name() not in builtin:
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
        for vol in pool.listAllVolumes(0):
            vol.delete(0)
        conn.close()


def _provider(settings: LibvirtSettings = SETTINGS) -> LibvirtProvider:
    provider = LibvirtProvider(settings, APISERVERS, "s3cret-s3cret-s3cret")  # imports the binding
    provider.poll_s = 0.05  # the test hypervisor has every running domain's lease at once
    return provider


def _domains(conn: Any) -> set[str]:
    return {d.name() for d in conn.listAllDomains(0)}


def _volumes(conn: Any) -> set[str]:
    return {v.name() for v in conn.storagePoolLookupByName(POOL).listAllVolumes(0)}


def test_the_domain_and_its_disk_validate_against_libvirts_schemas(tmp_path: Path) -> None:
    req = NodeRequest(name="burst-1", labels={"pool": "burst"}, cpus=1.5, memory_mib=2048)
    cfg = edge_config(req, "burst-1", APISERVERS, "s3cret", 9000)
    for schema, xml in (
        ("domain.rng", domain_xml(LibvirtSettings(), req, "burst-1", "/pool/dsec-burst-1.qcow2", cfg)),
        ("domain.rng", domain_xml(LibvirtSettings(), NodeRequest(), "n", "/pool/dsec-n.qcow2", {})),
        ("domain.rng", domain_xml(LibvirtSettings(domain_type="qemu"), req, "n", "/pool/dsec-n.qcow2", cfg)),
        (
            "domain.rng",
            domain_xml(
                LibvirtSettings(kernel="/k/vmlinuz", initrd="/k/i", cmdline="quiet"), req, "n", "/p", cfg
            ),
        ),
        ("storagevol.rng", volume_xml("dsec-burst-1.qcow2", "/pool/base.qcow2", 40)),
    ):
        path = tmp_path / "doc.xml"
        path.write_text(xml)
        done = subprocess.run(
            ["xmllint", "--noout", "--relaxng", str(SCHEMAS / schema), str(path)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{schema}: {done.stderr}\n{xml}"


async def test_start_list_stop_close_on_libvirts_test_hypervisor(hypervisor: Any) -> None:
    provider = _provider()
    req = NodeRequest(name="burst-1", labels={"pool": "burst"}, cpus=1.5, memory_mib=2048)
    node = await provider.start(req)
    assert node.state == "running" and node.url.startswith("http://192.168.122."), node
    assert node.url.endswith(":9000")

    # The domain as libvirt parsed and keeps it: size, disk, the guest's config, running.
    dom = hypervisor.lookupByName("dsec-burst-1")
    assert dom.isActive()
    root = ET.fromstring(dom.XMLDesc(0))
    assert root.findtext("vcpu") == "2" and root.findtext("memory") == str(2048 * 1024)  # KiB
    entry = root.find(f"sysinfo[@type='fwcfg']/entry[@name='{FW_CFG_NAME}']")
    assert entry is not None and read_fw_cfg(entry.text or "") == edge_config(
        req, "burst-1", APISERVERS, "s3cret-s3cret-s3cret", 9000
    )
    disk = hypervisor.storagePoolLookupByName(POOL).storageVolLookupByName("dsec-burst-1.qcow2")
    assert root.find("devices/disk/source").get("file") == disk.path()  # type: ignore[union-attr]
    vol = ET.fromstring(disk.XMLDesc(0))
    assert vol.findtext("backingStore/path") == "/default-pool/base.qcow2", "copy-on-write over the base"

    await provider.start(NodeRequest(name="burst-2"))
    listed = sorted((n.name, n.state, n.labels) for n in await provider.list())
    assert listed == [("burst-1", "running", {"pool": "burst"}), ("burst-2", "running", {})]
    stopped = await provider.stop("burst-1")
    assert stopped.state == "stopped" and "dsec-burst-1" not in _domains(hypervisor)
    assert "dsec-burst-1.qcow2" not in _volumes(hypervisor), "its disk goes with it"
    with pytest.raises(InvalidRequest):
        await provider.stop("someone")  # dsec-someone exists, but is not this provider's
    await provider.close()
    assert _domains(hypervisor) >= {FOREIGN} and not {"dsec-burst-2"} & _domains(hypervisor)
    assert _volumes(hypervisor) == {"base.qcow2"}


async def test_the_next_apiservers_provider_finds_the_running_vms(hypervisor: Any) -> None:
    first = _provider()
    await first.start(NodeRequest(name="burst-1", labels={"pool": "burst"}))
    await first.disconnect()  # an apiserver that exits leaves its VMs running
    assert hypervisor.lookupByName("dsec-burst-1").isActive()
    second = _provider()
    assert [(n.name, n.state, n.labels) for n in await second.list()] == [
        ("burst-1", "running", {"pool": "burst"})
    ]
    await second.stop("burst-1")
    assert "dsec-burst-1" not in _domains(hypervisor) and _volumes(hypervisor) == {"base.qcow2"}
    await second.close()


async def test_a_failed_start_removes_only_what_it_made(hypervisor: Any) -> None:
    provider = _provider()
    # A domain of the same name that is someone else's: refused by libvirt, and left alone.
    with pytest.raises(InfraFailure, match="already exists"):
        await provider.start(NodeRequest(name="someone"))
    assert FOREIGN in _domains(hypervisor), "someone else's domain was removed"
    assert _volumes(hypervisor) == {"base.qcow2"}, "the disk this start made stays"
    # A volume of the name the node's disk would have: refused, and left alone.
    pool = hypervisor.storagePoolLookupByName(POOL)
    pool.createXML(_volume("dsec-n3.qcow2"), 0)
    with pytest.raises(InfraFailure, match="already exists"):
        await provider.start(NodeRequest(name="n3"))
    assert _volumes(hypervisor) == {"base.qcow2", "dsec-n3.qcow2"}
    assert "dsec-n3" not in _domains(hypervisor)
    await provider.close()
    # No base image in the pool: classified, nothing made.
    missing = _provider(LibvirtSettings(uri=URI, storage_pool=POOL, base_volume="gone.qcow2"))
    with pytest.raises(InfraFailure, match=r"gone\.qcow2"):
        await missing.start(NodeRequest(name="n4"))
    assert "dsec-n4" not in _domains(hypervisor) and "dsec-n4.qcow2" not in _volumes(hypervisor)
    await missing.close()
