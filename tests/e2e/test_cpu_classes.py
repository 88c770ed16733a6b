"""CPU classes: a best-effort sandbox runs under SCHED_IDLE with the minimum CPU shares, so it
takes only what latency-sensitive sandboxes leave; a latency-sensitive one runs as usual."""

from __future__ import annotations

from pathlib import Path

from dsec import DSecClient, DSecMicroVMRunArgs
from dsec.backends.container import cgroups
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes

SCHED_OTHER, SCHED_IDLE = 0, 5


def policies(sandbox_id: str) -> set[int]:
    """The scheduling policy of every process of the sandbox (field 41 of /proc/<pid>/stat)."""
    out = set()
    for pid in (cgroups.sandbox_dir("cpu", sandbox_id) / "cgroup.procs").read_text().split():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        out.add(int(stat.rsplit(")", 1)[1].split()[38]))
    return out


def shares(sandbox_id: str) -> int:
    return int((cgroups.sandbox_dir("cpu", sandbox_id) / "cpu.shares").read_text())


async def test_best_effort_runs_idle_with_minimum_shares(make_sandbox: Sandboxes) -> None:
    be = await make_sandbox(cpu_class="be")
    ls = await make_sandbox()
    for sb in (be, ls):
        await sb.run_shell("sleep 300 >/dev/null 2>&1 &")  # the session shell and a child
        assert (await sb.exec(["true"])).exit_code == 0
    assert shares(be.id) == 2 and shares(ls.id) == 1024
    assert policies(be.id) == {SCHED_IDLE}, "init, sessions and what they start: all idle class"
    assert policies(ls.id) == {SCHED_OTHER}


async def test_a_best_effort_microvm_runs_its_qemu_idle(client: DSecClient, node: EmbeddedNode) -> None:
    vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="debian:bookworm", cpu_class="be"))
    try:
        record = node.edge.journal.get(vm.id)
        assert record is not None
        pid = record.handle.pid
        threads = Path(f"/proc/{pid}/task").iterdir()
        assert {int((t / "stat").read_text().rsplit(")", 1)[1].split()[38]) for t in threads} == {SCHED_IDLE}
        assert (await vm.run_shell("echo up")).stdout == "up\n"
    finally:
        await vm.stop()
