"""The seam between apiservers and edges: what an apiserver may ask of a node.

:class:`EdgeLink` is exactly what the apiserver uses of an :class:`~dsec.edge.edge.Edge`, all of
it async, so that the same apiserver code drives an edge in its own process
(:class:`LocalEdgeLink`, the embedded ``dsec up``) or one across the network
(:class:`dsec.apiserver.remote_edge.RemoteEdgeLink`, a cluster). Both pass one conformance
suite (``tests/edge/link_conformance.py``), which is what keeps them interchangeable.

A link is small: the node's sandboxes (create, get, list, stop and the node-wide calls), a
file's bytes both ways and a sandbox's TCP port, and every other sandbox operation as data
(:mod:`dsec.protocol.ops`) through two methods, :meth:`EdgeLink.call` and
:meth:`EdgeLink.stream`. The named methods the apiserver calls (``link.stat(sid, path)``...)
are one-line wrappers that build an op, written once here for every link.

Files are not handed out as a :class:`~dsec.executor.files.SandboxFiles` object (a host path
means nothing on another machine): content is streamed in chunks both ways so a large file
never sits in memory.

The link also checks that a sandbox ID belongs to this incarnation of this node. The ID
carries its node's epoch; an ID from before the node's state was reset names a sandbox that
can no longer exist, and saying so (``SandboxNotFound``, reason ``stale_epoch``) is clearer
than a bare "not found". The check lives here rather than in the apiserver alone because only
the edge knows its current epoch for certain: an apiserver's copy may lag a restart.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from dsec.edge.edge import Edge
from dsec.edge.op_handlers import CALLS, STREAMS
from dsec.edge.ports import PortStream, connect_port
from dsec.executor.file_ops import DEFAULT_FILE_MODE, FileOps
from dsec.iam.base import in_subtree
from dsec.protocol.errors import InvalidRequest, NotFoundReason, SandboxNotFound
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.metrics import MetricSample
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
from dsec.protocol.ops import (
    Call,
    Changes,
    CloseProcessStdin,
    Commit,
    ConnectProcess,
    Exec,
    ForkLocal,
    ForkSpec,
    ListDir,
    ListProcesses,
    Metrics,
    Mkdir,
    Move,
    Pause,
    Remove,
    ResizeProcess,
    Resume,
    RunShell,
    Screenshot,
    SendInput,
    SendProcessInput,
    SetDeadline,
    SetNetworkRules,
    SetXattrs,
    SignalProcess,
    StartProcess,
    Stat,
    Stream,
    Trajectory,
    WatchDir,
    Xattrs,
)
from dsec.protocol.processes import ProcessEvent, ProcessInfo, ProcessStart, PtySize, WatchEvent
from dsec.protocol.volumes import VolumeEntry, VolumeOp, WriteOptions

R = TypeVar("R")
E = TypeVar("E")
log = logging.getLogger("dsec.edge.link")
_BULK_CONCURRENCY = 32  # stops in flight per node: each one kills a process tree and unmounts


class FenceRequest(BaseModel):
    """``POST /edge/v1/fence``: refuse creates (an apiserver drains the node) or stop refusing."""

    model_config = ConfigDict(extra="forbid")

    fenced: bool
    reason: str = Field(default="", max_length=500)


@runtime_checkable
class EdgeLink(Protocol):
    """One edge as an apiserver sees it.

    Errors are the DSec error tree on both sides of the wire. Streams (``stream``,
    ``read_stream``) raise errors that happen before any data (unknown sandbox, missing file)
    from their *first* ``anext``, so a caller can still answer with a proper error status;
    closing a stream early (``aclose``) stops the work behind it (an exec's process tree is
    killed) or detaches from it (a kept process runs on), as its op says.

    An implementation subclasses this and provides the members without a body; the named
    operations below come with it.
    """

    @property
    def epoch(self) -> int | None:
        """The node's registration epoch as last seen; ``None`` until the edge was reached."""
        ...

    async def call(self, sandbox_id: str, op: Call[R]) -> R:
        """Run ``op`` on the sandbox; its answer (the type the op names)."""
        ...

    def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        """Run ``op`` on the sandbox; its events as they come."""
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

    async def fence(self, fenced: bool, reason: str = "") -> bool:
        """Make the node refuse every create (``fenced``), for every apiserver, until lifted
        (also across an edge restart: the edge journals it); scale-in fences a node it drains
        (apiserver/scaling.py). Returns whether creates are refused now (a takeover's fence,
        ``Edge.fence``, is not lifted by this)."""
        raise InvalidRequest(f"{type(self).__name__} cannot fence a node")

    async def stop(self, sandbox_id: str) -> SandboxInfo: ...

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        """Stop, pause or resume every sandbox on the node with all ``labels`` whose project is
        ``within`` or below it: one call per node for a whole job, however many match."""
        ...

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        """Extend job ``job``'s leases (projects at or below ``within``) by ``lease_s`` from now;
        returns how many sandboxes they cover on the node, and the new expiry."""
        ...

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]: ...

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        """Run one short stateless call in the node's warm pool ``pool`` (None: the first pool
        that serves the task's language)."""
        ...

    def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The content of a regular file, in chunks of at most :data:`CHUNK` bytes."""
        ...

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        """Write ``path`` from ``chunks``, atomically: all of it, or (on any error, including
        one raised by ``chunks`` itself, which propagates) nothing."""
        ...

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        """A byte stream to TCP ``port`` on the sandbox's loopback (:mod:`dsec.edge.ports`);
        ``Conflict`` (reason ``port_closed``) when nothing listens there."""
        ...

    # -- shared volumes (protocol/volumes.py): kept by the node their ID names ------------------

    async def volume(self, op: VolumeOp) -> Any:
        """Run a volume operation on this node; its answer (``type(op).response``)."""
        raise InvalidRequest(f"{type(self).__name__} keeps no shared volumes")

    async def volume_read(self, volume_id: str, within: str, path: str) -> AsyncGenerator[bytes, None]:
        """A volume's file, in chunks (errors from the first ``anext``, as ``read_stream``)."""
        raise InvalidRequest(f"{type(self).__name__} keeps no shared volumes")
        yield b""  # pragma: no cover  (an async generator, like every implementation)

    async def volume_write(
        self, volume_id: str, within: str, path: str, chunks: AsyncIterable[bytes], opts: WriteOptions
    ) -> VolumeEntry:
        """Write a volume's file from ``chunks``: all of it, or nothing."""
        raise InvalidRequest(f"{type(self).__name__} keeps no shared volumes")

    # -- the operations by name: each builds its op (protocol/ops.py, where they are described) --

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self.call(sandbox_id, Pause())

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.call(sandbox_id, Resume())

    async def set_network_rules(
        self,
        sandbox_id: str,
        rules: NetworkRules,
        egress_headers: dict[str, dict[str, str]] | None = None,
        egress_secrets: dict[str, str] | None = None,
    ) -> SandboxInfo:
        op = SetNetworkRules(
            network_rules=rules, egress_headers=egress_headers, egress_secrets=egress_secrets or {}
        )
        return await self.call(sandbox_id, op)

    async def set_deadline(
        self, sandbox_id: str, timeout_s: float | None, on_timeout: DeadlineAction = "stop"
    ) -> SandboxInfo:
        return await self.call(sandbox_id, SetDeadline(timeout_s=timeout_s, on_timeout=on_timeout))

    async def trajectory(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[TrajectoryEntry]:
        return await self.call(sandbox_id, Trajectory(after=after, limit=limit))

    async def changes(self, sandbox_id: str, under: str = "/") -> list[Change]:
        return await self.call(sandbox_id, Changes(under=under))

    async def metrics(
        self, sandbox_id: str, start: float | None = None, end: float | None = None
    ) -> list[MetricSample]:
        return await self.call(sandbox_id, Metrics(start=start, end=end))

    async def screenshot(self, sandbox_id: str) -> bytes:
        return (await self.call(sandbox_id, Screenshot())).png

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        return await self.call(sandbox_id, ForkLocal(ids=new_ids, labels=labels))

    async def send_input(self, sandbox_id: str, events: list[InputEvent]) -> int:
        return await self.call(sandbox_id, SendInput(events=events))

    async def fork_spec(self, sandbox_id: str, ref: str) -> tuple[ContainerSpec, LayerInfo]:
        forked = await self.call(sandbox_id, ForkSpec(ref=ref))
        return forked.spec, forked.layer

    async def run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult:
        return await self.call(sandbox_id, _as(RunShell, req))

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        return await self.call(sandbox_id, _as(Commit, req))

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
    ) -> AsyncGenerator[ExecEvent, None]:
        op = Exec(
            argv=argv,
            stdin_b64=None if stdin is None else base64.b64encode(stdin).decode(),
            env=env or {},
            cwd=cwd,
            timeout=timeout,
            max_output_bytes=max_output,
            idempotency_key=idempotency_key,
        )
        return self.stream(sandbox_id, op)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self.call(sandbox_id, Stat(path=path))

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self.call(sandbox_id, ListDir(path=path))

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileStat:
        return await self.call(sandbox_id, Mkdir(path=path, parents=parents))

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self.call(sandbox_id, Remove(path=path, recursive=recursive))

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        return await self.call(sandbox_id, Move(source=source, destination=destination))

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, attrs: dict[str, str]) -> None:
        await self.call(sandbox_id, SetXattrs(path=path, prefix=prefix, attrs=attrs))

    async def xattrs(self, sandbox_id: str, path: str, prefix: str) -> dict[str, str]:
        return await self.call(sandbox_id, Xattrs(path=path, prefix=prefix))

    def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        return self.stream(sandbox_id, _as(StartProcess, req))

    def connect_process(self, sandbox_id: str, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        return self.stream(sandbox_id, ConnectProcess(pid=pid))

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return await self.call(sandbox_id, ListProcesses())

    async def send_process_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        await self.call(sandbox_id, SendProcessInput(pid=pid, data=data))

    async def close_process_stdin(self, sandbox_id: str, pid: int) -> None:
        await self.call(sandbox_id, CloseProcessStdin(pid=pid))

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        await self.call(sandbox_id, SignalProcess(pid=pid, signal=signal))

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize) -> None:
        await self.call(sandbox_id, ResizeProcess(pid=pid, rows=size.rows, cols=size.cols))

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool) -> AsyncGenerator[WatchEvent, None]:
        return self.stream(sandbox_id, WatchDir(path=path, recursive=recursive))


Op = TypeVar("Op", RunShell, Commit, StartProcess)


def _as(op: type[Op], req: ShellRequest | CommitRequest | ProcessStart) -> Op:
    """A request model already validated, as its op (no second validation)."""
    return req if isinstance(req, op) else op.model_construct(**dict(req))


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


class LocalEdgeLink(EdgeLink):
    """:class:`EdgeLink` over an :class:`Edge` in this process (``dsec up``, and the edge server).

    An op goes to its handler in :mod:`dsec.edge.op_handlers` once its sandbox ID is checked to
    be this node's. The edge's synchronous members (``get``, ``stats``...) are cheap dictionary
    reads and are called directly; file operations are blocking system calls and run in threads.
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

    async def volume(self, op: VolumeOp) -> Any:
        return await self.edge.volumes.call(op)

    async def volume_read(self, volume_id: str, within: str, path: str) -> AsyncGenerator[bytes, None]:
        async for chunk in self.edge.volumes.read(volume_id, within, path):
            yield chunk

    async def volume_write(
        self, volume_id: str, within: str, path: str, chunks: AsyncIterable[bytes], opts: WriteOptions
    ) -> VolumeEntry:
        return await self.edge.volumes.write(volume_id, within, path, chunks, opts)

    async def close(self) -> None:
        """Nothing to release: the edge's owner closes the edge."""

    async def call(self, sandbox_id: str, op: Call[R]) -> R:
        handler = CALLS.get(type(op))
        if handler is None:
            raise InvalidRequest(f"the edge has no handler for operation {op.kind!r}")
        return cast(R, await handler(self.edge, self._routed(sandbox_id), op))

    async def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        handler = STREAMS.get(type(op))
        if handler is None:
            raise InvalidRequest(f"the edge has no handler for stream {op.kind!r}")
        events = handler(self.edge, self._routed(sandbox_id), op)
        try:
            async for event in events:
                yield event
        finally:
            # An early close must reach the edge: it kills an exec's process tree, detaches
            # from a kept process, removes a watch.
            await events.aclose()

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

    async def fence(self, fenced: bool, reason: str = "") -> bool:
        edge = self.edge
        if fenced and not edge.drain_fence:
            log.info("edge fenced by an apiserver, creates refused: %s", reason)
        elif not fenced and edge.drain_fence:
            log.info("edge unfenced by an apiserver: %s", reason)
        edge.set_drain_fence((reason or "fenced by an apiserver") if fenced else "")
        return bool(edge.fenced or edge.drain_fence)

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        if not labels:
            raise InvalidRequest(f"a bulk {action} needs at least one label")
        ids = [i.id for i in self.edge.list_sandboxes(labels) if in_subtree(i.project, within)]
        gate = asyncio.Semaphore(_BULK_CONCURRENCY)
        acts: dict[str, Callable[[str], Awaitable[SandboxInfo]]]
        pausing = self.edge.pausing
        acts = {"stop": self.edge.stop, "pause": pausing.pause, "resume": pausing.resume}
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

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        return self.edge.pausing.renew_lease(job, lease_s, within)

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        return self.edge.layers_in_use(unmount_idle=unmount_idle)

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        return await self.edge.fncall(task, pool)

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        return await connect_port(self.edge, self._routed(sandbox_id), port)

    # -- file content -------------------------------------------------------------------------

    async def _files(self, sandbox_id: str) -> FileOps:
        return await self.edge.commands.files_ready(self._routed(sandbox_id))

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
