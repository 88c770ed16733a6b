"""Backend handles are typed models that read and write the journal's JSON as the release before
them did: an edge upgraded over running sandboxes re-adopts them from their old handles."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.backends.container.handle import ContainerHandle
from dsec.backends.fake import FakeBackend
from dsec.backends.fake.backend import FakeHandle
from dsec.backends.handle import Handle
from dsec.backends.microvm.handle import MicroVmHandle, RecordedVm
from dsec.backends.vm.handle import VmHandle

from .conftest import TINY, Nodes

# Handles exactly as the previous release journaled them (dicts built by hand, key by key).
CRUN = {"pid": 4242, "start_time": 987654, "cpu_class": "ls"}
CRUN_FULL = {**CRUN, "core_cookie": True, "allow_setuid": True, "disk_limit_mb": 24}
GVISOR = {
    "pid": 4243,
    "start_time": 987655,
    "cpu_class": "be",
    "runtime": "gvisor",
    "gofer_pid": 4250,
    "gofer_start_time": 987656,
}
VM_RECORD = {
    "kernel": "/k/vmlinux",
    "initramfs": "/k/initrd",
    "agent_socket": "/run/dsec-vm/x/agent.sock",
    "qmp_socket": "/run/dsec-vm/x/qmp.sock",
    "serial_log": "/d/console.log",
    "layers": ["/l/a.erofs", "/l/b.erofs"],
    "rw_disk": "/d/rw.img",
    "memory_mb": 512,
    "cpus": 1,
    "accel": "kvm",
    "rw_format": "raw",
    "mem_path": None,
    "mem_shared": False,
    "incoming": False,
    "machine": "microvm",
    "root_disk": None,
    "idle": False,
    "boot_disk": None,
    "tap": None,
    "guest_net": None,
    "vsock_cid": 7,
    "extra": [],
}
MICROVM = {
    "sid": "sb-x",
    "dir": "/d",
    "sockets": "/run/dsec-vm/x",
    "vsock_cid": 7,
    "vm": VM_RECORD,
    "pid": 0,
    "start_time": None,
    "snapshot": "/d/paused.state",
    "template": "t-1",
}


def test_old_container_handles_read_as_typed_models_and_write_back_unchanged() -> None:
    crun = ContainerHandle.of(CRUN)
    assert (crun.pid, crun.start_time, crun.cpu_class, crun.runtime) == (4242, 987654, "ls", None)
    assert not crun.core_cookie and not crun.allow_setuid and crun.disk_limit() is None
    full = ContainerHandle.of(CRUN_FULL)
    assert full.core_cookie and full.allow_setuid and full.disk_limit() == 24
    gvisor = ContainerHandle.of(GVISOR)
    assert (gvisor.runtime, gvisor.gofer_pid, gvisor.gofer_start_time) == ("gvisor", 4250, 987656)
    for old in (CRUN, CRUN_FULL, GVISOR):
        assert ContainerHandle.of(json.loads(json.dumps(old))).dump() == old


def test_old_vm_handles_read_as_typed_models_and_write_back_unchanged() -> None:
    vm = MicroVmHandle.of(MICROVM)
    assert (vm.snapshot, vm.template, vm.cid(), vm.has_tap()) == ("/d/paused.state", "t-1", 7, False)
    config = vm.recorded().config()
    assert (config.accel, config.vsock_cid, config.layers) == (
        "kvm",
        7,
        [Path("/l/a.erofs"), Path("/l/b.erofs")],
    )
    assert MicroVmHandle.of(MICROVM).dump() == MICROVM
    assert RecordedVm.of(config).model_dump(mode="json") == VM_RECORD  # the machine, recorded again
    # A handle from before the record had ``machine`` ... ``vsock_cid``: the config's defaults.
    older = {k: v for k, v in VM_RECORD.items() if k not in ("machine", "root_disk", "idle", "vsock_cid")}
    assert MicroVmHandle.of({**MICROVM, "vm": older}).recorded().config().machine == "microvm"
    full = VmHandle.of({**MICROVM, "base": "b-1", "disk_image": "sha256:" + "c" * 64})
    assert (full.base, full.image_in_use()) == ("b-1", "sha256:" + "c" * 64)
    assert MicroVmHandle.of(MICROVM).image_in_use() is None


def test_a_handle_keeps_keys_it_does_not_know_and_drops_what_a_backend_pops() -> None:
    later = {**CRUN, "from_a_later_release": {"x": 1}}
    assert ContainerHandle.of(Handle.model_validate(later)).dump() == later
    vm = MicroVmHandle.of(MICROVM)
    vm.drop("snapshot")
    vm.resumed = True
    assert vm.snapshot is None
    assert vm.dump() == {**{k: v for k, v in MICROVM.items() if k != "snapshot"}, "resumed": True}


def _journaled_handle(path: Path, sid: str) -> dict[str, Any]:
    db = sqlite3.connect(path)
    try:
        (raw,) = db.execute("SELECT handle FROM sandboxes WHERE id=?", (sid,)).fetchone()
    finally:
        db.close()
    loaded: dict[str, Any] = json.loads(raw)
    return loaded


async def test_an_edge_restarted_over_a_handle_the_previous_release_wrote_re_adopts_it(nodes: Nodes) -> None:
    node = await nodes.start()
    async with DSecClient(node.url, node.api_key) as client:
        sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    record = node.edge.journal.get(sandbox.id)
    assert record is not None and isinstance(record.handle, FakeHandle)
    backend = node.backend
    assert isinstance(backend, FakeBackend)
    journal = node.config.data_dir / "edge" / "journal.sqlite"
    await nodes.close(node)  # the sandbox keeps running

    # The previous release's fake handle, as it wrote it: {root, workdir, pid, start_time}.
    h = record.handle
    old = {"root": h.root, "workdir": h.workdir, "pid": h.pid, "start_time": h.start_time}
    db = sqlite3.connect(journal)
    db.execute("UPDATE sandboxes SET handle=? WHERE id=?", (json.dumps(old), sandbox.id))
    db.commit()
    db.close()

    node = await nodes.start(backend=backend)
    live = node.edge.journal.get(sandbox.id)
    assert live is not None and live.handle == FakeHandle.of(old)
    async with DSecClient(node.url, node.api_key) as client:
        again = await client.get(sandbox.id)
        assert again.info.state is SandboxState.running, "re-adopted"
        result = await again.run_shell("echo still here")
        assert (result.exit_code, result.stdout) == (0, "still here\n")
        assert (await again.stop()).state is SandboxState.stopped
    assert _journaled_handle(journal, sandbox.id) == old, "written back as it was read"
    assert await backend.leftovers() == []
