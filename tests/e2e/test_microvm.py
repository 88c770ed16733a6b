"""MicroVM sandboxes on the real runtime: QEMU microvm (TCG here), the guest kit's kernel, the
same EROFS layers as containers, and the same SDK calls. Few and patient: each boots a VM."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec import (
    DSecClient,
    DSecContainerRunArgs,
    DSecMicroVMRunArgs,
    FileNotFound,
    SandboxNotFound,
    SandboxState,
    _linux,
)
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.handle import MicroVmHandle
from dsec.backends.microvm.templates import TemplateKey
from dsec.native import spawner
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, node_config
from tests.support import RestartedNode, eventually, mapping_flags

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
]


def qemu_of(node: EmbeddedNode, sandbox_id: str) -> int:
    record = node.edge.journal.get(sandbox_id)
    assert record is not None
    return record.handle.pid


def spans(size: int) -> Callable[[str], bool]:
    """Picks the mapping of ``size`` bytes (a QEMU's guest RAM) from its smaps line."""

    def pick(line: str) -> bool:
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        return end - start == size

    return pick


def running(pid: int) -> bool:
    # A zombie waiting for init to reap it is gone: its memory and files are released.
    return _linux.proc_start_time(pid) is not None


async def test_a_microvm_runs_commands_and_files_through_the_same_sdk(
    client: DSecClient, node: EmbeddedNode
) -> None:
    args = DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=384, cpu_cores_limit=2)
    sb = await client.run_microvm(args)
    pid = qemu_of(node, sb.id)
    assert running(pid)
    # The daemon's parent is the spawner (a child subreaper that reaps it), not the host's init.
    assert (_linux.stat_fields(pid) or ["", "gone"])[1] == str(spawner._spawner._proc.pid)  # type: ignore[union-attr]
    # Its guest RAM is marked for the ksmd the node runs: identical pages of VMs are kept once.
    assert node.edge.ksm.running and mapping_flags(pid, spans(384 << 20)) >= {"mg"}
    workdir = node.config.data_dir / "sandboxes" / sb.id
    try:
        assert sb.info.backend == "microvm" and sb.info.state is SandboxState.running
        r = await sb.run_shell("uname -r; nproc; cd /tmp && x=kept; echo $PWD")
        kernel, cpus, cwd = r.stdout.split()
        assert kernel != os.uname().release, "its own kernel, not the host's"
        assert cpus == "2" and cwd == "/tmp"
        assert (await sb.run_shell("echo $x; pwd")).stdout == "kept\n/tmp\n"  # the session persists
        assert (await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])).model_dump(
            include={"exit_code", "stdout", "stderr"}
        ) == {"exit_code": 3, "stdout": "out\n", "stderr": "err\n"}
        assert (await sb.exec(["cat"], stdin="through stdin")).stdout == "through stdin"
        timed = await sb.run_shell("sleep 30", timeout=1)
        assert timed.timed_out and (await sb.run_shell("echo fresh")).stdout == "fresh\n"

        blob = os.urandom(3 << 20)
        await sb.write_file("/root/blob", blob, mode=0o600)
        assert await sb.read_file("/root/blob") == blob
        got = (await sb.run_shell("sha256sum /root/blob")).stdout.split()[0]
        assert got == hashlib.sha256(blob).hexdigest()
        st = await sb.stat("/root/blob")
        assert st.size == len(blob) and st.mode == 0o600
        await sb.mkdir("/srv/a/b")
        assert [f.name for f in await sb.list_dir("/srv/a")] == ["b"]
        assert (await sb.move("/srv/a/b", "/srv/a/c")).path == "/srv/a/c"  # the agent's RENAME
        assert [f.name for f in await sb.list_dir("/srv/a")] == ["c"]
        with pytest.raises(FileNotFound):
            await sb.move("/srv/a/b", "/srv/a/d")
        await sb.remove("/srv/a", recursive=True)
        assert not [f for f in await sb.list_dir("/srv") if f.name == "a"]
        await sb.run_shell("ln -s /../../../../ /root/escape")
        with pytest.raises(FileNotFound):  # resolved inside the guest's root: no agent there
            await sb.read_file("/root/escape/agent")
        # Its writes, read from its disk on the host: listed, and packed as a layer a container
        # (or another VM) starts from.
        await sb.run_shell("rm /etc/issue; echo vm-made > /srv/made")
        odd = "/srv/odd-\udcff"  # a name that is not UTF-8 (its bytes: surrogateescape)
        await sb.write_file(odd, b"odd")
        assert await sb.read_file(odd) == b"odd"
        listed = await sb.changes()
        changes = {(c.path, c.kind.value) for c in listed}
        assert {("/srv/made", "added"), ("/etc/issue", "deleted"), ("/root/blob", "added")} <= changes
        assert (odd, "added") in changes
        # Link targets are read on the host, from the VM's disk, with nothing run in the guest.
        assert {c.path: c.target for c in listed}["/root/escape"] == "/../../../../"
        layer = await sb.pack_diff("test/vm-pack")
        box = await client.run_container(DSecContainerRunArgs(layers=[*sb.info.layers, layer.digest]))
        try:
            seen = await box.run_shell("cat /srv/made; test -e /etc/issue || echo gone; sha256sum /root/blob")
            assert (
                seen.stdout.startswith("vm-made\ngone\n") and hashlib.sha256(blob).hexdigest() in seen.stdout
            )
        finally:
            await box.stop()
        assert (await sb.run_shell("cat /srv/made")).stdout == "vm-made\n", "the VM carries on after the pack"
    finally:
        await sb.stop()
    assert not running(pid), "no QEMU process left"
    assert not workdir.exists(), "no disk, socket or log left"
    with pytest.raises(SandboxNotFound):
        await sb.run_shell("true")


async def test_microvm_limits_are_the_guests_ram_and_cpus(client: DSecClient, node: EmbeddedNode) -> None:
    sb = await client.run_microvm(DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=192))
    try:
        total_kb = int((await sb.run_shell("awk '/MemTotal/ {print $2}' /proc/meminfo")).stdout)
        assert 120_000 < total_kb <= 192 * 1024
        assert (await sb.run_shell("nproc")).stdout == "1\n"
        argv = Path(f"/proc/{qemu_of(node, sb.id)}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"-m") + 1] == b"192" and argv[argv.index(b"-smp") + 1] == b"1"
        # Past its RAM the guest kernel OOM-kills inside the VM; the result says so, as a
        # container's does, in a session and in an exec alike.
        hog = "a = ['x' * (8 << 20) + str(i) for i in range(64)]"
        killed = await sb.run_shell(f'python3 -c "{hog}"', timeout=120)
        assert killed.oom_killed and killed.exit_code == 137, killed
        assert not (await sb.run_shell("echo fine")).oom_killed
        killed = await sb.exec(["python3", "-c", hog], timeout=120)
        assert killed.oom_killed and killed.exit_code == 137, killed
    finally:
        await sb.stop()


async def test_a_paused_microvm_keeps_its_processes_and_memory(client: DSecClient) -> None:
    sb: Sandbox = await client.run_microvm(DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=256))
    try:
        await sb.run_shell("counter=41")
        pid = (await sb.run_shell("sleep 1000 & echo $!")).stdout.strip()
        assert (await sb.pause()).state is SandboxState.paused
        r = await sb.run_shell(f"echo $((counter + 1)); kill -0 {pid} && echo running")
        assert r.stdout == "42\nrunning\n"
        assert (await sb.refresh()).state is SandboxState.running
    finally:
        await sb.stop()


async def test_concurrent_microvms_are_independent(client: DSecClient) -> None:
    args = DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=256)
    a, b = await asyncio.gather(client.run_microvm(args), client.run_microvm(args))
    try:
        await a.write_file("/root/who", "a")
        await b.write_file("/root/who", "b")
        assert (await a.read_file("/root/who"), await b.read_file("/root/who")) == (b"a", b"b")
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_an_edge_restart_readopts_a_running_microvm(base_layer: str, tmp_path: Path) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    async with RestartedNode(cfg) as nodes:
        async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
            sb = await c.run_microvm(DSecMicroVMRunArgs(container_image=base_layer, memory_limit_mb=256))
            await sb.write_file("/root/state.txt", "kept")
            await sb.run_shell("nohup sleep 1000 >/dev/null 2>&1 &")
            await sb.run_shell("true", session="other")  # a second session shell
        pid = qemu_of(nodes.node, sb.id)
        second = await nodes.restart()  # the VM keeps running meanwhile
        assert running(pid)
        async with DSecClient(second.url, second.api_key) as c:
            again = await c.get(sb.id)
            assert again.info.state is SandboxState.running
            assert await again.read_file("/root/state.txt") == b"kept"
            r = await again.run_shell("cat /proc/[0-9]*/comm | grep -c '^sleep$'")
            assert r.stdout == "1\n"  # the background process survived the edge restart
            # The old edge's session shells ended (stdin closed), as a container's do: only
            # this edge's one shell is left (counted with builtins only: no forked shells).
            count = (
                'n=0; for c in /proc/[0-9]*/comm; do read -r x <"$c" && [ "$x" = bash ] && n=$((n+1));'
                " done; echo $n"
            )

            async def one_shell() -> bool:
                return (await again.run_shell(count)).stdout == "1\n"

            await eventually(one_shell, "the old session shells to end")
            await again.stop()
        assert not running(pid)


async def test_creates_clone_a_template_after_the_first_boot(client: DSecClient, node: EmbeddedNode) -> None:
    backend = next(b for b in node.more_backends if b.name == "microvm")
    # A size no other test uses: its first create boots, and builds the template behind it.
    args = DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=320, disk_mb=2048)
    first = await client.run_microvm(args)
    try:
        assert isinstance(backend, MicroVMBackend) and backend.kit is not None
        key = TemplateKey(backend.kit.key, tuple(first.info.layers), 320, 1, 2048)

        def template_of_this_kind() -> bool:
            return backend.templates.ready(key) is not None

        await eventually(template_of_this_kind, "the template to be built", 180)
        a, b = await asyncio.gather(client.run_microvm(args), client.run_microvm(args))
        try:
            for clone in (a, b):
                record = node.edge.journal.get(clone.id)
                assert record is not None and "template" in record.handle.dump(), "created from the template"
            await a.write_file("/root/who", "a")
            await b.write_file("/root/who", "b")
            assert (await a.read_file("/root/who"), await b.read_file("/root/who")) == (b"a", b"b")
            clock = int((await a.run_shell("date +%s")).stdout)
            assert abs(clock - time.time()) < 120, "the clone's clock was set, not the template's"
            rand = [(await s.run_shell("head -c 16 /dev/urandom | od -An -tx1")).stdout for s in (a, b)]
            assert rand[0] != rand[1], "clones do not share their random state"
            assert (await a.run_shell("echo $((6 * 7))")).stdout == "42\n"
        finally:
            await asyncio.gather(a.stop(), b.stop())
    finally:
        await first.stop()


async def test_pausing_a_microvm_saves_it_to_a_file_and_ends_its_qemu(
    client: DSecClient, node: EmbeddedNode
) -> None:
    sb = await client.run_microvm(DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=256))
    try:
        await sb.run_shell("counter=41; echo data > /root/disk.txt")
        bg = (await sb.run_shell("sleep 1000 & echo $!")).stdout.strip()
        pid = qemu_of(node, sb.id)
        assert (await sb.pause()).state is SandboxState.paused
        assert not running(pid), "the paused VM's QEMU ended: its memory went back to the host"
        record = node.edge.journal.get(sb.id)
        assert record is not None and Path(str(MicroVmHandle.of(record.handle).snapshot)).stat().st_size > 0
        # Any request resumes it from the file, with its processes, memory and disk.
        r = await sb.run_shell(f"echo $((counter + 1)); kill -0 {bg} && echo running; cat /root/disk.txt")
        assert r.stdout == "42\nrunning\ndata\n"
        assert (await sb.refresh()).state is SandboxState.running
        assert running(qemu_of(node, sb.id))
    finally:
        await sb.stop()


async def test_fork_copies_a_running_microvm_whole_and_the_copies_are_independent(
    client: DSecClient, node: EmbeddedNode
) -> None:
    sb = await client.run_microvm(
        DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=256, labels={"job": "vf"})
    )
    copies: list[Sandbox] = []
    try:
        # A process whose state is only in its memory: it keeps rewriting its secret to a file.
        await sb.run_shell(
            "sh -c 'v=secret-$$; while :; do echo $v > /tmp/v; sleep 0.2; done' >/dev/null 2>&1 &"
        )
        await sb.write_file("/root/disk.txt", "before the fork")
        secret = await eventually(lambda: _read_when_there(sb), "the process to write its secret")
        copies = await sb.fork(2)
        assert len({c.id for c in copies} | {sb.id}) == 3
        assert all(c.info.labels == {"job": "vf"} and c.info.backend == "microvm" for c in copies)
        for copy in copies:
            assert await copy.read_file("/root/disk.txt") == b"before the fork"
            await copy.run_shell("rm -f /tmp/v")

            # The copied process is alive in the copy, with the secret from its memory.
            got = await eventually(lambda c=copy: _read_when_there(c), "the copied process to run")
            assert got == secret
        await copies[0].write_file("/root/disk.txt", "changed in copy 0")
        assert await copies[1].read_file("/root/disk.txt") == b"before the fork"
        assert await sb.read_file("/root/disk.txt") == b"before the fork"
    finally:
        for c in copies:
            await c.stop()
        await sb.stop()
    assert not list((node.config.data_dir / "microvm" / "forks").glob("*")), "the fork's files went with it"


async def _read_when_there(sb: Sandbox) -> bytes | None:
    if (await sb.run_shell("test -s /tmp/v")).exit_code != 0:
        return None
    return await sb.read_file("/tmp/v")
