"""Pause and resume on the real runtime: memory leaves RAM, requests resume transparently,
paused sandboxes survive an edge restart, idle pausing, job leases and bulk calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.backends.container import cgroups
from dsec.density.swap import active_swaps
from dsec.node.embedded import EmbeddedNode
from tests import leaks
from tests.conftest import Sandboxes, node_config
from tests.support import RestartedNode, eventually

MiB = 1 << 20
# A process that holds ~200 MiB of incompressible memory until killed: sort keeps all it read
# in its buffer while it waits for its input to end.
HOG = "{ head -c 192M /dev/urandom; sleep 100000; } | sort -S 400M > /dev/null & echo $!"


def charged(sandbox_id: str) -> int:
    return int((cgroups.memory_dir(sandbox_id) / "memory.usage_in_bytes").read_text())


async def hog(sb: object) -> int:
    from dsec.sdk.client import Sandbox

    assert isinstance(sb, Sandbox)
    pid = int((await sb.run_shell(HOG)).stdout)
    await eventually(lambda: charged(sb.id) >= 180 * MiB, "the hog to fill its memory")
    return pid


async def test_pause_pushes_memory_out_and_a_command_resumes_it(make_sandbox: Sandboxes) -> None:
    assert active_swaps(), "the session node turns on a swap file"
    sb = await make_sandbox(memory_limit_mb=512)
    pid = await hog(sb)
    resident = charged(sb.id)
    info = await sb.pause()
    assert info.state is SandboxState.paused and info.pause_reason == "requested"
    assert charged(sb.id) < resident // 10, "at least 90% of its memory left RAM"
    state = (cgroups.sandbox_dir("freezer", sb.id) / "freezer.state").read_text().strip()
    assert state == "FROZEN"
    # Any request resumes it first; the process and its memory are intact.
    r = await sb.run_shell(f"kill -0 {pid} && echo alive")
    assert r.stdout == "alive\n"
    assert (await sb.refresh()).state is SandboxState.running
    assert charged(sb.id) >= resident * 8 // 10, "prefetch brought the pages back"


async def test_file_calls_resume_a_paused_sandbox(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    await sb.write_file("/root/note", "kept")
    await sb.pause()
    assert await sb.read_file("/root/note") == b"kept"
    assert (await sb.refresh()).state is SandboxState.running
    await sb.pause()
    await sb.pause()  # pausing twice is not an error
    assert "note" in [s.name for s in await sb.list_dir("/root")]
    assert (await sb.refresh()).state is SandboxState.running


async def test_a_paused_sandbox_can_be_stopped(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    before = leaks.snapshot(node.config.data_dir)
    sb = await make_sandbox()
    await sb.run_shell("sleep 1000 &")
    await sb.pause()
    assert (await sb.stop()).state is SandboxState.stopped
    assert leaks.snapshot(node.config.data_dir) == before


async def test_idle_sandbox_pauses_itself_then_idle_ttl_reclaims_it(
    client: DSecClient, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(pause_after_idle_s=0.5, ttl_running_stop=3)

    async def paused() -> bool:
        info = await client.get(sb.id)
        return info.info.state is SandboxState.paused and info.info.pause_reason == "idle"

    # client.get reads the state without counting as activity, so the sandbox stays idle.
    await eventually(paused, "the idle sandbox to pause itself")

    async def stopped() -> bool:
        return (await client.get(sb.id)).info.state is SandboxState.stopped

    await eventually(stopped, "the idle TTL to reclaim the paused sandbox")
    assert (await client.get(sb.id)).info.stop_reason == "idle_ttl"


async def test_lapsed_lease_pauses_the_job_renewal_keeps_it_and_grace_ends_it(
    client: DSecClient, make_sandbox: Sandboxes
) -> None:
    job = {"job": "lease-test"}
    a = await make_sandbox(labels=job, lease_s=1, lease_grace_s=2)
    b = await make_sandbox(labels=job, lease_s=1, lease_grace_s=2)
    other = await make_sandbox(labels={"job": "someone-else"})

    async def state(sid: str) -> tuple[SandboxState, str | None]:
        info = (await client.get(sid)).info
        return info.state, info.pause_reason or info.stop_reason

    async def both(want: SandboxState) -> bool:
        return [(await state(s.id))[0] for s in (a, b)] == [want, want]

    await eventually(lambda: both(SandboxState.paused), "the lapsed lease to pause the job")
    assert await state(a.id) == (SandboxState.paused, "lease_lapsed")
    assert (await state(other.id))[0] is SandboxState.running
    # A new trainer renews (one call for the job) and carries on where the old one stopped.
    renewed = await client.renew_lease("lease-test", 30)
    assert renewed.sandboxes == 2 and not renewed.unreachable_nodes
    mine = await client.list(labels=job)
    assert sorted(s.id for s in mine) == sorted([a.id, b.id])
    assert (await mine[0].run_shell("echo back")).stdout == "back\n"
    # Let it lapse for good: paused first, reclaimed after the grace period.
    await client.renew_lease("lease-test", 0.5)
    await eventually(lambda: both(SandboxState.stopped), "the grace period to end the job", 30)
    assert (await state(a.id)) == (SandboxState.stopped, "lease_expired")
    assert (await state(other.id))[0] is SandboxState.running


async def test_bulk_pause_and_resume_a_job(client: DSecClient, make_sandbox: Sandboxes) -> None:
    job = {"job": "bulk-pause"}
    boxes = [await make_sandbox(labels=job) for _ in range(3)]
    paused = await client.pause_all(job)
    assert sorted(i.id for i in paused) == sorted(b.id for b in boxes)
    assert all(i.state is SandboxState.paused for i in paused)
    resumed = await client.resume_all(job)
    assert all(i.state is SandboxState.running for i in resumed) and len(resumed) == 3
    await client.pause_all(job)
    stopped = await client.stop_all(job)  # paused sandboxes stop like running ones
    assert all(i.state is SandboxState.stopped for i in stopped) and len(stopped) == 3


async def test_paused_sandbox_stays_paused_across_an_edge_restart(base_layer: str, tmp_path: Path) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    async with RestartedNode(cfg) as nodes:
        async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
            sb = await c.run_container(DSecContainerRunArgs(container_image=base_layer))
            await sb.run_shell("x=42; echo started > /root/mark")
            await sb.pause()
        second = await nodes.restart()
        async with DSecClient(second.url, second.api_key) as c:
            again = await c.get(sb.id)
            assert again.info.state is SandboxState.paused
            freezer = cgroups.sandbox_dir("freezer", sb.id) / "freezer.state"
            assert freezer.read_text().strip() == "FROZEN"
            # The shell session's state died with the old edge's pipes; the sandbox did not.
            assert (await again.run_shell("cat /root/mark")).stdout == "started\n"
            assert (await again.refresh()).state is SandboxState.running
            await again.stop()
    assert leaks.snapshot(cfg.data_dir)["cgroups"] == []


async def test_concurrent_requests_to_a_paused_sandbox_resume_it_once(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    await sb.pause()
    results = await asyncio.gather(*(sb.run_shell(f"echo {i}", session=f"s{i}") for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    kinds = [e.kind for e in await sb.trajectory()]
    assert kinds.count("shell") == 8
