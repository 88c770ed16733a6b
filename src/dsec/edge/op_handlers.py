"""What the edge does for each sandbox operation (:mod:`dsec.protocol.ops`): one table.

:class:`~dsec.edge.link.LocalEdgeLink` looks an op's type up here (after checking the sandbox
ID is routed to this node) and awaits the handler, or iterates it for a stream. A handler is
one line, or a small function where the edge records the request (mkdir, remove, move: the
trajectory shows them). A kind missing here fails ``tests/edge/test_ops_registry.py``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from dsec.edge.edge import Edge
from dsec.executor.file_ops import FileOps
from dsec.protocol.models import CommitRequest, FileStat
from dsec.protocol.ops import (
    Changes,
    CloseProcessStdin,
    Commit,
    ConnectProcess,
    Exec,
    ForkLocal,
    ForkSpec,
    ForkSpecResult,
    Image,
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
    Trajectory,
    WatchDir,
    Xattrs,
)
from dsec.protocol.processes import PtySize

T = TypeVar("T")
CallHandler = Callable[[Edge, str, Any], Awaitable[Any]]
StreamHandler = Callable[[Edge, str, Any], AsyncGenerator[Any, None]]


async def _now(value: T) -> T:
    """An answer the edge has at hand (a dictionary read), as an awaitable like the others."""
    return value


async def _files(edge: Edge, sandbox_id: str, act: Callable[[FileOps], Awaitable[T]]) -> T:
    return await act(await edge.commands.files_ready(sandbox_id))


async def _recorded_stat(
    edge: Edge,
    sid: str,
    kind: str,
    request: dict[str, Any],
    act: Callable[[FileOps], Awaitable[FileStat]],
) -> FileStat:
    files = await edge.commands.files_ready(sid)

    async def run() -> dict[str, Any]:
        return (await act(files)).model_dump()

    return FileStat.model_validate(await edge.recorder.call(sid, kind, None, request, run))


async def _remove(edge: Edge, sandbox_id: str, op: Remove) -> None:
    files = await edge.commands.files_ready(sandbox_id)

    async def rm() -> dict[str, Any]:
        await files.remove(op.path, op.recursive)
        return {"removed": True}

    request = {"path": op.path, "recursive": op.recursive}
    await edge.recorder.call(sandbox_id, "remove", None, request, rm)


async def _metrics(edge: Edge, sandbox_id: str, op: Metrics) -> Any:
    edge.get(sandbox_id)  # SandboxNotFound for one the edge never had
    return edge.metrics.query(sandbox_id, op.start, op.end)


async def _fork_spec(edge: Edge, sandbox_id: str, op: ForkSpec) -> ForkSpecResult:
    spec, layer = await edge.commands.fork_spec(sandbox_id, op.ref)
    return ForkSpecResult(spec=spec, layer=layer)


def _commit_request(op: Commit) -> CommitRequest:
    # The plain request: the edge records it as it is (an op would add its "kind").
    return CommitRequest(ref=op.ref, scrub_defaults=op.scrub_defaults, exclude=op.exclude)


CALLS: dict[type, CallHandler] = {
    Stat: lambda e, s, o: _files(e, s, lambda f: f.stat(o.path)),
    ListDir: lambda e, s, o: _files(e, s, lambda f: f.list_dir(o.path)),
    Xattrs: lambda e, s, o: _files(e, s, lambda f: f.xattrs(o.path, o.prefix)),
    SetXattrs: lambda e, s, o: _files(e, s, lambda f: f.set_xattrs(o.path, o.prefix, o.attrs)),
    Mkdir: lambda e, s, o: _recorded_stat(
        e, s, "mkdir", {"path": o.path, "parents": o.parents}, lambda f: f.mkdir(o.path, o.parents)
    ),
    Move: lambda e, s, o: _recorded_stat(
        e,
        s,
        "move",
        {"source": o.source, "destination": o.destination},
        lambda f: f.move(o.source, o.destination),
    ),
    Remove: _remove,
    Changes: lambda e, s, o: e.commands.changes(s, o.under),
    Pause: lambda e, s, o: e.pausing.pause(s),
    Resume: lambda e, s, o: e.pausing.resume(s),
    SetNetworkRules: lambda e, s, o: e.networking.set_network_rules(
        s, o.network_rules, o.egress_headers, o.egress_secrets
    ),
    SetDeadline: lambda e, s, o: _now(e.reclaimer.set_deadline(s, o.timeout_s, o.on_timeout)),
    Trajectory: lambda e, s, o: _now(e.commands.trajectory(s, o.after, o.limit)),
    Metrics: _metrics,
    Screenshot: lambda e, s, o: _image(e.commands.screenshot(s)),
    ForkLocal: lambda e, s, o: e.fork_local(s, o.ids, o.labels),
    SendInput: lambda e, s, o: e.commands.send_input(s, o.events),
    ForkSpec: _fork_spec,
    RunShell: lambda e, s, o: e.commands.run_shell(s, o),
    Commit: lambda e, s, o: e.commands.commit(s, _commit_request(o)),
    ListProcesses: lambda e, s, o: _now(e.processes.list_processes(s)),
    SendProcessInput: lambda e, s, o: e.processes.send_process_input(s, o.pid, o.data),
    CloseProcessStdin: lambda e, s, o: e.processes.close_process_stdin(s, o.pid),
    SignalProcess: lambda e, s, o: e.processes.signal_process(s, o.pid, o.signal),
    ResizeProcess: lambda e, s, o: e.processes.resize_process(s, o.pid, PtySize(rows=o.rows, cols=o.cols)),
}
"""Each call op's handler: ``(edge, sandbox_id, op) -> awaitable answer``."""

STREAMS: dict[type, StreamHandler] = {
    Exec: lambda e, s, o: e.commands.exec_stream(
        s,
        o.argv,
        stdin=o.stdin_bytes(),
        env=o.env,
        cwd=o.cwd,
        timeout=o.timeout,
        max_output=o.max_output_bytes,
        idempotency_key=o.idempotency_key,
    ),
    StartProcess: lambda e, s, o: e.processes.start_process(s, o),
    ConnectProcess: lambda e, s, o: e.processes.connect_process(s, o.pid),
    WatchDir: lambda e, s, o: e.processes.watch_dir(s, o.path, o.recursive),
}
"""Each stream op's handler: ``(edge, sandbox_id, op) -> async generator of events``."""


async def _image(png: Awaitable[bytes]) -> Image:
    return Image(png=await png)
