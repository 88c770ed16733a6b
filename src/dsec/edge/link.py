"""The seam between apiservers and edges: what an apiserver may ask of a node.

:class:`EdgeLink` is exactly what the apiserver uses of an :class:`~dsec.edge.edge.Edge`, all of
it async, so that the same apiserver code drives an edge in its own process
(:class:`LocalEdgeLink`, the embedded ``dsec up``) or one across the network
(:class:`dsec.apiserver.remote_edge.RemoteEdgeLink`, a cluster). Both pass one conformance
suite (``tests/edge/link_conformance.py``), which is what keeps them interchangeable.

Files are not handed out as a :class:`~dsec.executor.files.SandboxFiles` object (a host path
means nothing on another machine): they are async methods on the link, content streamed in
chunks both ways so a large file never sits in memory.

The link also checks that a sandbox ID belongs to this incarnation of this node. The ID
carries its node's epoch; an ID from before the node's state was reset names a sandbox that
can no longer exist, and saying so (``SandboxNotFound``, reason ``stale_epoch``) is clearer
than a bare "not found". The check lives here rather than in the apiserver alone because only
the edge knows its current epoch for certain: an apiserver's copy may lag a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from dsec.edge.edge import Edge
from dsec.edge.metrics import MetricSample
from dsec.edge.ports import PortStream, connect_port
from dsec.executor.file_ops import DEFAULT_FILE_MODE, FileOps
from dsec.iam.base import in_subtree
from dsec.protocol.errors import InvalidRequest, NotFoundReason, SandboxNotFound
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    BulkAction,
    BulkResult,
    Change,
    CommandResult,
    CommitRequest,
    ContainerSpec,
    DeadlineAction,
    ExecEvent,
    FileStat,
    InputEvent,
    LayerInfo,
    NetworkRules,
    SandboxInfo,
    ShellRequest,
    TrajectoryEntry,
)
from dsec.protocol.processes import ProcessEvent, ProcessInfo, ProcessStart, PtySize, WatchEvent

_BULK_CONCURRENCY = 32  # stops in flight per node: each one kills a process tree and unmounts


@runtime_checkable
class EdgeLink(Protocol):
    """One edge as an apiserver sees it.

    Errors are the DSec error tree on both sides of the wire. Streams (``exec_stream``,
    ``read_stream``) raise errors that happen before any data (unknown sandbox, missing file)
    from their *first* ``anext``, so a caller can still answer with a proper error status;
    closing a stream early (``aclose``) stops the work behind it (an exec's process tree is
    killed).
    """

    @property
    def epoch(self) -> int | None:
        """The node's registration epoch as last seen; ``None`` until the edge was reached."""
        ...

    async def stats(self) -> dict[str, Any]: ...

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        """Start a sandbox; ``sandbox_id``: the ID the apiserver chose for it (its quota is
        reserved under that ID before the edge is asked), else the edge picks one."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]: ...

    async def sandbox_ids(self) -> list[str]:
        """The IDs of every sandbox running on the node: cheap, for quota reconciliation."""
        ...

    async def stop(self, sandbox_id: str) -> SandboxInfo: ...

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        """Stop, pause or resume every sandbox on the node with all ``labels`` whose project is
        ``within`` or below it: one call per node for a whole job, however many match."""
        ...

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze the sandbox and push its memory out of RAM; any later request resumes it."""
        ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def set_network_rules(self, sandbox_id: str, rules: NetworkRules) -> SandboxInfo:
        """Replace the sandbox's network permissions (in force when this returns)."""
        ...

    async def set_deadline(
        self, sandbox_id: str, timeout_s: float | None, on_timeout: DeadlineAction = "stop"
    ) -> SandboxInfo:
        """Stop or pause the sandbox ``timeout_s`` seconds of running time from now (journaled;
        a resume restarts the count); ``None`` clears the deadline."""
        ...

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        """Extend job ``job``'s leases (projects at or below ``within``) by ``lease_s`` from now;
        returns how many sandboxes they cover on the node, and the new expiry."""
        ...

    async def trajectory(
        self, sandbox_id: str, after: int = 0, limit: int = 1000
    ) -> list[TrajectoryEntry]: ...

    async def changes(self, sandbox_id: str, under: str = "/") -> list[Change]: ...

    async def metrics(
        self, sandbox_id: str, start: float | None = None, end: float | None = None
    ) -> list[MetricSample]:
        """The sandbox's resource samples with ``start <= ts <= end`` (unix seconds, either
        open), oldest first, the last one read now (:mod:`dsec.edge.metrics`)."""
        ...

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The screen of a full VM, as a PNG."""
        ...

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        """Whole copies (memory and processes too) of a VM sandbox on its own node, under
        ``new_ids`` (IDs of this node, chosen and reserved by the apiserver); all or none."""
        ...

    async def send_input(self, sandbox_id: str, events: list[InputEvent]) -> int: ...

    async def fork_spec(self, sandbox_id: str, ref: str) -> tuple[ContainerSpec, LayerInfo]:
        """Pack the sandbox's state as layer ``ref``; the spec of a copy that starts from it."""
        ...

    async def run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult: ...

    def exec_stream(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]: ...

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo: ...

    def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The content of a regular file, in chunks of at most :data:`CHUNK` bytes."""
        ...

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        """Write ``path`` from ``chunks``, atomically: all of it, or (on any error, including
        one raised by ``chunks`` itself, which propagates) nothing."""
        ...

    async def stat(self, sandbox_id: str, path: str) -> FileStat: ...

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]: ...

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileStat: ...

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None: ...

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        """Rename a file or directory inside the sandbox; the moved entry's stat."""
        ...

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, attrs: dict[str, str]) -> None:
        """Make ``attrs`` (names without ``prefix``, a ``user.`` one) a regular file's extended
        attributes of that prefix; others of it are removed."""
        ...

    async def xattrs(self, sandbox_id: str, path: str, prefix: str) -> dict[str, str]: ...

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]: ...

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        """Run one short stateless call in the node's warm pool ``pool`` (None: the first pool
        that serves the task's language)."""
        ...

    # -- the process table and directory watches (protocol/processes.py) ----------------------

    def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        """Start a process the edge keeps: ``start`` (its PID in the sandbox), its output, then
        ``end``. Errors before the start come from the first ``anext``; closing the stream
        early detaches (the process runs on), unlike ``exec_stream``."""
        ...

    def connect_process(self, sandbox_id: str, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        """Attach to a running process: ``start``, its output from now on (no replay), ``end``;
        ``ProcessNotFound`` if it is not running (or was not started by ``start_process``)."""
        ...

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        """The running processes started by ``start_process``."""
        ...

    async def send_process_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        """To its terminal if it has one, else its stdin pipe."""
        ...

    async def close_process_stdin(self, sandbox_id: str, pid: int) -> None:
        """EOF on its stdin (on a terminal: the end-of-file character, ^D)."""
        ...

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        """``signal`` to the process and all its descendants."""
        ...

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize) -> None: ...

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool) -> AsyncGenerator[WatchEvent, None]:
        """``start`` once the watch is in place, then changes below ``path`` (names relative to
        it); closing the stream removes the watch."""
        ...

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        """A byte stream to TCP ``port`` on the sandbox's loopback (:mod:`dsec.edge.ports`);
        ``Conflict`` (reason ``port_closed``) when nothing listens there."""
        ...


def check_routed(node: str, epoch: int, sandbox_id: str) -> SandboxId:
    """Parse ``sandbox_id`` (``InvalidRequest`` if malformed) and check it names this node as
    it is now; a wrongly routed or outdated ID is ``SandboxNotFound``."""
    sid = SandboxId.parse(sandbox_id)
    if sid.node != node:
        raise SandboxNotFound(f"sandbox {sandbox_id} belongs to node {sid.node!r}, not {node!r}")
    if sid.epoch != epoch:
        raise SandboxNotFound(
            f"sandbox {sandbox_id} belonged to an earlier incarnation of node {node!r}"
            f" (epoch {sid.epoch}, now {epoch}): it no longer exists",
            reason=NotFoundReason.stale_epoch,
        )
    return sid


class LocalEdgeLink:
    """:class:`EdgeLink` over an :class:`Edge` in this process (``dsec up``, and the edge server).

    The edge's synchronous members (``get``, ``stats``...) are cheap dictionary reads and are
    called directly; file operations are blocking system calls and run in threads.
    """

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    @property
    def node(self) -> str:
        return self.edge.config.node

    @property
    def epoch(self) -> int:
        return self.edge.epoch

    def _routed(self, sandbox_id: str) -> str:
        check_routed(self.edge.config.node, self.edge.epoch, sandbox_id)
        return sandbox_id

    async def _files(self, sandbox_id: str) -> FileOps:
        return await self.edge.files_ready(self._routed(sandbox_id))

    async def close(self) -> None:
        """Nothing to release: the edge's owner closes the edge."""

    # -- sandboxes ----------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return self.edge.stats()

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        return await self.edge.create(spec, sandbox_id)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self.edge.get(self._routed(sandbox_id))

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return self.edge.list_sandboxes(labels)

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return await self.edge.stop(self._routed(sandbox_id))

    async def sandbox_ids(self) -> list[str]:
        return self.edge.sandbox_ids()

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        if not labels:
            raise InvalidRequest(f"a bulk {action} needs at least one label")
        ids = [i.id for i in self.edge.list_sandboxes(labels) if in_subtree(i.project, within)]
        gate = asyncio.Semaphore(_BULK_CONCURRENCY)
        acts: dict[str, Callable[[str], Awaitable[SandboxInfo]]]
        acts = {"stop": self.edge.stop, "pause": self.edge.pause, "resume": self.edge.resume}
        act = acts[action]

        async def one(sid: str) -> SandboxInfo:
            async with gate:
                return await act(sid)

        result = BulkResult(action=action)
        outcomes = await asyncio.gather(*map(one, ids), return_exceptions=True)
        for sid, outcome in zip(ids, outcomes, strict=True):
            if isinstance(outcome, SandboxInfo):
                result.done.append(outcome)
            elif isinstance(outcome, Exception):
                result.failed[sid] = str(outcome)
            else:
                raise outcome
        return result

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self.edge.pause(self._routed(sandbox_id))

    async def set_network_rules(self, sandbox_id: str, rules: NetworkRules) -> SandboxInfo:
        return await self.edge.set_network_rules(self._routed(sandbox_id), rules)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.edge.resume(self._routed(sandbox_id))

    async def set_deadline(
        self, sandbox_id: str, timeout_s: float | None, on_timeout: DeadlineAction = "stop"
    ) -> SandboxInfo:
        return self.edge.set_deadline(self._routed(sandbox_id), timeout_s, on_timeout)

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        return self.edge.renew_lease(job, lease_s, within)

    async def trajectory(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[TrajectoryEntry]:
        return self.edge.trajectory(self._routed(sandbox_id), after, limit)

    async def changes(self, sandbox_id: str, under: str = "/") -> list[Change]:
        return await self.edge.changes(self._routed(sandbox_id), under)

    async def metrics(
        self, sandbox_id: str, start: float | None = None, end: float | None = None
    ) -> list[MetricSample]:
        self.edge.get(self._routed(sandbox_id))  # SandboxNotFound for one the edge never had
        return self.edge.metrics.query(sandbox_id, start, end)

    async def screenshot(self, sandbox_id: str) -> bytes:
        return await self.edge.screenshot(self._routed(sandbox_id))

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        return await self.edge.fork_local(self._routed(sandbox_id), new_ids, labels)

    async def send_input(self, sandbox_id: str, events: list[InputEvent]) -> int:
        return await self.edge.send_input(self._routed(sandbox_id), events)

    async def fork_spec(self, sandbox_id: str, ref: str) -> tuple[ContainerSpec, LayerInfo]:
        return await self.edge.fork_spec(self._routed(sandbox_id), ref)

    async def run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult:
        return await self.edge.run_shell(self._routed(sandbox_id), req)

    async def exec_stream(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        events = self.edge.exec_stream(
            self._routed(sandbox_id),
            argv,
            stdin=stdin,
            env=env or {},
            cwd=cwd,
            timeout=timeout,
            max_output=max_output,
            idempotency_key=idempotency_key,
        )
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # an early close must reach the edge: it kills the process tree

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        return await self.edge.commit(self._routed(sandbox_id), req)

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        return self.edge.layers_in_use(unmount_idle=unmount_idle)

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        return await self.edge.fncall(task, pool)

    # -- files --------------------------------------------------------------------------------

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        files = await self._files(sandbox_id)
        chunks = files.read_stream(path)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        files = await self._files(sandbox_id)

        async def write() -> dict[str, Any]:
            return (await files.write_stream(path, chunks, mode)).model_dump()

        request = {"path": path, "mode": oct(mode)}
        recorded = await self.edge.recorder.call(sandbox_id, "write", None, request, write)
        return FileStat.model_validate(recorded)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        return await (await self._files(sandbox_id)).stat(path)

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, attrs: dict[str, str]) -> None:
        await (await self._files(sandbox_id)).set_xattrs(path, prefix, attrs)

    async def xattrs(self, sandbox_id: str, path: str, prefix: str) -> dict[str, str]:
        return await (await self._files(sandbox_id)).xattrs(path, prefix)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await (await self._files(sandbox_id)).list_dir(path)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileStat:
        files = await self._files(sandbox_id)

        async def make() -> dict[str, Any]:
            return (await files.mkdir(path, parents)).model_dump()

        recorded = await self.edge.recorder.call(
            sandbox_id, "mkdir", None, {"path": path, "parents": parents}, make
        )
        return FileStat.model_validate(recorded)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        files = await self._files(sandbox_id)

        async def rm() -> dict[str, Any]:
            await files.remove(path, recursive)
            return {"removed": True}

        await self.edge.recorder.call(sandbox_id, "remove", None, {"path": path, "recursive": recursive}, rm)

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        files = await self._files(sandbox_id)

        async def mv() -> dict[str, Any]:
            return (await files.move(source, destination)).model_dump()

        request = {"source": source, "destination": destination}
        return FileStat.model_validate(await self.edge.recorder.call(sandbox_id, "move", None, request, mv))

    # -- the process table and directory watches -----------------------------------------------

    async def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        events = self.edge.start_process(self._routed(sandbox_id), req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # detaches: the process runs on

    async def connect_process(self, sandbox_id: str, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        events = self.edge.connect_process(self._routed(sandbox_id), pid)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return self.edge.list_processes(self._routed(sandbox_id))

    async def send_process_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        await self.edge.send_process_input(self._routed(sandbox_id), pid, data)

    async def close_process_stdin(self, sandbox_id: str, pid: int) -> None:
        await self.edge.close_process_stdin(self._routed(sandbox_id), pid)

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        await self.edge.signal_process(self._routed(sandbox_id), pid, signal)

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize) -> None:
        await self.edge.resize_process(self._routed(sandbox_id), pid, size)

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        return await connect_port(self.edge, self._routed(sandbox_id), port)

    async def watch_dir(
        self, sandbox_id: str, path: str, recursive: bool
    ) -> AsyncGenerator[WatchEvent, None]:
        events = self.edge.watch_dir(self._routed(sandbox_id), path, recursive)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # removes the watch
