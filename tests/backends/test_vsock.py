"""The VM agent channel over vsock: QEMU's command line, the vhost-vsock probe and the node's
capabilities, guest CIDs (unique, journaled, released, fresh for forks), and the guest agent's
connection handling. No VM boots here: this host has no /dev/vhost-vsock, so the live vsock
path (a guest reached over AF_VSOCK) is untested; the agent's accept/reconnect loop runs on
the host over a unix socket instead (``agent unix:PATH``), which is the same code."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import CreateContext, User
from dsec.backends.microvm import channel as channel_mod
from dsec.backends.microvm import forks as forks_mod
from dsec.backends.microvm import host, kit, qemu, vsock
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.channel import AgentChannel
from dsec.backends.microvm.handle import MicroVmHandle, RecordedVm
from dsec.backends.microvm.kit import GuestKit
from dsec.backends.microvm.vsock import Cids, VsockAddr
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import ContainerSpec
from tests.conftest import DATA_DIR


def config(tmp: Path, **kw: Any) -> qemu.MicroVMConfig:
    base: dict[str, Any] = {
        "kernel": tmp / "vmlinuz",
        "initramfs": tmp / "initrd",
        "agent_socket": tmp / "agent.sock",
        "qmp_socket": tmp / "qmp.sock",
        "serial_log": tmp / "console.log",
        "layers": [],
        "rw_disk": None,
    }
    return qemu.MicroVMConfig(**{**base, **kw})


def append(argv: list[str]) -> str:
    return argv[argv.index("-append") + 1]


# -- QEMU's command line -------------------------------------------------------------------


def test_serial_is_the_virtio_serial_port_and_vsock_a_vhost_device(tmp_path: Path) -> None:
    serial = qemu.microvm_argv(config(tmp_path))
    assert "virtserialport,chardev=agent,name=dsec.agent" in serial
    assert not any("vsock" in a for a in serial)

    micro = qemu.microvm_argv(config(tmp_path, vsock_cid=70000))
    assert micro[micro.index("vhost-vsock-device,guest-cid=70000") - 1] == "-device"
    assert not any("virtserialport" in a or "virtio-serial" in a for a in micro)
    assert "dsec.channel=vsock" in append(micro).split()

    full = qemu.microvm_argv(config(tmp_path, vsock_cid=70001, machine="q35"))
    assert "vhost-vsock-pci,guest-cid=70001" in full  # q35: over PCI
    assert "dsec.channel=vsock" in append(full).split()


def _cloud_kernel() -> Path | None:
    found = sorted((DATA_DIR / "node" / "guest-kit" / "kernel").glob("linux-image-*-cloud-*/boot/vmlinuz-*"))
    return found[-1] if found else None


@pytest.mark.skipif(shutil.which(qemu.QEMU) is None, reason="qemu-system-x86 is not installed")
@pytest.mark.skipif(vsock.VHOST_VSOCK.exists(), reason="this host has vhost-vsock: QEMU would start")
@pytest.mark.parametrize("machine", ["microvm", "q35"])
def test_qemu_takes_the_vsock_device_as_written_and_names_the_missing_host_device(
    tmp_path: Path, machine: str
) -> None:
    kernel = _cloud_kernel()
    if kernel is None:
        pytest.skip("no guest kit kernel in the test data directory")
    c = config(tmp_path, kernel=kernel, machine=machine, vsock_cid=70000, extra=["-S"])
    c.initramfs.write_bytes(b"")
    done = subprocess.run(qemu.microvm_argv(c), capture_output=True, text=True, timeout=30, check=False)
    # Parsed (device and property names right), then stopped at opening /dev/vhost-vsock.
    assert done.returncode != 0
    assert "vhost-vsock: failed to open vhost device" in done.stderr, done.stderr


def test_a_handle_gives_back_its_cid_and_its_agent_address(tmp_path: Path) -> None:
    c = config(tmp_path, vsock_cid=70002)
    vm = {k: str(v) if isinstance(v, Path) else v for k, v in vars(c).items()}
    vm["layers"] = []
    vm = json.loads(json.dumps(vm))  # as the journal keeps it
    assert RecordedVm.model_validate(vm).config().vsock_cid == 70002
    assert host.agent_addr(MicroVmHandle.model_validate({"dir": str(tmp_path), "vm": vm})) == VsockAddr(
        70002, vsock.AGENT_PORT
    )
    assert host.agent_addr(
        MicroVmHandle.model_validate({"dir": str(tmp_path), "vm": {**vm, "vsock_cid": None}})
    ) == (host.socket_dir(tmp_path) / "agent.sock")
    assert host.config_addr(config(tmp_path)) == tmp_path / "agent.sock"


# -- the probe and the choice ----------------------------------------------------------------


def test_the_probe_opens_the_device_once_per_boot_and_caches_the_answer(tmp_path: Path) -> None:
    device = tmp_path / "vhost-vsock"
    assert vsock.vhost_vsock_present(tmp_path / "a", device) is False  # missing
    device.write_bytes(b"")
    assert vsock.vhost_vsock_present(tmp_path / "b", device) is True  # exists and opens
    device.unlink()
    assert vsock.vhost_vsock_present(tmp_path / "b", device) is True  # cached for this boot
    cached = json.loads((tmp_path / "b" / "vsock.json").read_text())
    assert cached["present"] is True and cached["device"] == str(device) and cached["boot_id"]
    cached["boot_id"] = "an earlier boot"
    (tmp_path / "b" / "vsock.json").write_text(json.dumps(cached))
    assert vsock.vhost_vsock_present(tmp_path / "b", device) is False  # probed again


def test_the_setting_and_the_probe_choose_the_channel() -> None:
    assert vsock.choose("auto", True) == "vsock" and vsock.choose("auto", False) == "serial"
    assert vsock.choose("serial", True) == "serial"
    assert vsock.choose("vsock", False) == "vsock"  # creates then fail, naming the device
    with pytest.raises(InvalidRequest, match="auto, vsock or serial"):
        vsock.choose("virtio", True)


# -- CIDs ------------------------------------------------------------------------------------


def test_cids_are_unique_held_by_their_owner_and_survive_a_restart(tmp_path: Path) -> None:
    owners = [tmp_path / f"vm{i}" for i in range(200)]
    for o in owners:
        o.mkdir()
    cids = Cids(tmp_path / "cids", low=3, high=403)  # a narrow range: collisions are certain
    got = [cids.claim(o) for o in owners]
    assert len(set(got)) == 200 and all(3 <= c < 403 for c in got)

    again = Cids(tmp_path / "cids", low=3, high=403)  # an edge restarted: the claims are on disk
    assert again.claimed() == {c: str(o) for c, o in zip(got, owners, strict=True)}
    again.release(got[0], owners[1])  # not its owner: nothing happens
    assert again.owner(got[0]) == str(owners[0])
    again.release(got[0], owners[0])
    assert again.owner(got[0]) is None

    # A claim whose VM directory is gone (removed while no edge ran) is taken over.
    shutil.rmtree(owners[1])
    late = tmp_path / "late"
    late.mkdir()
    narrow = Cids(tmp_path / "cids", low=got[1], high=got[1] + 1)
    assert narrow.claim(late) == got[1] and narrow.owner(got[1]) == str(late)
    with pytest.raises(InfraFailure, match="no free vsock CID"):
        narrow.claim(tmp_path)
    with pytest.raises(ValueError):
        Cids(tmp_path / "cids", low=2, high=10)  # 0-2 are reserved


# -- the backend, with a fake monitor ----------------------------------------------------------


class FakeControl:
    async def stop(self) -> None: ...
    async def cont(self) -> None: ...
    async def save(self, path: Path) -> None:
        path.write_bytes(b"state")

    async def load(self, path: Path) -> None: ...
    async def quit(self) -> None: ...


class FakeVmm:
    """Starts a harmless process of ours in QEMU's place and records each machine."""

    name = "fake"

    def __init__(self) -> None:
        self.configs: list[qemu.MicroVMConfig] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    async def start(self, config: qemu.MicroVMConfig, workdir: Path) -> int:
        self.configs.append(config)
        proc = subprocess.Popen(["sleep", "60"])
        self.procs.append(proc)
        return proc.pid

    @asynccontextmanager
    async def control(self, socket: Path) -> AsyncIterator[FakeControl]:
        yield FakeControl()

    async def detect_accel(self, kit: Any, state_dir: Path) -> qemu.Accel:
        return "tcg"

    def reap(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class FakeChannel:
    closed = suspended = False
    oom_kills = 0

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Where the backend connected its agent channels (no agent answers here)."""
    seen: list[object] = []

    async def connect(addr: object, timeout: float, **kw: Any) -> FakeChannel:
        seen.append(addr)
        return FakeChannel()

    monkeypatch.setattr(AgentChannel, "connect", connect)

    async def refresh(channel: object) -> None: ...

    monkeypatch.setattr(host, "refresh_guest", refresh)
    return seen


@pytest.fixture
def vmm() -> Iterator[FakeVmm]:
    fake = FakeVmm()
    yield fake
    fake.reap()


def make_backend(tmp: Path, vmm: FakeVmm, setting: str, device_present: bool) -> MicroVMBackend:
    device = tmp / "vhost-vsock"
    if device_present:
        device.write_bytes(b"")
    layer = tmp / "layer.erofs"
    layer.write_bytes(b"")
    b = MicroVMBackend(
        tmp / "data",
        accel="tcg",
        layer_file=lambda d: layer,
        use_templates=False,
        vmm=vmm,
        agent_channel=setting,
        vsock_device=device,
        cid_root=tmp / "cids",
    )
    b.kit = GuestKit(tmp / "vmlinuz", tmp / "initrd.img", "6.1.0-test")
    b.state_dir.mkdir(parents=True, exist_ok=True)
    return b


def ctx(tmp: Path, sid: str) -> CreateContext:
    spec = ContainerSpec(image="debian:bookworm", memory_limit_mb=256, cpu_cores_limit=1)
    return CreateContext(
        sandbox_id=sid,
        spec=spec,
        layer_dirs=[],
        user=User("root", 0, 0, "/root"),
        workdir=tmp / "sandboxes" / sid,
        layer_digests=["sha256:" + "a" * 64],
    )


@pytest.mark.parametrize(
    ("setting", "present", "channel"),
    [
        ("auto", True, "vsock"),
        ("auto", False, "serial"),
        ("serial", True, "serial"),
        ("vsock", False, "vsock"),
    ],
)
async def test_the_node_reports_vhost_vsock_and_its_channel(
    tmp_path: Path, vmm: FakeVmm, setting: str, present: bool, channel: str
) -> None:
    b = make_backend(tmp_path, vmm, setting, present)
    await b.detect_channel()
    caps = b.capabilities()
    assert caps["vhost_vsock"] is present and caps["agent_channel"] == channel
    assert (tmp_path / "data" / "vsock.json").exists()  # the node's data dir, beside accel.json


async def test_vsock_vms_get_unique_cids_journaled_reconnected_and_released(
    tmp_path: Path, vmm: FakeVmm, connects: list[object]
) -> None:
    b = make_backend(tmp_path, vmm, "auto", True)
    await b.detect_channel()
    h1 = await b.create(ctx(tmp_path, "sb-one"))
    h2 = await b.create(ctx(tmp_path, "sb-two"))
    cid1, cid2 = h1.recorded().vsock_cid, h2.recorded().vsock_cid
    assert cid1 != cid2 and min(cid1, cid2) >= 3
    assert [c.vsock_cid for c in vmm.configs] == [cid1, cid2]
    argv = qemu.microvm_argv(vmm.configs[0])
    assert f"vhost-vsock-device,guest-cid={cid1}" in argv and "dsec.channel=vsock" in append(argv)
    assert connects == [VsockAddr(cid1), VsockAddr(cid2)]  # the agent at the VM's CID
    journal = json.loads((b.state_dir / "sb-one.json").read_text())
    assert journal["vm"]["vsock_cid"] == cid1
    assert b.cids.owner(cid1) == h1.dir

    # An edge restarted: a new backend reconnects to the CID the handle journaled.
    again = make_backend(tmp_path, vmm, "auto", True)
    await again.detect_channel()
    await again._channel("sb-one", MicroVmHandle.model_validate(journal))
    assert connects[-1] == VsockAddr(cid1)

    # A fork of it: the same device (the saved state has it) at a CID of its own.
    source = await again.fork_source("sb-one", journal)
    try:
        fork = await again.create_fork(ctx(tmp_path, "sb-fork"), source)
        cid3 = fork.recorded().vsock_cid
        assert cid3 not in (cid1, cid2) and vmm.configs[-1].vsock_cid == cid3
        assert connects[-1] == VsockAddr(cid3)
        await again.destroy("sb-fork", fork, Path(fork.dir))
        assert again.cids.owner(cid3) is None
    finally:
        forks_mod.drop(Path(source.dir), None)

    await again.destroy("sb-one", journal, Path(h1.dir))
    await b.destroy("sb-two", h2, Path(h2.dir))
    assert again.cids.claimed() == {}


async def test_serial_vms_have_no_cid(tmp_path: Path, vmm: FakeVmm, connects: list[object]) -> None:
    b = make_backend(tmp_path, vmm, "auto", False)
    await b.detect_channel()
    h = await b.create(ctx(tmp_path, "sb-serial"))
    assert h.recorded().vsock_cid is None and "vsock_cid" not in h.dump()
    assert connects == [Path(h.sockets) / "agent.sock"]
    assert "virtserialport,chardev=agent,name=dsec.agent" in qemu.microvm_argv(vmm.configs[0])
    await b.destroy("sb-serial", h, Path(h.dir))


async def test_forcing_vsock_without_the_device_fails_the_create_naming_it(
    tmp_path: Path, vmm: FakeVmm, connects: list[object]
) -> None:
    b = make_backend(tmp_path, vmm, "vsock", False)
    await b.detect_channel()
    c = ctx(tmp_path, "sb-forced")
    with pytest.raises(InfraFailure, match=f"no usable {tmp_path / 'vhost-vsock'}") as err:
        await b.create(c)
    assert err.value.reason == "vhost_vsock_missing"
    assert vmm.configs == [] and not c.workdir.exists() and b.cids.claimed() == {}


async def test_a_failed_boot_gives_its_cid_back(
    tmp_path: Path, vmm: FakeVmm, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_agent(addr: object, timeout: float, **kw: Any) -> AgentChannel:
        raise TimeoutError

    monkeypatch.setattr(AgentChannel, "connect", no_agent)
    monkeypatch.setattr(host, "tail", lambda path, limit=1500: "")
    b = make_backend(tmp_path, vmm, "auto", True)
    await b.detect_channel()
    with pytest.raises(InfraFailure, match="did not boot"):
        await b.create(ctx(tmp_path, "sb-fail"))
    assert vmm.configs[0].vsock_cid is not None and b.cids.claimed() == {}


# -- the guest side ----------------------------------------------------------------------------


def test_init_starts_the_agent_on_the_hosts_port_and_the_kit_ships_the_vsock_modules() -> None:
    init = (kit.GUEST_DIR / "init").read_text()
    assert f"exec /agent vsock:{vsock.AGENT_PORT} /sysroot" in init
    assert "vsock" in kit.MODULES and "vmw_vsock_virtio_transport" in kit.MODULES
    roots = sorted((DATA_DIR / "node" / "guest-kit" / "kernel").glob("linux-image-*"))
    if not roots:
        pytest.skip("no guest kit kernel in the test data directory")
    for root in roots:  # the cloud and the full kernel both have them as modules
        version = sorted(p.name for p in (root / "lib" / "modules").iterdir())[-1]
        names = {Path(m).name.split(".ko")[0] for m in kit._module_files(root, version)}
        assert {"vsock", "vmw_vsock_virtio_transport", "vmw_vsock_virtio_transport_common"} <= names


async def _run(channel: AgentChannel, argv: list[str], stdin: bytes = b"") -> tuple[int, bytes]:
    proc = await channel.spawn(argv, env={"PATH": host.GUEST_PATH}, cwd="/", uid=0, gid=0)
    assert proc.stdin is not None and proc.stdout is not None
    if stdin:
        proc.stdin.write(stdin)
    proc.stdin.close()
    out = await proc.stdout.read()
    return await proc.wait(), out


async def test_the_agent_greets_each_connection_and_serves_one_after_another(agent: Path) -> None:
    first = await AgentChannel.connect(agent, 10.0)  # booting: waits for READY
    assert first.version.startswith("dsec-agent")
    assert await _run(first, ["sh", "-c", "echo hello"]) == (0, b"hello\n")
    # A session's shell left running when this host goes (an edge restart).
    shell = await first.spawn(["sh"], env={"PATH": host.GUEST_PATH}, cwd="/", uid=0, gid=0)
    await first.close()

    # The next host: READY again (skipped: it waits for its PONG), the old shell forgotten.
    second = await AgentChannel.connect(agent, 10.0, booting=False, forget=True)
    assert second.version == first.version  # told in its PONG: what the agent can do
    assert await _run(second, ["cat"], stdin=b"through stdin") == (0, b"through stdin")
    assert shell.stdin is not None  # (its stdin was closed by the forget: it ends)

    # A host that goes while output is on its way: the agent drops the rest of that frame,
    # accepts the next host and frames stay aligned for it.
    noisy = await second.spawn(
        ["sh", "-c", "head -c 4000000 /dev/zero"], env={"PATH": host.GUEST_PATH}, cwd="/", uid=0, gid=0
    )
    assert noisy.stdout is not None
    await noisy.stdout.read(1000)
    await second.close()
    third = await AgentChannel.connect(agent, 10.0, booting=False)
    assert await _run(third, ["sh", "-c", "echo still framed"]) == (0, b"still framed\n")
    await third.close()


async def test_a_vsock_connect_is_retried_while_the_guest_boots(
    agent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What connecting to a booting guest's CID says (no device yet, reset, timed out) is
    waited out; the stream then is the agent's (here over a unix socket)."""
    errors = [
        OSError(19, "No such device"),
        ConnectionResetError(104, "reset"),
        TimeoutError(110, "timed out"),
    ]
    tried: list[VsockAddr] = []

    async def open_vsock(addr: VsockAddr) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        tried.append(addr)
        if errors:
            raise errors.pop(0)
        return await asyncio.open_unix_connection(str(agent), limit=1 << 22)

    monkeypatch.setattr(channel_mod, "_open_vsock", open_vsock)
    channel = await AgentChannel.connect(VsockAddr(70000), 10.0)
    assert channel.version.startswith("dsec-agent") and tried == [VsockAddr(70000)] * 4
    assert await _run(channel, ["sh", "-c", "echo over it"]) == (0, b"over it\n")
    await channel.close()

    monkeypatch.setattr(channel_mod, "_open_vsock", open_vsock)
    errors.append(PermissionError(1, "not permitted"))  # anything else is not waited out
    with pytest.raises(PermissionError):
        await AgentChannel.connect(VsockAddr(70000), 10.0)
