"""Edge restarts: the journal is the truth. Running sandboxes are re-adopted, dead ones are
marked failed, half-created ones cleaned up, and sandboxes nobody has a record of destroyed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.backends.base import CreateContext, User
from dsec.backends.fake import FakeBackend
from dsec.edge.journal import Journal, Lease, Record
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
    os.kill(record.handle.pid, signal.SIGKILL)
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
        os.kill(record.handle.pid, signal.SIGKILL)

        async def not_running() -> bool:
            return (await client.get(sandbox.id)).info.state is not SandboxState.running

        await eventually(not_running, "the edge to notice the dead sandbox")


# -- the journal file itself: schema upgrades, leases, forgetting ----------------------------------

ROOT_USER = dataclasses.asdict(User("root", 0, 0, "/"))
# The sandboxes table as the first release wrote it: no pause columns, no leases table.
OLD_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    backend TEXT NOT NULL,
    spec TEXT NOT NULL,
    layers TEXT NOT NULL,
    user TEXT NOT NULL,
    handle TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    stop_reason TEXT
);
CREATE INDEX sandboxes_state ON sandboxes(state);
"""


def _sid(epoch: int = 1) -> str:
    return str(SandboxId.new("n", epoch))


def _record(state: SandboxState, last_active_at: float | None = None, sid: str | None = None) -> Record:
    rec = Record(
        sid or _sid(), state, "container", ContainerSpec(image=TINY), ["sha256:" + "a" * 64], ROOT_USER
    )
    if last_active_at is not None:
        rec.last_active_at = last_active_at
    return rec


def test_a_journal_from_before_pausing_opens_keeps_its_sandboxes_and_stores_pauses(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    sid = _sid()
    spec = ContainerSpec(image=TINY, labels={"job": "j"}, memory_limit_mb=256)
    old = sqlite3.connect(path)
    old.executescript(OLD_SCHEMA)
    old.execute("INSERT INTO meta VALUES('epoch', '1')")
    old.execute(
        "INSERT INTO sandboxes VALUES(?,?,?,?,?,?,?,?,?,?)",
        (
            sid,
            "running",
            "container",
            spec.model_dump_json(),
            json.dumps(["sha256:" + "b" * 64]),
            json.dumps(ROOT_USER),
            json.dumps({"pid": 4242}),
            1000.0,
            2000.0,
            None,
        ),
    )
    old.commit()
    old.close()

    journal = Journal(path)
    try:
        assert journal.meta("epoch") == "1"
        [rec] = journal.live()
        assert (rec.id, rec.state, rec.spec, rec.handle.dump()) == (
            sid,
            SandboxState.running,
            spec,
            {"pid": 4242},
        )
        assert (rec.layers, rec.user, rec.created_at, rec.last_active_at) == (
            ["sha256:" + "b" * 64],
            ROOT_USER,
            1000.0,
            2000.0,
        )
        assert (rec.paused_at, rec.pause_reason) == (None, None)
        rec.state, rec.paused_at, rec.pause_reason = SandboxState.paused, 3000.0, "lease_lapsed"
        journal.update(rec)
        journal.put_lease(Lease("root", "j", 4000.0, 60.0))
    finally:
        journal.close()

    again = Journal(path)  # upgraded once: opening it again must not add the columns twice
    try:
        rec2 = again.get(sid)
        assert rec2 is not None
        assert (rec2.state, rec2.paused_at, rec2.pause_reason) == (
            SandboxState.paused,
            3000.0,
            "lease_lapsed",
        )
        assert [r.id for r in again.live()] == [sid], "a paused sandbox is still the node's"
        assert again.leases() == [Lease("root", "j", 4000.0, 60.0)]
        fresh = _record(SandboxState.running)
        again.insert(fresh)  # new rows use every column
        got = again.get(fresh.id)
        assert got is not None and got.paused_at is None
    finally:
        again.close()


def test_leases_round_trip_and_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    try:
        assert journal.leases() == []
        journal.put_lease(Lease("root/a", "j", 100.0, 30.0))
        journal.put_lease(Lease("root/b", "j", 200.0, 0.0))
        journal.put_lease(Lease("root/a", "k", 300.0, 3600.0))
        journal.put_lease(Lease("root/a", "j", 150.0, 45.0))  # a renewal replaces, never adds
        journal.drop_lease("root/a", "k")
        journal.drop_lease("root/a", "nothing")  # dropping what is not there is fine
    finally:
        journal.close()
    again = Journal(path)
    try:
        by_key = {(lease.project, lease.job): lease for lease in again.leases()}
        assert by_key == {
            ("root/a", "j"): Lease("root/a", "j", 150.0, 45.0),
            ("root/b", "j"): Lease("root/b", "j", 200.0, 0.0),
        }
    finally:
        again.close()


def test_forget_before_returns_exactly_the_forgotten_ids(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        now = time.time()
        old_stopped = _record(SandboxState.stopped, now - 1000)
        old_failed = _record(SandboxState.failed, now - 500)
        recent_stopped = _record(SandboxState.stopped, now)
        old_running = _record(SandboxState.running, now - 1000)
        old_paused = _record(SandboxState.paused, now - 1000)
        old_creating = _record(SandboxState.creating, now - 1000)
        for rec in (old_stopped, old_failed, recent_stopped, old_running, old_paused, old_creating):
            journal.insert(rec)

        forgotten = journal.forget_before(now - 100)
        assert sorted(forgotten) == sorted([old_stopped.id, old_failed.id])
        assert len(forgotten) == 2
        for rec in (old_stopped, old_failed):
            assert journal.get(rec.id) is None
        for rec in (recent_stopped, old_running, old_paused, old_creating):
            assert journal.get(rec.id) is not None, "live and recent sandboxes are kept"
        assert journal.forget_before(now - 100) == [], "nothing is forgotten twice"
        assert journal.forget_before(now + 1) == [recent_stopped.id]
    finally:
        journal.close()
