"""Sandbox operations as data: one request model per thing an apiserver asks of a sandbox.

Each operation is a pydantic model with a ``kind`` discriminator and the bounds of its fields,
and names what it answers by the base it derives from: ``Call[FileStat]`` answers one
``FileStat``, ``Stream[ExecEvent]`` a stream of them. That one declaration is what every hop
works from: ``EdgeLink.call`` / ``EdgeLink.stream`` are typed by it (mypy infers the answer
from the op), the local link maps the op's type to the edge's handler, the edge's HTTP server
serves every kind on one route (``POST .../ops/{kind}``, ``POST .../streams/{kind}``) and
the remote link parses any answer with the op's :attr:`~_Op.adapter`.

The set is closed: :data:`OPS` (kind -> model) and the :data:`AnyOp` union list every one,
and a test walks them against each link, server and fake (tests/edge/test_ops_registry.py), so
an operation one of them misses fails at once. Byte streams (a file's content both ways) and a
sandbox's TCP port are not operations: they keep their own routes (their bodies are bytes).

Usage::

    info = await link.call(sandbox_id, Pause())                  # -> SandboxInfo
    async for event in link.stream(sandbox_id, Exec(argv=["true"])):  # -> ExecEvent
        ...
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dsec.protocol.bounds import MAX_PATH_LEN, no_nul
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.files import Change, FileStat, _BytesNames
from dsec.protocol.http import MAX_COUNT, MAX_TRAJECTORY_PAGE
from dsec.protocol.metrics import MAX_UNIX_S, MetricSample
from dsec.protocol.models import (
    CommandResult,
    CommitRequest,
    DeadlineRequest,
    ExecEvent,
    ExecRequest,
    InputRequest,
    LayerInfo,
    LocalForkRequest,
    NetworkRulesRequest,
    SandboxInfo,
    SandboxSpec,
    ShellRequest,
    TrajectoryEntry,
    invalid_request,
)
from dsec.protocol.processes import (
    ProcessEvent,
    ProcessInfo,
    ProcessInput,
    ProcessSignal,
    ProcessStart,
    PtySize,
    WatchEvent,
)

R = TypeVar("R")
E = TypeVar("E")


def _path(value: str) -> str:
    # Checked here, not by Field bounds: pydantic's own str constraints refuse the lone
    # surrogates a name that is not UTF-8 holds (protocol/files.py).
    if not 0 < len(value) <= MAX_PATH_LEN:
        raise ValueError(f"a path of 1 to {MAX_PATH_LEN} characters")
    return no_nul(value)


# A path in the sandbox: as the edge's query parameters took it (required, no NUL, PATH_MAX).
SandboxPath = Annotated[str, AfterValidator(_path)]
Pid = Annotated[int, Field(gt=0, lt=1 << 31)]
XATTR_NAME_MAX = 255  # bytes, Linux's limit on a whole attribute name
XATTR_SIZE_MAX = 65536


class _Op(BaseModel):
    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, ser_json_bytes="base64", val_json_bytes="base64"
    )

    kind: str
    # Set by register() from the Call[...] / Stream[...] base: the answer (or one event's) type.
    response: ClassVar[Any]
    adapter: ClassVar[TypeAdapter[Any]]
    streams: ClassVar[bool] = False
    quick: ClassVar[bool] = False  # answered at once: bounded by the link's control timeout
    creates: ClassVar[bool] = False  # makes sandboxes: never cut (one made unseen would run unknown)
    last: ClassVar[str | None] = None  # a stream's final event type (``t``); None: runs until closed

    def __init__(self, **data: Any) -> None:
        # An op built in code with a bad field is the caller's mistake, as one off the wire is.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise invalid_request(exc) from exc


class Call(_Op, Generic[R]):
    """An operation answered by one ``R`` (``None``: no body)."""


class Stream(_Op, Generic[E]):
    """An operation answered by a stream of ``E``; closing it early stops or detaches (per op)."""

    streams: ClassVar[bool] = True


class _Named(_BytesNames):
    """Paths as :mod:`dsec.protocol.files` carries names: ``path_b64`` when not UTF-8."""

    model_config = ConfigDict(extra="forbid")


class Image(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")
    png: bytes


class ForkSpecResult(BaseModel):
    """A sandbox's state packed as a layer, and the spec of a copy that starts from it."""

    spec: SandboxSpec
    layer: LayerInfo


# -- files ------------------------------------------------------------------------------------


class Stat(_Named, Call[FileStat]):
    names = ("path",)
    kind: Literal["stat"] = "stat"
    path: SandboxPath


class ListDir(_Named, Call[list[FileStat]]):
    names = ("path",)
    kind: Literal["list_dir"] = "list_dir"
    path: SandboxPath


class Mkdir(_Named, Call[FileStat]):
    names = ("path",)
    kind: Literal["mkdir"] = "mkdir"
    path: SandboxPath
    parents: bool = True


class Remove(_Named, Call[None]):
    names = ("path",)
    kind: Literal["remove"] = "remove"
    path: SandboxPath
    recursive: bool = False


class Move(_Named, Call[FileStat]):
    """Rename inside the sandbox; answers the moved entry's stat."""

    names = ("source", "destination")
    kind: Literal["move"] = "move"
    source: SandboxPath
    destination: SandboxPath


class SetXattrs(_Named, Call[None]):
    """Make ``attrs`` (names without ``prefix``, a ``user.`` one) a regular file's extended
    attributes of that prefix; others of it are removed."""

    names = ("path",)
    kind: Literal["set_xattrs"] = "set_xattrs"
    path: SandboxPath
    prefix: str = Field(default="", max_length=XATTR_NAME_MAX)
    attrs: dict[
        Annotated[str, Field(max_length=XATTR_NAME_MAX)], Annotated[str, Field(max_length=XATTR_SIZE_MAX)]
    ] = Field(default_factory=dict, max_length=1024)


class Xattrs(_Named, Call[dict[str, str]]):
    names = ("path",)
    kind: Literal["xattrs"] = "xattrs"
    path: SandboxPath
    prefix: str = Field(default="", max_length=XATTR_NAME_MAX)


class Changes(_Named, Call[list[Change]]):
    """What the sandbox changed below ``under`` relative to its layers."""

    names = ("under",)
    kind: Literal["changes"] = "changes"
    under: SandboxPath = "/"


class WatchDir(_Named, Stream[WatchEvent]):
    """``start`` once the watch is in place, then changes below ``path`` (names relative to
    it); closing the stream removes the watch."""

    names = ("path",)
    kind: Literal["watch_dir"] = "watch_dir"
    path: SandboxPath
    recursive: bool = False


# -- lifecycle --------------------------------------------------------------------------------


class Pause(Call[SandboxInfo]):
    """Freeze the sandbox and push its memory out of RAM; any later request resumes it."""

    kind: Literal["pause"] = "pause"


class Resume(Call[SandboxInfo]):
    kind: Literal["resume"] = "resume"


class SetNetworkRules(NetworkRulesRequest, Call[SandboxInfo]):
    """Replace the sandbox's network permissions (in force when answered)."""

    kind: Literal["set_network_rules"] = "set_network_rules"


class SetDeadline(DeadlineRequest, Call[SandboxInfo]):
    """Stop or pause the sandbox ``timeout_s`` seconds of running time from now (journaled; a
    resume restarts the count); ``None`` clears the deadline."""

    kind: Literal["set_deadline"] = "set_deadline"


class Trajectory(Call[list[TrajectoryEntry]]):
    quick: ClassVar[bool] = True
    kind: Literal["trajectory"] = "trajectory"
    after: int = Field(default=0, ge=0, le=MAX_COUNT)
    limit: int = Field(default=1000, ge=0, le=MAX_TRAJECTORY_PAGE)


class Metrics(Call[list[MetricSample]]):
    """Resource samples with ``start <= ts <= end`` (unix seconds, either open), oldest first,
    the last one read now (:mod:`dsec.edge.metrics`)."""

    quick: ClassVar[bool] = True
    kind: Literal["metrics"] = "metrics"
    # Strict: a time is a JSON number (the query parameters took digits only, not "1e9").
    start: float | None = Field(default=None, ge=0, le=MAX_UNIX_S, strict=True)
    end: float | None = Field(default=None, ge=0, le=MAX_UNIX_S, strict=True)


class Screenshot(Call[Image]):
    """The screen of a full VM, as a PNG."""

    kind: Literal["screenshot"] = "screenshot"


class ForkLocal(LocalForkRequest, Call[list[SandboxInfo]]):
    """Whole copies (memory and processes too) of a VM sandbox on its own node, under ``ids``
    (IDs of this node, chosen and reserved by the apiserver); all or none."""

    creates: ClassVar[bool] = True
    kind: Literal["fork_local"] = "fork_local"


class SendInput(InputRequest, Call[int]):
    """Keyboard and mouse input to a full VM; answers how many events were sent."""

    kind: Literal["send_input"] = "send_input"


class ForkSpec(Call[ForkSpecResult]):
    """Pack the sandbox's state as layer ``ref``; the spec of a copy that starts from it."""

    kind: Literal["fork_spec"] = "fork_spec"
    ref: Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(no_nul)]


# -- commands and processes -------------------------------------------------------------------


class RunShell(ShellRequest, Call[CommandResult]):
    kind: Literal["run_shell"] = "run_shell"


class Commit(CommitRequest, Call[LayerInfo]):
    kind: Literal["commit"] = "commit"


class Exec(ExecRequest, Stream[ExecEvent]):
    """A command the caller waits for: its output, then ``exit``; closing the stream early
    kills its process tree."""

    last: ClassVar[str | None] = "exit"
    kind: Literal["exec"] = "exec"


class StartProcess(ProcessStart, Stream[ProcessEvent]):
    """Start a process the edge keeps: ``start`` (its PID in the sandbox), its output, then
    ``end``; closing the stream early detaches (the process runs on)."""

    last: ClassVar[str | None] = "end"
    kind: Literal["start_process"] = "start_process"


class ConnectProcess(Stream[ProcessEvent]):
    """Attach to a running process: ``start``, its output from now on (no replay), ``end``."""

    last: ClassVar[str | None] = "end"
    kind: Literal["connect_process"] = "connect_process"
    pid: Pid


class ListProcesses(Call[list[ProcessInfo]]):
    """The running processes started by :class:`StartProcess`."""

    quick: ClassVar[bool] = True
    kind: Literal["list_processes"] = "list_processes"


class SendProcessInput(ProcessInput, Call[None]):
    """To its terminal if it has one, else its stdin pipe."""

    kind: Literal["send_process_input"] = "send_process_input"
    pid: Pid


class CloseProcessStdin(Call[None]):
    """EOF on its stdin (on a terminal: the end-of-file character, ^D)."""

    kind: Literal["close_process_stdin"] = "close_process_stdin"
    pid: Pid


class SignalProcess(ProcessSignal, Call[None]):
    """``signal`` to the process and all its descendants."""

    kind: Literal["signal_process"] = "signal_process"
    pid: Pid


class ResizeProcess(PtySize, Call[None]):
    kind: Literal["resize_process"] = "resize_process"
    pid: Pid


# -- the closed set ---------------------------------------------------------------------------


def _register(*models: type[_Op]) -> dict[str, type[_Op]]:
    ops: dict[str, type[_Op]] = {}
    for model in models:
        kind = model.model_fields["kind"].default
        assert isinstance(kind, str) and kind not in ops, f"{model.__name__}: kind {kind!r}"
        for base in model.__mro__:
            meta = getattr(base, "__pydantic_generic_metadata__", None)
            if meta and meta["origin"] in (Call, Stream):
                model.response = meta["args"][0]
                break
        else:
            raise TypeError(f"{model.__name__} derives from neither Call[...] nor Stream[...]")
        model.adapter = TypeAdapter(model.response)
        ops[kind] = model
    return ops


OPS: dict[str, type[_Op]] = _register(
    Stat, ListDir, Mkdir, Remove, Move, SetXattrs, Xattrs, Changes, WatchDir,
    Pause, Resume, SetNetworkRules, SetDeadline, Trajectory, Metrics, Screenshot,
    ForkLocal, SendInput, ForkSpec,
    RunShell, Commit, Exec, StartProcess, ConnectProcess, ListProcesses,
    SendProcessInput, CloseProcessStdin, SignalProcess, ResizeProcess,
)  # fmt: skip
"""Every sandbox operation by its ``kind``."""

AnyOp = Annotated[
    Stat | ListDir | Mkdir | Remove | Move | SetXattrs | Xattrs | Changes | WatchDir
    | Pause | Resume | SetNetworkRules | SetDeadline | Trajectory | Metrics | Screenshot
    | ForkLocal | SendInput | ForkSpec
    | RunShell | Commit | Exec | StartProcess | ConnectProcess | ListProcesses
    | SendProcessInput | CloseProcessStdin | SignalProcess | ResizeProcess,
    Field(discriminator="kind"),
]  # fmt: skip
ANY_OP: TypeAdapter[Any] = TypeAdapter(AnyOp)


PUBLIC: frozenset[str] = frozenset(
    {
        "stat", "list_dir", "mkdir", "remove", "move", "changes", "set_xattrs", "xattrs",
        "pause", "resume", "set_network_rules", "set_deadline",
        "trajectory", "metrics", "screenshot", "send_input",
        "run_shell", "commit",
        "list_processes", "send_process_input", "close_process_stdin", "signal_process", "resize_process",
    }
)  # fmt: skip
"""The calls the public API serves as data (``POST /v1/sandboxes/{id}/ops/{kind}``): those
whose REST route does no more than check the key's ownership and forward."""


def parse_op(kind: str, body: bytes) -> _Op:
    """The op of ``kind`` in JSON ``body`` (a missing ``kind`` is taken from the route);
    ``InvalidRequest`` for an unknown kind or a bad field."""
    model = OPS.get(kind)
    if model is None:
        raise InvalidRequest(f"unknown sandbox operation {kind[:64]!r}")
    try:
        op = model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise invalid_request(exc) from exc
    return op
