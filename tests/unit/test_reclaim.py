"""The reaper: idle sandboxes and sandboxes past their lifetime are stopped and released."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxNotFound, SandboxState
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import SandboxStopped
from dsec.sdk.client import Sandbox
from tests.support import eventually

from .conftest import TINY, Nodes, fake


async def stopped(client: DSecClient, sandbox: Sandbox) -> bool:
    # get() is not activity: polling it must not keep the sandbox alive.
    return (await client.get(sandbox.id)).info.state is SandboxState.stopped


async def test_an_idle_sandbox_is_reclaimed_after_its_ttl(client: DSecClient, node: EmbeddedNode) -> None:
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, ttl_running_stop=0.3))
    await eventually(lambda: stopped(client, sandbox), "the idle sandbox to be reclaimed")
    seen_stopped = time.time()  # within one poll (20 ms) of the stop
    info = (await client.get(sandbox.id)).info
    assert info.stop_reason == "idle_ttl"
    assert seen_stopped - info.created_at >= 0.3, "not reclaimed before its TTL"
    assert await client.list() == []
    assert await fake(node).leftovers() == [], "its processes and files are gone"
    with pytest.raises(SandboxNotFound):
        await sandbox.run_shell("true")


async def test_activity_defers_the_idle_ttl(client: DSecClient, node: EmbeddedNode) -> None:
    ttl = 1.0
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, ttl_running_stop=ttl))
    busy_until = time.monotonic() + 2.5 * ttl
    while time.monotonic() < busy_until:  # an agent working in steps well inside its TTL
        result = await sandbox.run_shell("true")
        assert result.exit_code == 0, "reclaimed while in use"
        await asyncio.sleep(ttl / 10)  # pacing the agent's steps, not synchronisation
    assert (await client.get(sandbox.id)).info.state is SandboxState.running
    await eventually(lambda: stopped(client, sandbox), "the sandbox to be reclaimed once idle")
    assert (await client.get(sandbox.id)).info.stop_reason == "idle_ttl"
    assert await fake(node).leftovers() == []


async def test_max_lifetime_reclaims_even_a_busy_sandbox(client: DSecClient, node: EmbeddedNode) -> None:
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, max_lifetime_s=0.5))
    created_at = sandbox.info.created_at

    async def busy_until_stopped() -> bool:
        try:
            await sandbox.run_shell("true")
        except SandboxStopped as exc:  # the reclaim cut a command in flight: said so, not exit 137
            assert exc.reason == "reclaimed", exc
            return True
        except SandboxNotFound:  # or it came between two commands
            return True
        return False

    await eventually(busy_until_stopped, "the lifetime to run out")
    assert time.time() - created_at >= 0.5, "not reclaimed before its lifetime"
    await eventually(lambda: stopped(client, sandbox), "the stop to finish")
    info = (await client.get(sandbox.id)).info
    assert info.stop_reason == "max_lifetime"
    assert await fake(node).leftovers() == []


async def test_sandboxes_without_limits_are_not_reclaimed(client: DSecClient, node: EmbeddedNode) -> None:
    keep = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    brief = await client.run_container(DSecContainerRunArgs(container_image=TINY, ttl_running_stop=0.2))
    await eventually(lambda: stopped(client, brief), "the short-lived sandbox to be reclaimed")
    # Reaper passes ran (they reclaimed `brief`) and left `keep` alone.
    assert (await client.get(keep.id)).info.state is SandboxState.running
    assert (await keep.run_shell("echo still here")).stdout == "still here\n"
    await keep.stop()


async def test_a_command_running_longer_than_the_ttl_is_not_idleness(
    client: DSecClient, node: EmbeddedNode
) -> None:
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, ttl_running_stop=0.3))
    result = await sandbox.run_shell("sleep 1; echo finished")  # > 3 TTLs, no request meanwhile
    assert (result.exit_code, result.stdout) == (0, "finished\n")
    await eventually(lambda: stopped(client, sandbox), "the sandbox to be reclaimed once idle")
    assert (await client.get(sandbox.id)).info.stop_reason == "idle_ttl"


async def test_liveness_is_checked_a_batch_at_a_time_and_every_sandbox_in_turn(
    client: DSecClient, node: EmbeddedNode
) -> None:
    # Each check reads /proc: a full node is swept over several passes, none left out.
    boxes = await client.run_containers(DSecContainerRunArgs(container_image=TINY), 5)
    node.edge.config.liveness_batch = 2
    seen = [node.edge.reclaimer._liveness_batch() for _ in range(3)]
    assert all(len(batch) == 2 for batch in seen)
    assert set().union(*seen) == {sb.id for sb in boxes}


async def test_only_activity_that_changed_is_written_to_the_journal(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await nodes.start(reap_interval_s=3600)  # no reaper pass of its own meanwhile
    async with DSecClient(node.url, node.api_key) as client:
        boxes = await client.run_containers(DSecContainerRunArgs(container_image=TINY), 3)
        written: list[set[str]] = []
        touch_many = node.edge.journal.touch_many
        monkeypatch.setattr(
            node.edge.journal, "touch_many", lambda a: (written.append(set(a)), touch_many(a))
        )
        node.edge.reclaimer.flush_activity()
        node.edge.reclaimer.flush_activity()  # nothing happened in between: nothing to write
        await boxes[1].run_shell("true")
        node.edge.reclaimer.flush_activity()
    assert written == [{sb.id for sb in boxes}, {boxes[1].id}]
    record = node.edge.journal.get(boxes[1].id)
    assert record is not None and record.last_active_at == node.edge._live[boxes[1].id].record.last_active_at


async def test_a_pass_looks_only_at_sandboxes_whose_time_came(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pass over every sandbox each second was an edge's steady CPU at 8,000 held.
    node = await nodes.start(reap_interval_s=3600, liveness_interval_s=3600)
    edge = node.edge
    async with DSecClient(node.url, node.api_key) as client:
        plain = await client.run_containers(DSecContainerRunArgs(container_image=TINY), 4)
        idle = await client.run_container(DSecContainerRunArgs(container_image=TINY, ttl_running_stop=0.2))
        looked: list[str] = []
        look_again = edge._wakeups.look_again
        monkeypatch.setattr(
            edge._wakeups, "look_again", lambda live: (looked.append(live.record.id), look_again(live))
        )
        edge.reclaimer._last_liveness = time.time()
        assert await edge.reclaimer.reap_once() == []  # nothing is due yet: nobody is looked at
        assert looked == []
        await eventually(lambda: time.time() >= edge._live[idle.id].record.last_active_at + 0.2, "its ttl")
        assert await edge.reclaimer.reap_once() == [idle.id]
        assert idle.id not in edge._live and all(sb.id in edge._live for sb in plain)
        assert plain[0].id not in looked


async def test_a_sandbox_pausing_is_not_taken_for_dead(
    client: DSecClient, node: EmbeddedNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A microVM's QEMU ends while it pauses, before its handle names the snapshot: a liveness
    # check in that window saw no process and stopped a sandbox that was being paused.
    sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    backend = fake(node)
    paging, release, checked = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def page_out(sandbox_id: str, handle: dict[str, object]) -> int:
        paging.set()
        await release.wait()
        return 0

    async def alive(sandbox_id: str, handle: dict[str, object]) -> bool:
        if paging.is_set() and not release.is_set():
            checked.set()
            return False
        return True

    monkeypatch.setattr(backend, "page_out", page_out)
    monkeypatch.setattr(backend, "alive", alive)
    node.edge.config.liveness_interval_s = 0
    node.edge.config.liveness_batch = 100
    pausing = asyncio.create_task(sandbox.pause())
    await paging.wait()
    reaping = asyncio.create_task(node.edge.reclaimer.reap_once())
    looked = asyncio.create_task(checked.wait())
    # A pass that left it alone returns at once; one that took it for dead waits on the pause.
    await asyncio.wait({reaping, looked}, return_when=asyncio.FIRST_COMPLETED)
    release.set()
    reaped = await reaping
    looked.cancel()
    assert reaped == [] and not checked.is_set(), reaped
    assert (await pausing).state is SandboxState.paused
    assert (await sandbox.run_shell("echo back")).stdout == "back\n"
