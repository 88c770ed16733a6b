"""LibvirtProvider against a real libvirtd: the daemon runs privileged in a mount and network
namespace of the test's own (its /etc and /var are overlays on scratch directories, its /run
is scratch: nothing of the host's libvirt state is read or written), with a libvirt network
whose DHCP is libvirt's dnsmasq and a directory storage pool. The node image stands in for
one with DSec installed: Debian's cloud kernel (the microVM guest kit's) booted directly
(``LibvirtSettings.kernel``) with an initramfs made here whose init takes a DHCP lease, reads
the provider's fw_cfg entry and serves it over HTTP on the edge port. QEMU runs as TCG
(``domain_type = "qemu"``): this host's /dev/kvm cannot run a stock guest.

What a real libvirtd showed that the test driver could not: libvirt 9.0 passes the fw_cfg
value to QEMU unescaped, so the JSON's commas cut it (QEMU refused the domain); the entry is
base64 since (``fw_cfg_value``).
"""

from __future__ import annotations

import asyncio
import gzip
import lzma
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.backends.microvm.kit import ensure_kit, newc
from dsec.node.libvirt_provider import FW_CFG_NAME, LibvirtProvider, LibvirtSettings, edge_config, read_fw_cfg
from dsec.node.provider import NodeRequest
from tests.conftest import DATA_DIR
from tests.support import eventually

_NEEDED = ("/usr/sbin/libvirtd", "/usr/sbin/dnsmasq", "/usr/bin/qemu-system-x86_64", "/usr/bin/qemu-img")
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(
        not all(os.path.exists(p) for p in _NEEDED),
        reason="needs libvirt-daemon, libvirt-daemon-driver-qemu, dnsmasq-base, qemu (./setup.sh test)",
    ),
]

NETWORK, POOL, BASE = "dsec-test", "dsec-test", "base.qcow2"
GATEWAY = "192.168.150.1"  # inside the daemon's own network namespace: no clash with the host
EDGE_PORT = 8643
APISERVERS = [f"http://{GATEWAY}:8642"]

# The daemon's configuration: root runs QEMU (no libvirt-qemu account, no cgroups or
# security driver of its own, no virtlogd), clients on its socket are root already.
QEMU_CONF = """user = "root"
group = "root"
cgroup_controllers = [ ]
security_driver = "none"
dynamic_ownership = 0
remember_owner = 0
stdio_handler = "file"
"""
LIBVIRTD_CONF = 'unix_sock_rw_perms = "0700"\nauth_unix_rw = "none"\n'
# Run by ``unshare -m -n``: its mounts and links are gone with its last process.
START = """set -e
mount -t overlay overlay -o lowerdir=/etc,upperdir={s}/etc,workdir={s}/etc-work /etc
mount -t overlay overlay -o lowerdir=/var,upperdir={s}/var,workdir={s}/var-work /var
mount --bind {s}/run /run
ip link set lo up
# Debian's build looks up its default account before it reads qemu.conf.
getent passwd libvirt-qemu >/dev/null ||
  echo 'libvirt-qemu:x:64055:64055::/var/lib/libvirt:/usr/sbin/nologin' >> /etc/passwd
getent group libvirt-qemu >/dev/null || echo 'libvirt-qemu:x:64055:' >> /etc/group
getent group kvm >/dev/null || echo 'kvm:x:64056:' >> /etc/group
exec /usr/sbin/libvirtd > {s}/libvirtd.log 2>&1
"""
NETWORK_XML = f"""<network><name>{NETWORK}</name><forward mode='open'/><bridge name='dsecbr0'/>
<ip address='{GATEWAY}' netmask='255.255.255.0'>
<dhcp><range start='192.168.150.10' end='192.168.150.50'/></dhcp></ip></network>"""

# The guest's init: the lease, then its settings from fw_cfg, served on the edge port.
INIT = f"""#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in failover net_failover virtio_net qemu_fw_cfg; do insmod /m/$m.ko; done
ip link set lo up
ip link set eth0 up
udhcpc -i eth0 -s /dhcp.sh -t 120 -T 1 -q
mkdir -p /www
cat /sys/firmware/qemu_fw_cfg/by_name/{FW_CFG_NAME}/raw > /www/edge.json
httpd -p {EDGE_PORT} -h /www
while :; do sleep 3600; done
"""
DHCP = '#!/bin/sh\ncase "$1" in bound|renew) ip addr add "$ip/${mask:-24}" dev "$interface" ;; esac\n'
APPLETS = ("sh", "mount", "insmod", "ip", "udhcpc", "mkdir", "cat", "httpd", "sleep")
MODULES = {
    "failover": "net/core/failover.ko.xz",
    "net_failover": "drivers/net/net_failover.ko.xz",
    "virtio_net": "drivers/net/virtio_net.ko.xz",
    "qemu_fw_cfg": "drivers/firmware/qemu_fw_cfg.ko.xz",
}


def guest_initrd(kroot: Path, version: str, out: Path) -> None:
    directory, program, link = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o755, stat.S_IFLNK | 0o777
    entries = [(name, directory, b"") for name in ("bin", "m", "proc", "sys", "dev", "www")]
    entries.append(("bin/busybox", program, Path("/bin/busybox").read_bytes()))
    entries += [(f"bin/{a}", link, b"busybox") for a in APPLETS]
    entries += [("init", program, INIT.encode()), ("dhcp.sh", program, DHCP.encode())]
    modules = kroot / "lib" / "modules" / version / "kernel"
    for name, rel in MODULES.items():  # busybox's insmod takes uncompressed modules only
        entries.append((f"m/{name}.ko", stat.S_IFREG | 0o644, lzma.decompress((modules / rel).read_bytes())))
    out.write_bytes(gzip.compress(newc(entries)))


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    uri: str
    scratch: Path
    kernel: Path
    initrd: Path

    @property
    def pool(self) -> Path:
        return self.scratch / "pool"

    def logs(self) -> str:
        """The daemon's log and its guests' QEMU logs (what a failed start is explained by)."""
        paths = [
            self.scratch / "libvirtd.log",
            *sorted((self.scratch / "var/log/libvirt/qemu").glob("*.log")),
        ]
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists())

    def in_netns(self, *argv: str) -> str:
        """Run ``argv`` in the daemon's network namespace (where its guests are)."""
        done = subprocess.run(
            ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout if done.returncode == 0 else ""


def _netns_processes(pid: int) -> list[int]:
    """Processes in the network namespace of ``pid`` (the daemon's: dnsmasq, QEMU), itself aside."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == ns:
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    s = tmp_path_factory.mktemp("libvirtd")
    for d in ("etc/libvirt", "etc-work", "var", "var-work", "run", "pool"):
        (s / d).mkdir(parents=True)
    (s / "etc/libvirt/qemu.conf").write_text(QEMU_CONF)
    (s / "etc/libvirt/libvirtd.conf").write_text(LIBVIRTD_CONF)
    (s / "start.sh").write_text(START.format(s=s))
    kit = ensure_kit(DATA_DIR / "node" / "guest-kit")
    initrd = s / "initrd.gz"
    guest_initrd(kit.kernel.parent.parent, kit.kernel_version, initrd)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(s / "pool" / BASE), "1G"], check=True)
    proc = subprocess.Popen(["unshare", "-m", "-n", "--propagation", "private", "bash", str(s / "start.sh")])
    try:
        socket = s / "run" / "libvirt" / "libvirt-sock"
        deadline = time.monotonic() + 60
        while not socket.exists():  # the daemon's own readiness: its socket
            assert proc.poll() is None, (s / "libvirtd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "libvirtd made no socket in 60 s"
            time.sleep(0.1)
        uri = f"qemu:///system?socket={socket}"
        import libvirt  # type: ignore[import-not-found,import-untyped,unused-ignore]

        conn = libvirt.open(uri)
        try:
            conn.networkCreateXML(NETWORK_XML)
            pool = conn.storagePoolCreateXML(
                f"<pool type='dir'><name>{POOL}</name><target><path>{s / 'pool'}</path></target></pool>", 0
            )
            pool.refresh(0)
        finally:
            conn.close()
        yield Daemon(proc, uri, s, kit.kernel, initrd)
    finally:
        # The daemon first (it would restart what is killed under it), then what it left in
        # its namespace: dnsmasq (daemonised) and any QEMU.
        left = _netns_processes(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in left + [p for p in _netns_processes(proc.pid) if p not in left]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The scratch directory stays for a failure's logs (pytest keeps the last few runs):
        # libvirtd.log, and each guest's QEMU log under var/log/libvirt/qemu/.


def _settings(d: Daemon) -> LibvirtSettings:
    return LibvirtSettings(
        uri=d.uri,
        storage_pool=POOL,
        base_volume=BASE,
        network=NETWORK,
        domain_type="qemu",
        kernel=str(d.kernel),
        initrd=str(d.initrd),
        cmdline="console=ttyS0 panic=-1",
        default_cpus=1,
        default_memory_mib=256,
        edge_port=EDGE_PORT,
        start_timeout_s=240,
    )


async def test_a_node_boots_takes_a_lease_and_reads_its_settings(daemon: Daemon) -> None:
    settings = _settings(daemon)
    provider = LibvirtProvider(settings, APISERVERS, "s3cret-s3cret")
    provider.poll_s = 0.5
    request = NodeRequest(name="virt-1", labels={"pool": "burst"}, cpus=1, memory_mib=256)
    try:
        try:
            node = await provider.start(request)
        except Exception as exc:
            raise AssertionError(f"the node did not start: {exc}\n{daemon.logs()}") from exc
        assert node.state == "running" and node.url.startswith("http://192.168.150.")
        assert node.url.endswith(f":{EDGE_PORT}")

        # The guest read what the provider gave it through fw_cfg, whole.
        async def served() -> str | None:
            url = f"{node.url}/edge.json"
            code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
            got = await asyncio.to_thread(daemon.in_netns, sys.executable, "-c", code)
            return got.strip() or None

        raw = await eventually(served, "the guest to serve its settings", 120)
        assert read_fw_cfg(raw) == edge_config(request, "virt-1", APISERVERS, "s3cret-s3cret", EDGE_PORT)

        # Another provider over the same daemon (an apiserver restart) finds the node.
        again = LibvirtProvider(settings, APISERVERS, "s3cret-s3cret")
        assert [(n.name, n.labels, n.state) for n in await again.list()] == [
            ("virt-1", {"pool": "burst"}, "running")
        ]
        await again.disconnect()

        stopped = await provider.stop("virt-1")
        assert stopped.state == "stopped" and await provider.list() == []
        assert sorted(p.name for p in daemon.pool.iterdir()) == [BASE], "its disk went with it"
    finally:
        await provider.close()
