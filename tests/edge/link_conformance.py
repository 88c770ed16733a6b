"""The conformance suite of the apiserver-to-edge seam: what the apiserver relies on from a link.

A module subclasses :class:`LinkConformance` as ``Test<Name>Link`` and provides a ``link``
fixture: the :class:`EdgeLink` under test, reaching the edge of the ``edge_env`` fixture
(tests/edge/conftest.py). Failures only a network can have are tested through two more
fixtures, ``links_with_secret`` (a factory: the link as it would be with another cluster secret,
``None`` for none) and ``unreachable_link``; an implementation that cannot fail that way sets
those tests to ``None`` (they do not apply, which is different from skipping them).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from dsec.edge.link import EdgeLink
from dsec.protocol.errors import (
    CapacityExhausted,
    Conflict,
    FileNotFound,
    InfraFailure,
    InvalidRequest,
    LayerNotFound,
    SandboxNotFound,
    Unauthorized,
)
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    PROJECT_LABEL,
    BulkAction,
    CommandResult,
    CommitRequest,
    ContainerSpec,
    ExecEvent,
    FileType,
    Hardware,
    InputEvent,
    SandboxState,
    ShellRequest,
)
from tests.backends.conformance import host_pids_running
from tests.support import eventually
from tests.unit.conftest import TINY

from .conftest import EdgeEnv
from .process_conformance import ProcessConformance
from .volume_conformance import VolumeConformance

# Which test of the suite drives each sandbox operation (dsec.protocol.ops) through a link:
# tests/edge/test_ops_registry.py fails when an operation has none, or names a test not here.
OP_CASES: dict[str, str] = {
    "stat": "test_files_round_trip",
    "list_dir": "test_files_round_trip",
    "mkdir": "test_files_round_trip",
    "remove": "test_files_round_trip",
    "move": "test_move_renames_inside_the_sandbox_and_is_recorded",
    "set_xattrs": "test_xattrs_are_set_replaced_and_kept_to_the_user_namespace",
    "xattrs": "test_xattrs_are_set_replaced_and_kept_to_the_user_namespace",
    "changes": "test_file_names_are_bytes",
    "watch_dir": "test_a_watch_sees_create_write_rename_chmod_remove_in_order",
    "pause": "test_a_paused_sandbox_resumes_on_its_next_request",
    "resume": "test_resuming_a_running_sandbox_changes_nothing",
    "set_network_rules": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "set_deadline": "test_a_deadline_stops_or_pauses_and_a_resume_restarts_it",
    "trajectory": "test_the_trajectory_lists_requests_in_order_and_pages",
    "metrics": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "screenshot": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "fork_local": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "send_input": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "fork_spec": "test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do",
    "run_shell": "test_shell_sessions_keep_their_state",
    "commit": "test_commit_packs_the_sandbox_into_a_layer",
    "exec": "test_exec_streams_with_stdin_env_and_exit",
    "start_process": "test_a_process_reports_its_sandbox_pid_separate_streams_and_exit_code",
    "connect_process": "test_a_detached_process_runs_on_and_a_later_attach_sees_what_follows",
    "list_processes": "test_a_signal_reaches_the_whole_tree_and_list_forgets_the_ended",
    "send_process_input": "test_input_reaches_cat_and_closing_stdin_ends_it",
    "close_process_stdin": "test_input_reaches_cat_and_closing_stdin_ends_it",
    "signal_process": "test_a_signal_reaches_the_whole_tree_and_list_forgets_the_ended",
    "resize_process": "test_a_pty_process_has_a_terminal_of_the_size_asked_and_resizes",
}

SecretLink = Callable[[str | None], Awaitable[EdgeLink]]
BIG = 32 << 20


def spec(**kw: Any) -> ContainerSpec:
    return ContainerSpec(image=TINY, **kw)


async def drain(events: AsyncIterator[ExecEvent]) -> tuple[bytes, bytes, CommandResult]:
    out, err = bytearray(), bytearray()
    result: CommandResult | None = None
    async for event in events:
        assert result is None, "nothing may follow the exit event"
        if event.t == "exit":
            result = event.result
        else:
            assert event.d is not None
            (out if event.t == "out" else err).extend(base64.b64decode(event.d))
    assert result is not None, "an exec stream ends with its exit event"
    return bytes(out), bytes(err), result


async def pattern(total: int, seed: int, digest: Any) -> AsyncIterator[bytes]:
    """``total`` pseudo-random bytes in uneven chunks (hashed into ``digest`` as they go)."""
    rng = random.Random(seed)
    sent = 0
    while sent < total:
        size = min(total - sent, rng.randint(1, 2 << 20))
        chunk = rng.randbytes(size)
        digest.update(chunk)
        sent += size
        yield chunk


async def read_all(link: EdgeLink, sid: str, path: str) -> bytes:
    return b"".join([chunk async for chunk in link.read_stream(sid, path)])


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data


class LinkConformance(ProcessConformance, VolumeConformance):
    # -- identity and stats -------------------------------------------------------------------

    async def test_is_an_edge_link_and_reports_the_edge(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        assert isinstance(link, EdgeLink)
        stats = await link.stats()
        assert stats["node"] == edge_env.edge.config.node
        assert stats["epoch"] == edge_env.edge.epoch
        assert stats["running"] == 0 and stats["backends"] == ["container"]
        assert link.epoch == edge_env.edge.epoch  # known once the edge answered

    # -- lifecycle ----------------------------------------------------------------------------

    async def test_create_get_list_by_labels_and_stop(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        a = await link.create(spec(labels={"job": "j1", "role": "a"}))
        b = await link.create(spec(labels={"job": "j1", "role": "b"}, memory_limit_mb=256))
        c = await link.create(spec(labels={"job": "j2"}))
        assert a.state is SandboxState.running and a.node == edge_env.edge.config.node
        assert a.layers == [edge_env.tiny]
        assert (await link.get(b.id)).memory_limit_mb == 256
        assert (await link.stats())["running"] == 3
        assert {i.id for i in await link.list_sandboxes({"job": "j1"})} == {a.id, b.id}
        assert [i.id for i in await link.list_sandboxes({"job": "j1", "role": "b"})] == [b.id]
        assert await link.list_sandboxes({"job": "none"}) == []
        assert [i.id for i in await link.list_sandboxes()] == [a.id, b.id, c.id]  # oldest first
        assert sorted(await link.sandbox_ids()) == sorted([a.id, b.id, c.id])
        stopped = await link.stop(a.id)
        assert stopped.state is SandboxState.stopped and stopped.stop_reason == "stopped by user"
        assert (await link.stop(a.id)).state is SandboxState.stopped  # twice is not an error
        assert (await link.get(a.id)).state is SandboxState.stopped  # still answerable
        assert {i.id for i in await link.list_sandboxes()} == {b.id, c.id}
        for info in (b, c):
            await link.stop(info.id)
        assert await edge_env.backend.leftovers() == []

    async def test_reserved_labels_set_by_the_apiserver_reach_the_edge(self, link: EdgeLink) -> None:
        # The apiserver writes the project into a dsec.* label, which callers may not set.
        labelled = spec(labels={"job": "j"}).model_copy(update={"labels": {"job": "j", PROJECT_LABEL: "p1"}})
        info = await link.create(labelled)
        assert info.project == "p1" and info.labels == {"job": "j"}
        assert [i.id for i in await link.list_sandboxes({PROJECT_LABEL: "p1"})] == [info.id]
        await link.stop(info.id)

    async def test_a_bulk_stop_takes_the_labels_and_the_project_subtree(self, link: EdgeLink) -> None:
        def made(project: str, **labels: str) -> ContainerSpec:
            s = spec(labels=labels)
            return s.model_copy(update={"labels": {**labels, PROJECT_LABEL: project}})

        mine = [await link.create(made(p, job="j")) for p in ("root/a", "root/a/rollout-1", "root/a")]
        other_job = await link.create(made("root/a", job="k"))
        other_project = await link.create(made("root/ab", job="j"))  # a name prefix, not a sub-project
        result = await link.bulk("stop", {"job": "j"}, "root/a")
        assert sorted(i.id for i in result.done) == sorted(i.id for i in mine)
        assert all(i.state is SandboxState.stopped for i in result.done) and not result.failed
        assert {i.id for i in await link.list_sandboxes()} == {other_job.id, other_project.id}
        assert (await link.bulk("stop", {"job": "j"}, "root/a")).done == []  # again: nothing left
        with pytest.raises(InvalidRequest):
            await link.bulk("stop", {}, "root")  # never "everything" by accident
        for info in (other_job, other_project):
            await link.stop(info.id)

    async def test_a_create_takes_the_id_the_apiserver_chose(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        node, epoch = edge_env.edge.config.node, edge_env.edge.epoch
        chosen = str(SandboxId(node, epoch, SandboxId.new_tag()))
        info = await link.create(spec(), chosen)
        assert info.id == chosen and (await link.get(chosen)).state is SandboxState.running
        with pytest.raises(Conflict):
            await link.create(spec(), chosen)  # an ID names one sandbox, ever
        # An ID for another incarnation or node: the apiserver's view is stale, place it again.
        for other in (
            SandboxId(node, epoch + 1, SandboxId.new_tag()),
            SandboxId("elsewhere", epoch, "a" * 20),
        ):
            with pytest.raises(CapacityExhausted):
                await link.create(spec(), str(other))
        with pytest.raises(InvalidRequest):
            await link.create(spec(), "sb-not-an-id")
        await link.stop(chosen)
        assert [i.id for i in await link.list_sandboxes()] == []

    async def test_the_edge_refuses_hardware_it_does_not_have(self, link: EdgeLink) -> None:
        stats = await link.stats()
        assert stats["hardware"]["labels"] == {"zone": "a"} and stats["hardware"]["memory_mib"] > 0
        fits = await link.create(
            spec(hardware=Hardware(arch=stats["hardware"]["arch"], node_labels={"zone": "a"}))
        )
        for need in (Hardware(gpus=stats["hardware"]["gpus"] + 1), Hardware(node_labels={"zone": "b"})):
            with pytest.raises(CapacityExhausted, match="cannot host"):  # placement then tries elsewhere
                await link.create(spec(hardware=need))
        assert [i.id for i in await link.list_sandboxes()] == [fits.id]
        await link.stop(fits.id)

    async def test_concurrent_creates(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        infos = await asyncio.gather(*(link.create(spec(labels={"n": str(i)})) for i in range(12)))
        assert len({i.id for i in infos}) == 12
        await asyncio.gather(*(link.stop(i.id) for i in infos))
        assert (await link.stats())["running"] == 0

    async def test_layers_in_use(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        info = await link.create(spec())
        assert edge_env.tiny in await link.layers_in_use()
        await link.stop(info.id)
        assert edge_env.tiny in await link.layers_in_use()  # kept mounted for the page cache
        assert edge_env.tiny not in await link.layers_in_use(unmount_idle=True)

    # -- commands -----------------------------------------------------------------------------

    async def test_shell_sessions_keep_their_state(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        r = await link.run_shell(info.id, ShellRequest(command="export X=42; echo set"))
        assert (r.exit_code, r.stdout) == (0, "set\n")
        r = await link.run_shell(info.id, ShellRequest(command='echo "x=$X"; echo oops >&2; exit 3'))
        assert (r.exit_code, r.stdout, r.stderr) == (3, "x=42\n", "oops\n")
        other = await link.run_shell(info.id, ShellRequest(command='echo "x=$X"', session="other"))
        assert other.stdout == "x=\n"
        slow = await link.run_shell(info.id, ShellRequest(command="sleep 5", session="slow", timeout=0.3))
        assert slow.timed_out
        await link.stop(info.id)

    async def test_exec_streams_with_stdin_env_and_exit(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        events = link.exec_stream(
            info.id,
            ["sh", "-c", 'cat; echo "$GREETING" >&2; pwd; exit 7'],
            stdin=b"from stdin\n",
            env={"GREETING": "hi"},
            cwd="/tmp",
            timeout=30,
        )
        out, err, result = await drain(events)
        assert out.startswith(b"from stdin\n") and out.rstrip().endswith(b"/tmp")
        assert err == b"hi\n"
        assert result.exit_code == 7 and not result.timed_out
        # Many NDJSON lines, more than the default output cap, all in order.
        big = link.exec_stream(info.id, ["head", "-c", "3000000", "/dev/zero"], max_output=4 << 20)
        out, _, result = await drain(big)
        assert (len(out), result.exit_code, result.truncated) == (3_000_000, 0, False)
        capped = link.exec_stream(info.id, ["head", "-c", "100000", "/dev/zero"], max_output=1000)
        out, _, result = await drain(capped)
        assert len(out) == 1000 and result.truncated
        timed = link.exec_stream(info.id, ["sleep", "30"], timeout=0.3)
        *_, result = await drain(timed)
        assert result.timed_out
        await link.stop(info.id)

    async def test_closing_an_exec_stream_kills_its_process_tree(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        argv = ["sleep", "7391"]
        events = link.exec_stream(info.id, ["sh", "-c", "echo started; sleep 7391; echo never"])
        first = await anext(events)
        assert first.t == "out" and base64.b64decode(first.d or "") == b"started\n"
        await eventually(lambda: host_pids_running(argv), "the command to run")
        await events.aclose()  # the caller went away
        await eventually(lambda: not host_pids_running(argv), "the process tree to be killed")
        await link.stop(info.id)

    async def test_commit_packs_the_sandbox_into_a_layer(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        info = await link.create(spec())
        await link.write_stream(info.id, "/made.txt", one_chunk(b"committed\n"))
        layer = await link.commit(info.id, CommitRequest(ref="committed:1"))
        assert "committed:1" in layer.names
        again = await link.create(ContainerSpec(image="committed:1"))
        assert await read_all(link, again.id, "/made.txt") == b"committed\n"
        for sid in (info.id, again.id):
            await link.stop(sid)

    async def test_a_fork_spec_network_rules_metrics_and_what_only_full_vms_do(
        self, link: EdgeLink, edge_env: EdgeEnv
    ) -> None:
        labelled = spec().model_copy(update={"labels": {PROJECT_LABEL: "p1"}})
        sid = (await link.create(labelled)).id
        await link.write_stream(sid, "/forked.txt", one_chunk(b"f"))
        copy, layer = await link.fork_spec(sid, "forked:1")
        assert "forked:1" in layer.names and copy.layers == [edge_env.tiny, layer.digest]
        assert copy.labels == {PROJECT_LABEL: "p1"}  # the edge's own record, reserved label kept
        with pytest.raises(InvalidRequest, match="unknown network permission"):
            await link.set_network_rules(sid, {"no-such-permission": True})
        assert all(s.ts > 0 for s in await link.metrics(sid))
        with pytest.raises(SandboxNotFound):
            await link.metrics(str(SandboxId.new(edge_env.edge.config.node, edge_env.edge.epoch)))
        with pytest.raises(InvalidRequest, match="no display"):
            await link.screenshot(sid)
        with pytest.raises(InvalidRequest, match="no display"):
            await link.send_input(sid, [InputEvent(type="text", text="x")])
        new_id = str(SandboxId.new(edge_env.edge.config.node, edge_env.edge.epoch))
        with pytest.raises(InvalidRequest, match="cannot be forked whole"):
            await link.fork_local(sid, [new_id])
        await link.stop(sid)

    # -- files --------------------------------------------------------------------------------

    async def test_files_round_trip(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        sid = info.id
        assert await read_all(link, sid, "/hello.txt") == b"hello from the layer\n"
        stat = await link.write_stream(sid, "/work/deep/a.txt", one_chunk(b"abc"), mode=0o600)
        assert (stat.path, stat.size, stat.type, stat.mode & 0o777) == (
            "/work/deep/a.txt",
            3,
            FileType.file,
            0o600,
        )
        assert await read_all(link, sid, "/work/deep/a.txt") == b"abc"
        empty = await link.write_stream(sid, "/work/empty", one_chunk(b""))
        assert empty.size == 0 and await read_all(link, sid, "/work/empty") == b""
        made = await link.mkdir(sid, "/work/x/y")
        assert made.type is FileType.dir
        with pytest.raises(Conflict):
            await link.mkdir(sid, "/work/x/y", parents=False)
        assert [s.name for s in await link.list_dir(sid, "/work")] == ["deep", "empty", "x"]
        assert (await link.stat(sid, "/work/deep")).type is FileType.dir
        await link.remove(sid, "/work/empty")
        with pytest.raises(InvalidRequest):
            await link.remove(sid, "/work/x")  # not empty, not recursive
        await link.remove(sid, "/work/x", recursive=True)
        assert [s.name for s in await link.list_dir(sid, "/work")] == ["deep"]
        with pytest.raises(FileNotFound):
            await link.stat(sid, "/work/empty")
        with pytest.raises(FileNotFound):  # raised by the first anext, before any data
            await anext(link.read_stream(sid, "/no/such/file"))
        with pytest.raises(InvalidRequest):
            await read_all(link, sid, "/work")  # a directory has no content
        await link.stop(sid)

    async def test_xattrs_are_set_replaced_and_kept_to_the_user_namespace(self, link: EdgeLink) -> None:
        sid = (await link.create(spec())).id
        await link.write_stream(sid, "/work/m.txt", one_chunk(b"m"))
        await link.set_xattrs(sid, "/work/m.txt", "user.e2b.", {"a": "1", "b": "2"})
        await link.set_xattrs(sid, "/work/m.txt", "user.e2b.", {"b": "3"})
        assert await link.xattrs(sid, "/work/m.txt", "user.e2b.") == {"b": "3"}
        with pytest.raises(InvalidRequest):
            await link.set_xattrs(sid, "/work/m.txt", "trusted.", {"a": "1"})
        with pytest.raises(FileNotFound):
            await link.set_xattrs(sid, "/work/none.txt", "user.e2b.", {"a": "1"})
        await link.stop(sid)

    async def test_move_renames_inside_the_sandbox_and_is_recorded(self, link: EdgeLink) -> None:
        sid = (await link.create(spec())).id
        await link.write_stream(sid, "/work/a.txt", one_chunk(b"moved"))
        moved = await link.move(sid, "/work/a.txt", "/work/sub-b.txt")
        assert (moved.path, moved.size) == ("/work/sub-b.txt", 5)
        assert await read_all(link, sid, "/work/sub-b.txt") == b"moved"
        with pytest.raises(FileNotFound):
            await link.stat(sid, "/work/a.txt")
        with pytest.raises(FileNotFound):
            await link.move(sid, "/work/a.txt", "/work/c.txt")
        kinds = [e.kind for e in await link.trajectory(sid)]
        assert "move" in kinds
        await link.stop(sid)

    async def test_file_names_are_bytes(self, link: EdgeLink) -> None:
        """A name that is not UTF-8 (a surrogateescape str) goes and comes back byte for byte,
        in paths, answers, listings, errors and the change list."""
        sid = (await link.create(spec())).id
        odd, moved = "/work/odd-\udcff", "/work/m\udcfe-\u00e9"
        stat = await link.write_stream(sid, odd, one_chunk(b"odd"))
        assert (stat.path, stat.name, stat.size) == (odd, "odd-\udcff", 3)
        assert await read_all(link, sid, odd) == b"odd"
        assert (await link.stat(sid, odd)).path == odd
        assert [s.name for s in await link.list_dir(sid, "/work")] == ["odd-\udcff"]
        assert (await link.move(sid, odd, moved)).path == moved
        with pytest.raises(FileNotFound):
            await link.stat(sid, odd)
        assert [(c.path, c.type) for c in await link.changes(sid, "/work")] == [(moved, FileType.file)]
        await link.remove(sid, moved)
        assert await link.list_dir(sid, "/work") == []
        await link.stop(sid)

    async def test_a_32_mib_file_streams_both_ways_in_constant_memory(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        sent, got = hashlib.sha256(), hashlib.sha256()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            stat = await link.write_stream(info.id, "/big.bin", pattern(BIG, 1, sent))
            received = 0
            async for chunk in link.read_stream(info.id, "/big.bin"):
                received += len(chunk)
                got.update(chunk)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert stat.size == BIG and received == BIG
        assert got.hexdigest() == sent.hexdigest()
        assert peak < 16 << 20, f"peak {peak >> 20} MiB while moving {BIG >> 20} MiB: not streamed"
        await link.stop(info.id)

    async def test_an_upload_whose_source_fails_leaves_nothing(
        self, link: EdgeLink, edge_env: EdgeEnv
    ) -> None:
        info = await link.create(spec())
        await link.mkdir(info.id, "/up")

        async def failing() -> AsyncIterator[bytes]:
            yield b"x" * (1 << 20)
            raise RuntimeError("the caller's source broke")

        with pytest.raises(RuntimeError, match="source broke"):
            await link.write_stream(info.id, "/up/f.bin", failing())

        async def nothing_left() -> bool:
            return await link.list_dir(info.id, "/up") == []  # no target, no temporary file

        await eventually(nothing_left, "the partial upload to be removed")
        await link.stop(info.id)

    # -- typed errors -------------------------------------------------------------------------

    async def test_typed_errors(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        edge = edge_env.edge
        missing = str(SandboxId.new(edge.config.node, edge.epoch))
        calls: list[Callable[[str], Awaitable[object]]] = [
            link.get,
            link.stop,
            lambda s: link.run_shell(s, ShellRequest(command="true")),
            lambda s: anext(link.exec_stream(s, ["true"])),
            lambda s: link.commit(s, CommitRequest(ref="x:1")),
            lambda s: anext(link.read_stream(s, "/hello.txt")),
            lambda s: link.write_stream(s, "/f", one_chunk(b"x" * (4 << 20))),
            lambda s: link.stat(s, "/"),
            lambda s: link.list_dir(s, "/"),
            lambda s: link.mkdir(s, "/d"),
            lambda s: link.remove(s, "/f"),
        ]
        for call in calls:
            with pytest.raises(SandboxNotFound):
                await call(missing)
            with pytest.raises(InvalidRequest, match="malformed sandbox id"):
                await call("nope")
            with pytest.raises(InvalidRequest):
                await call("sb-a/../b")
        with pytest.raises(LayerNotFound, match="nope:1"):
            await link.create(ContainerSpec(image="nope:1"))

    async def test_ids_of_another_node_or_an_earlier_epoch_are_not_found(
        self, link: EdgeLink, edge_env: EdgeEnv
    ) -> None:
        edge = edge_env.edge
        info = await link.create(spec())
        tag = SandboxId.parse(info.id).tag
        with pytest.raises(SandboxNotFound) as stale:
            await link.get(str(SandboxId(edge.config.node, edge.epoch - 1, tag)))
        assert stale.value.reason == "stale_epoch" and "earlier incarnation" in stale.value.message
        with pytest.raises(SandboxNotFound, match="belongs to node 'elsewhere'"):
            await link.run_shell(str(SandboxId("elsewhere", edge.epoch, tag)), ShellRequest(command="true"))
        await link.stop(info.id)

    async def test_a_full_node_says_capacity_exhausted(self, link: EdgeLink, edge_env: EdgeEnv) -> None:
        # Placement catches exactly this class to retry on another node: it must cross the link.
        edge_env.edge.config.max_sandboxes = 0
        with pytest.raises(CapacityExhausted):
            await link.create(spec())

    async def test_a_fenced_node_refuses_creates_for_everyone_until_unfenced(self, link: EdgeLink) -> None:
        # Scale-in's drain: every apiserver's placement reads `fenced` and skips the node.
        assert await link.fence(True, "scale-in drains it") is True
        stats = await link.stats()
        assert stats["fenced"] is True and stats["capacity"] == 0
        with pytest.raises(CapacityExhausted, match="scale-in drains it"):
            await link.create(spec())
        assert await link.fence(False) is False
        assert (await link.stats())["fenced"] is False
        info = await link.create(spec())
        await link.stop(info.id)

    # -- failures only a network has ----------------------------------------------------------

    async def test_a_wrong_or_missing_secret_is_unauthorized(
        self, links_with_secret: SecretLink, edge_env: EdgeEnv
    ) -> None:
        for secret in ("w" * 32, None):
            bad = await links_with_secret(secret)
            with pytest.raises(Unauthorized):
                await bad.stats()
            with pytest.raises(Unauthorized):
                await bad.create(spec())
            with pytest.raises(Unauthorized):
                await anext(bad.exec_stream("sb-x-1-" + "a" * 20, ["true"]))
            assert bad.epoch is None  # a refused caller learns nothing about the node
        assert edge_env.edge.list_sandboxes() == []

    async def test_an_unreachable_edge_is_a_classified_infra_failure(
        self, unreachable_link: EdgeLink
    ) -> None:
        sid = "sb-edge-a-1-" + "a" * 20
        calls: list[Callable[[], Awaitable[object]]] = [
            unreachable_link.stats,
            lambda: unreachable_link.create(spec()),
            lambda: unreachable_link.get(sid),
            unreachable_link.list_sandboxes,
            lambda: anext(unreachable_link.exec_stream(sid, ["true"])),
            lambda: anext(unreachable_link.read_stream(sid, "/x")),
            lambda: unreachable_link.write_stream(sid, "/x", one_chunk(b"x")),
        ]
        for call in calls:
            with pytest.raises(InfraFailure) as info:
                await call()
            assert info.value.reason == "edge_unreachable"
            assert "edge-a" in info.value.message

    # -- pause, resume, bulk, leases, idempotency, trajectory -----------------------------------

    async def test_a_paused_sandbox_resumes_on_its_next_request(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        paused = await link.pause(info.id)
        assert paused.state is SandboxState.paused and paused.pause_reason == "requested"
        assert paused.paused_at is not None
        got = await link.get(info.id)
        assert (got.state, got.paused_at, got.pause_reason) == (
            SandboxState.paused,
            paused.paused_at,
            "requested",
        )
        assert [i.id for i in await link.list_sandboxes()] == [info.id], "a paused sandbox is still listed"
        again = await link.pause(info.id)  # twice is not an error
        assert again.state is SandboxState.paused
        # The caller need not know: a command resumes it first, and answers.
        r = await link.run_shell(info.id, ShellRequest(command="echo awake"))
        assert (r.exit_code, r.stdout) == (0, "awake\n")
        got = await link.get(info.id)
        assert (got.state, got.paused_at, got.pause_reason) == (SandboxState.running, None, None)
        # So does file access.
        await link.pause(info.id)
        assert await read_all(link, info.id, "/hello.txt") == b"hello from the layer\n"
        assert (await link.get(info.id)).state is SandboxState.running
        stopped = await link.stop(info.id)
        assert stopped.state is SandboxState.stopped
        with pytest.raises(SandboxNotFound):
            await link.pause(info.id)

    async def test_resuming_a_running_sandbox_changes_nothing(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        resumed = await link.resume(info.id)
        assert (resumed.state, resumed.paused_at) == (SandboxState.running, None)
        assert "resume" not in [e.kind for e in await link.trajectory(info.id)], "nothing was done"
        await link.pause(info.id)
        assert (await link.resume(info.id)).state is SandboxState.running
        assert (await link.resume(info.id)).state is SandboxState.running
        assert [e.kind for e in await link.trajectory(info.id)] == ["pause", "resume"]
        await link.stop(info.id)

    async def test_a_deadline_stops_or_pauses_and_a_resume_restarts_it(
        self, link: EdgeLink, edge_env: EdgeEnv
    ) -> None:
        doomed, napper = await link.create(spec()), await link.create(spec())
        before = time.time()
        set_ = await link.set_deadline(doomed.id, 0.3)
        assert set_.on_deadline == "stop" and set_.deadline_s == 0.3
        assert set_.deadline_at is not None and before + 0.3 <= set_.deadline_at <= time.time() + 0.3
        assert (await link.get(doomed.id)).deadline_at == set_.deadline_at

        async def stopped() -> bool:
            return (await link.get(doomed.id)).state is SandboxState.stopped

        await eventually(stopped, "the reaper to stop the sandbox at its deadline")
        assert (await link.get(doomed.id)).stop_reason == "deadline"

        await link.set_deadline(napper.id, 0.3, "pause")
        journaled = edge_env.edge.journal.get(napper.id)  # an edge restart reads it from here
        assert journaled is not None and (journaled.deadline_s, journaled.on_deadline) == (0.3, "pause")

        async def paused() -> bool:
            return (await link.get(napper.id)).state is SandboxState.paused

        await eventually(paused, "the reaper to pause the sandbox at its deadline")
        assert (await link.get(napper.id)).pause_reason == "deadline"
        # Paused time does not count; a resume gives the sandbox its timeout again.
        later = await link.set_deadline(napper.id, 3600, "pause")
        assert later.state is SandboxState.paused
        resumed = await link.resume(napper.id)
        assert resumed.state is SandboxState.running and resumed.deadline_at is not None
        assert resumed.deadline_at >= time.time() + 3500
        cleared = await link.set_deadline(napper.id, None)
        assert (cleared.deadline_at, cleared.deadline_s, cleared.on_deadline) == (None, None, None)
        await link.stop(napper.id)
        with pytest.raises(SandboxNotFound):
            await link.set_deadline(napper.id, 10)

    async def test_a_bulk_pause_and_resume_take_the_labels_and_the_project_subtree(
        self, link: EdgeLink
    ) -> None:
        def made(project: str, **labels: str) -> ContainerSpec:
            s = spec(labels=labels)
            return s.model_copy(update={"labels": {**labels, PROJECT_LABEL: project}})

        mine = [await link.create(made(p, job="j")) for p in ("root/a", "root/a/rollout-1", "root/a")]
        other_job = await link.create(made("root/a", job="k"))
        other_project = await link.create(made("root/ab", job="j"))  # a name prefix, not a sub-project
        untouched = {other_job.id, other_project.id}

        paused = await link.bulk("pause", {"job": "j"}, "root/a")
        assert paused.action == "pause" and not paused.failed
        assert sorted(i.id for i in paused.done) == sorted(i.id for i in mine)
        assert all(i.state is SandboxState.paused for i in paused.done)
        for info in await link.list_sandboxes():
            assert info.state is (SandboxState.running if info.id in untouched else SandboxState.paused)
        again = await link.bulk("pause", {"job": "j"}, "root/a")  # already paused: fine
        assert sorted(i.id for i in again.done) == sorted(i.id for i in mine) and not again.failed

        resumed = await link.bulk("resume", {"job": "j"}, "root/a")
        assert resumed.action == "resume" and not resumed.failed
        assert sorted(i.id for i in resumed.done) == sorted(i.id for i in mine)
        assert all(i.state is SandboxState.running for i in resumed.done)
        assert all(i.state is SandboxState.running for i in await link.list_sandboxes())
        assert (await link.bulk("pause", {"job": "none"}, "root")).done == []

        actions: tuple[BulkAction, ...] = ("pause", "resume")
        for action in actions:
            with pytest.raises(InvalidRequest):
                await link.bulk(action, {}, "root")  # never "everything" by accident
        assert all(i.state is SandboxState.running for i in await link.list_sandboxes())
        for info in [*mine, other_job, other_project]:
            await link.stop(info.id)

    async def test_a_keyed_command_runs_once(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        step = "echo x >> tmp/count.txt; wc -l < tmp/count.txt"
        first = await link.run_shell(info.id, ShellRequest(command=step, idempotency_key="step-1"))
        assert (first.exit_code, first.stdout.strip()) == (0, "1")
        repeat = await link.run_shell(info.id, ShellRequest(command=step, idempotency_key="step-1"))
        assert repeat == first, "a repeat gets the recorded result"
        assert await read_all(link, info.id, "/tmp/count.txt") == b"x\n", "and did not run again"
        other = await link.run_shell(info.id, ShellRequest(command=step, idempotency_key="step-2"))
        assert other.stdout.strip() == "2"
        unkeyed = await link.run_shell(info.id, ShellRequest(command=step))
        assert unkeyed.stdout.strip() == "3"

        argv = ["sh", "-c", "echo y >> tmp/exec.txt; wc -l < tmp/exec.txt"]
        out, _, result = await drain(link.exec_stream(info.id, argv, idempotency_key="exec-1"))
        assert (out.strip(), result.exit_code) == (b"1", 0)
        out_again, _, result_again = await drain(link.exec_stream(info.id, argv, idempotency_key="exec-1"))
        assert (out_again, result_again) == (out, result), "a keyed exec replays its events"
        assert await read_all(link, info.id, "/tmp/exec.txt") == b"y\n"
        await link.stop(info.id)

    async def test_the_trajectory_lists_requests_in_order_and_pages(self, link: EdgeLink) -> None:
        info = await link.create(spec())
        sid = info.id
        await link.run_shell(sid, ShellRequest(command="echo one"))
        await link.run_shell(sid, ShellRequest(command="echo two", idempotency_key="k2"))
        await link.run_shell(sid, ShellRequest(command="echo two", idempotency_key="k2"))  # replayed
        await drain(link.exec_stream(sid, ["sh", "-c", "echo three"], idempotency_key="k3"))
        await link.write_stream(sid, "/tmp/t.txt", one_chunk(b"four"))
        await link.remove(sid, "/tmp/t.txt")
        failed = await link.run_shell(sid, ShellRequest(command="exit 5"))
        assert failed.exit_code == 5

        entries = await link.trajectory(sid)
        assert [(e.seq, e.kind, e.key, e.status) for e in entries] == [
            (1, "shell", None, "done"),
            (2, "shell", "k2", "done"),
            (3, "exec", "k3", "done"),
            (4, "write", None, "done"),
            (5, "remove", None, "done"),
            (6, "shell", None, "done"),
        ]
        assert entries[0].request["command"] == "echo one"
        assert entries[0].result is not None and entries[0].result["stdout"] == "one\n"
        assert entries[5].result is not None and entries[5].result["exit_code"] == 5
        assert entries[3].request["path"] == "/tmp/t.txt"
        assert all(e.finished_at is not None and e.finished_at >= e.started_at for e in entries)

        assert [e.seq for e in await link.trajectory(sid, after=2)] == [3, 4, 5, 6]
        assert [e.seq for e in await link.trajectory(sid, after=2, limit=2)] == [3, 4]
        assert await link.trajectory(sid, after=6) == []
        await link.stop(sid)
        assert [e.seq for e in await link.trajectory(sid)] == [1, 2, 3, 4, 5, 6], "kept after a stop"

    async def test_renewing_a_lease_extends_the_jobs_leases_in_the_subtree(self, link: EdgeLink) -> None:
        def leased(project: str, job: str, lease_s: float | None = 60) -> ContainerSpec:
            s = spec(labels={"job": job}, lease_s=lease_s)
            return s.model_copy(update={"labels": {"job": job, PROJECT_LABEL: project}})

        made = [
            await link.create(leased("root/a", "j")),
            await link.create(leased("root/a/rollout-1", "j")),
            await link.create(leased("root/ab", "j")),
            await link.create(leased("root/a", "k")),
            await link.create(leased("root/a", "j", lease_s=None)),  # the job's, but without a lease
        ]
        before = time.time()
        covered, expires_at = await link.renew_lease("j", 120, "root")
        after = time.time()
        assert covered == 3
        assert before + 120 <= expires_at <= after + 120
        assert (await link.renew_lease("j", 120, "root/a"))[0] == 2, "root/ab is not below root/a"
        assert (await link.renew_lease("k", 30, "root"))[0] == 1
        assert (await link.renew_lease("unknown", 120, "root"))[0] == 0
        assert (await link.renew_lease("j", 120, "root/b"))[0] == 0
        for info in made:
            await link.stop(info.id)
        assert (await link.renew_lease("j", 120, "root"))[0] == 0, "a lease covers live sandboxes only"
