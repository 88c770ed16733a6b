"""Edge restarts: the journal is the truth. Running sandboxes are re-adopted, dead ones are
marked failed, half-created ones cleaned up, and sandboxes nobody has a record of destroyed."""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.backends.base import CreateContext, User
from dsec.backends.fake import FakeBackend
from dsec.edge.journal import Journal, Record
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec
from tests.support import eventually

from .conftest import TINY, Nodes, fake


async def _dead(backend: FakeBackend, sid: str, handle: dict[str, Any]) -> bool:
    return not await backend.alive(sid, handle)


async def test_a_restart_re_adopts_running_sandboxes(nodes: Nodes) -> None:
    node = await nodes.start()
    key = node.api_key
    async with DSecClient(node.url, key) as client:
        sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY, labels={"job": "j"}))
        await sandbox.write_file("/tmp/note.txt", "written before the restart\n")
    epoch, sid = node.edge.epoch, sandbox.id

    await nodes.close(node)  # sandboxes keep running
    node = await nodes.start()

    assert node.edge.epoch == epoch, "IDs handed out before the restart still route"
    assert node.api_key == key, "clients keep their key across restarts"
    async with DSecClient(node.url, key) as client:
        again = await client.get(sid)
        assert again.info.state is SandboxState.running
        assert [s.id for s in await client.list({"job": "j"})] == [sid]
        result = await again.run_shell("cat tmp/note.txt")
        assert (result.exit_code, result.stdout) == (0, "written before the restart\n")
        assert await again.read_file("/tmp/note.txt") == b"written before the restart\n"
        assert await fake(node).leftovers() == [sid]
        assert (await again.stop()).state is SandboxState.stopped
    assert await fake(node).leftovers() == []


async def test_a_sandbox_that_died_while_the_edge_was_down_is_failed(nodes: Nodes) -> None:
    node = await nodes.start()
    async with DSecClient(node.url, node.api_key) as client:
        doomed = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        survivor = await client.run_container(DSecContainerRunArgs(container_image=TINY))
    record = node.edge.journal.get(doomed.id)
    assert record is not None
    backend = fake(node)
    await nodes.close(node)
    os.kill(int(record.handle["pid"]), signal.SIGKILL)
    await eventually(lambda: _dead(backend, doomed.id, record.handle), "the sandbox to die")

    node = await nodes.start(backend=backend)
    async with DSecClient(node.url, node.api_key) as client:
        info = (await client.get(doomed.id)).info
        assert info.state is SandboxState.failed
        assert info.stop_reason == "sandbox died while the edge was down"
        assert [s.id for s in await client.list()] == [survivor.id]
        assert await fake(node).leftovers() == [survivor.id], "the dead sandbox's files are removed"
        await (await client.get(survivor.id)).stop()


async def test_a_create_interrupted_by_a_crash_is_cleaned_up_and_failed(nodes: Nodes) -> None:
    node = await nodes.start()
    data, epoch = node.config.data_dir, node.edge.epoch
    digest = node.store.resolve(TINY).digest
    await nodes.close(node)
    layer_dir = nodes.layer_src  # the fake copies any directory; the node's mounts are gone

    # What the journal and the runtime hold when the edge dies inside backend.create().
    sid = str(SandboxId.new(node.config.node, epoch))
    backend = nodes.backend()
    user = User("root", 0, 0, "/")
    ctx = CreateContext(sid, ContainerSpec(image=TINY), [layer_dir], user, data / "sandboxes" / sid)
    handle = await backend.create(ctx)
    journal = Journal(data / "edge" / "journal.sqlite")
    journal.insert(
        Record(sid, SandboxState.creating, "container", ctx.spec, [digest], dataclasses.asdict(user))
    )
    journal.close()

    node = await nodes.start(backend=backend)
    async with DSecClient(node.url, node.api_key) as client:
        info = (await client.get(sid)).info
        assert info.state is SandboxState.failed
        assert info.stop_reason == "edge restarted during create"
        assert await client.list() == []
    assert not await backend.alive(sid, handle)
    assert await backend.leftovers() == []
    assert not ctx.workdir.exists()


async def test_sandboxes_without_a_journal_record_are_destroyed_at_start(nodes: Nodes) -> None:
    node = await nodes.start()
    data, epoch = node.config.data_dir, node.edge.epoch
    await nodes.close(node)
    layer_dir = nodes.layer_src

    backend = nodes.backend()
    sid = str(SandboxId.new(node.config.node, epoch))
    ctx = CreateContext(
        sid, ContainerSpec(image=TINY), [layer_dir], User("root", 0, 0, "/"), data / "sandboxes" / sid
    )
    handle = await backend.create(ctx)
    assert await backend.leftovers() == [sid]

    await nodes.start(backend=backend)
    assert await backend.leftovers() == []
    assert not await backend.alive(sid, handle)
    assert not ctx.workdir.exists()


async def test_a_sandbox_that_dies_while_the_edge_runs_is_noticed(nodes: Nodes) -> None:
    node = await nodes.start()
    async with DSecClient(node.url, node.api_key) as client:
        sandbox = await client.run_container(DSecContainerRunArgs(container_image=TINY))
        record = node.edge.journal.get(sandbox.id)
        assert record is not None
        os.kill(int(record.handle["pid"]), signal.SIGKILL)

        async def not_running() -> bool:
            return (await client.get(sandbox.id)).info.state is not SandboxState.running

        await eventually(not_running, "the edge to notice the dead sandbox")
