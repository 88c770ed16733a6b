"""Another DSec cluster as one :class:`~dsec.edge.link.EdgeLink`: the home apiserver's adapter
for sandboxes it sent there (overflow, :mod:`dsec.apiserver.overflow`).

It speaks the other cluster's *public* API (``/v1/...``) with an API key of a project there,
through :class:`~dsec.protocol.wire_client.WireClient` (the SDK's client), so the home
apiserver's per-sandbox code paths (``SandboxRoutes.owned`` and every route behind it) work
unchanged. IDs are translated both ways without a table: the other cluster's ID
``sb-<node>-<epoch>-<tag>`` is ``sb-<cluster>--<node>-<epoch>-<tag>`` at home
(:meth:`~dsec.protocol.ids.SandboxId.in_cluster`). Every sandbox there lives in the one project
of the key; the home project it belongs to travels as label :data:`HOME_PROJECT_LABEL` (set
here at create, whatever the caller's labels say), and is given back as the sandbox's
``project``, so visibility and quota are the home cluster's. A sandbox of that project without
the label was not sent by a home cluster: it is not shown.

A network failure is ``InfraFailure(reason="overflow_unreachable")`` with the network error as
its cause (so ``never_sent`` still tells an unsent create from one that may have run).
Nothing is retried here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar, cast
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, TypeAdapter, ValidationError

from dsec.apiserver.remote_ports import open_remote_port
from dsec.edge.link import EdgeLink
from dsec.edge.ports import PortStream, check_port
from dsec.executor.file_ops import CHUNK, DEFAULT_FILE_MODE
from dsec.iam.base import in_subtree
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, SandboxNotFound
from dsec.protocol.files import path_query
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    BulkAction,
    BulkResult,
    Change,
    ContainerSpec,
    FileStat,
    ForkRequest,
    LeaseRequest,
    LeaseResult,
    SandboxInfo,
    TrajectoryEntry,
)
from dsec.protocol.ops import PUBLIC, Call, ConnectProcess, Exec, StartProcess, Stream, WatchDir
from dsec.protocol.wire_client import WireClient, ndjson, never_sent, send_stream

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")
E = TypeVar("E")
# Set by the home apiserver on every sandbox it creates in another cluster: the home project.
HOME_PROJECT_LABEL = "overflow.dsec/home-project"
_INFOS = TypeAdapter(list[SandboxInfo])
_STATS = TypeAdapter(list[FileStat])
_ENTRIES = TypeAdapter(list[TrajectoryEntry])
_CHANGES = TypeAdapter(list[Change])
_BULK_CONCURRENCY = 32


def _body(model: type[M], op: BaseModel) -> M:
    """An op's fields as the public route's request model (the op is that model plus ``kind``)."""
    return model.model_validate(op.model_dump(exclude={"kind"}))


def never_reached_overflow(exc: BaseException) -> bool:
    """Whether ``exc`` (from an :class:`OverflowLink` call) means the request never left: only
    then may a create go to another target or home without risking a sandbox nobody knows."""
    return (
        isinstance(exc, InfraFailure)
        and exc.reason == InfraReason.overflow_unreachable
        and never_sent(exc.__cause__)
    )


class OverflowLink(EdgeLink):
    """Cluster ``name``'s public API at ``url``, with ``api_key`` (a key of a project there).

    Calls go to the other cluster as data (its public ops route); streams (exec, kept
    processes, watches), file contents, ports, forks and function calls through their own
    public routes. What the public API does not serve (a VM's whole fork on one node by IDs
    the caller picks, a fork spec) answers ``InvalidRequest``.
    """

    def __init__(
        self,
        name: str,
        url: str,
        api_key: str,
        *,
        connect_timeout: float = 3.0,
        control_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self._wire = WireClient(url.rstrip("/"), {"Authorization": f"Bearer {api_key}"})
        self._connect_timeout = connect_timeout
        self._control_timeout = control_timeout

    @property
    def url(self) -> str:
        return self._wire.url

    @property
    def epoch(self) -> int | None:
        return None  # a cluster has no epoch: the IDs it makes carry its nodes' own

    async def close(self) -> None:
        await self._wire.close()

    # -- IDs and infos ------------------------------------------------------------------------

    def remote_id(self, sandbox_id: str) -> str:
        sid = SandboxId.parse(sandbox_id)
        if sid.cluster != self.name:
            raise SandboxNotFound(f"sandbox {sandbox_id} does not run in overflow cluster {self.name!r}")
        return str(sid.within_cluster())

    def home_info(self, info: SandboxInfo) -> SandboxInfo | None:
        """The other cluster's ``info`` as the home cluster shows it; None: not a home sandbox."""
        labels = dict(info.labels)
        project = labels.pop(HOME_PROJECT_LABEL, None)
        if project is None:
            return None
        try:
            sid = SandboxId.parse(info.id).in_cluster(self.name)
        except InvalidRequest:
            return None
        return info.model_copy(
            update={"id": str(sid), "node": sid.node, "labels": labels, "project": project}
        )

    def _info(self, raw: bytes, sandbox_id: str) -> SandboxInfo:
        info = self.home_info(self._parse(SandboxInfo, raw))
        if info is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
        return info

    def _infos(self, raw: bytes) -> list[SandboxInfo]:
        try:
            infos = _INFOS.validate_json(raw)
        except ValidationError as exc:
            raise self._malformed("list", exc) from exc
        return [h for h in map(self.home_info, infos) if h is not None]

    def _parse(self, model: type[M], raw: bytes) -> M:
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise self._malformed(model.__name__, exc) from exc

    def _malformed(self, what: str, exc: Exception) -> InfraFailure:
        return InfraFailure(
            f"overflow cluster {self.name!r} sent a malformed {what}: {exc}", reason=InfraReason.protocol
        )

    def _sandbox(self, sandbox_id: str, tail: str = "") -> str:
        return f"/v1/sandboxes/{quote(self.remote_id(sandbox_id), safe='')}{tail}"

    # -- plumbing -----------------------------------------------------------------------------

    def _unreachable(self, what: str, exc: BaseException) -> InfraFailure:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return InfraFailure(
            f"overflow cluster {self.name!r} at {self.url} is unreachable ({what}): {detail}",
            reason=InfraReason.overflow_unreachable,
        )

    @asynccontextmanager
    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | list[tuple[str, str]] | None = None,
        data: Any = None,
        json_body: Any = None,
        total: float | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=self._connect_timeout)
        try:
            async with self._wire.send(
                method, path, params=params, data=data, json_body=json_body, timeout=timeout
            ) as resp:
                yield resp
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self._unreachable(f"{method} {path}", exc) from exc

    async def _read(self, method: str, path: str, *, quick: bool = False, **kw: Any) -> bytes:
        async with self._call(method, path, total=self._control_timeout if quick else None, **kw) as resp:
            return await resp.read()

    def _unsupported(self, what: str) -> NoReturn:
        raise InvalidRequest(f"{what} is not available for sandboxes in overflow cluster {self.name!r}")

    # -- operations as data (protocol/ops.py): onto the named methods below -------------------

    async def call(self, sandbox_id: str, op: Call[R]) -> R:
        """The op through the other cluster's ``/v1/sandboxes/{id}/ops/{kind}`` (the kinds of
        :data:`~dsec.protocol.ops.PUBLIC`), unchanged; a sandbox's info comes back as home shows
        it. A commit's layer lands in the other cluster's store, under its project."""
        if op.kind not in PUBLIC:
            self._unsupported(str(op.kind))
        path = self._sandbox(sandbox_id, f"/ops/{op.kind}")
        raw = await self._read("POST", path, json_body=op.model_dump(mode="json"))
        try:
            answer = op.adapter.validate_json(raw)
        except ValidationError as exc:
            raise self._malformed(f"{op.kind} answer", exc) from exc
        if isinstance(answer, SandboxInfo):
            home = self.home_info(answer)
            if home is None:
                raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
            answer = home
        return cast(R, answer)

    def _stream_route(self, sandbox_id: str, op: Stream[Any]) -> tuple[str, str, dict[str, str] | None, Any]:
        """The other cluster's public NDJSON route for ``op``: method, path, query, JSON body."""
        body = op.model_dump(mode="json", exclude={"kind"}, exclude_none=True)
        match op:
            case Exec():
                return "POST", self._sandbox(sandbox_id, "/exec"), None, body
            case StartProcess():
                return "POST", self._sandbox(sandbox_id, "/processes"), None, body
            case ConnectProcess(pid=pid):
                return "GET", self._sandbox(sandbox_id, f"/processes/{pid}/events"), None, None
            case WatchDir(path=path, recursive=recursive):
                query = {**path_query("path", path), "recursive": "true" if recursive else "false"}
                return "GET", self._sandbox(sandbox_id, "/watch"), query, None
        self._unsupported(str(op.kind))

    async def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        """The op through the other cluster's public route for it (an exec, a kept process
        started or attached to, a directory watch), its events unchanged. Closing this generator
        closes the response, which does there what it does here: an exec's process tree is
        killed, a kept process runs on, a watch is removed."""
        method, path, query, body = self._stream_route(sandbox_id, op)
        peer = f"overflow cluster {self.name!r}"
        async with self._call(method, path, params=query, json_body=body) as resp:
            async for event in ndjson(resp, op.response, peer=peer):
                yield cast(E, event)
                if op.last is not None and event.t == op.last:
                    return
        if op.last is not None:  # a watch runs until closed; the others end with their last event
            raise InfraFailure(
                f"{peer} ended a {op.kind} stream before its {op.last!r}",
                reason=InfraReason.overflow_unreachable,
            )

    # -- sandboxes ----------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return {"overflow": self.name, "url": self.url, "sandboxes": len(await self.sandbox_ids())}

    async def create(
        self, spec: ContainerSpec, sandbox_id: str | None = None, *, timeout: float = 120
    ) -> SandboxInfo:
        """``sandbox_id`` is not used: the other cluster names the sandbox (the answer's ID)."""
        home = spec.labels.get(PROJECT_LABEL)
        if home is None:
            raise InvalidRequest("an overflow create needs the spec's project (tenancy.admit sets it)")
        labels = {k: v for k, v in spec.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)}
        body = spec.model_copy(update={"labels": {**labels, HOME_PROJECT_LABEL: home}})
        request = {"spec": body.model_dump(mode="json"), "timeout": timeout}
        raw = await self._read("POST", "/v1/sandboxes", json_body=request)
        return self._info(raw, "made by the overflow create")

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._info(await self._read("GET", self._sandbox(sandbox_id), quick=True), sandbox_id)

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return self._infos(await self._read("GET", "/v1/sandboxes", params=params, quick=True))

    async def sandbox_ids(self) -> list[str]:
        return [i.id for i in await self.list_sandboxes()]

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return self._info(await self._read("DELETE", self._sandbox(sandbox_id)), sandbox_id)

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        """One by one: the other cluster's bulk routes act on its whole project, and the home
        projects it holds sandboxes of are only told apart here (``within``)."""
        if not labels:
            raise InvalidRequest(f"a bulk {action} needs at least one label")
        ids = [i.id for i in await self.list_sandboxes(labels) if in_subtree(i.project, within)]
        acts: dict[str, Callable[[str], Awaitable[SandboxInfo]]]
        acts = {"stop": self.stop, "pause": self.pause, "resume": self.resume}
        gate = asyncio.Semaphore(_BULK_CONCURRENCY)

        async def one(sid: str) -> SandboxInfo:
            async with gate:
                return await acts[action](sid)

        result = BulkResult(action=action)
        for sid, outcome in zip(
            ids, await asyncio.gather(*map(one, ids), return_exceptions=True), strict=True
        ):
            if isinstance(outcome, SandboxInfo):
                result.done.append(outcome)
            elif isinstance(outcome, Exception):
                result.failed[sid] = str(outcome)
            else:
                raise outcome
        return result

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        """Renews the job's leases in the whole project there (every home project's sandboxes
        of that job name): the public route knows no narrower scope."""
        body = LeaseRequest(lease_s=lease_s).model_dump()
        raw = await self._read("POST", f"/v1/jobs/{quote(job, safe='')}/lease", json_body=body)
        result = self._parse(LeaseResult, raw)
        return result.sandboxes, result.expires_at

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        return set()  # its layers are in the other cluster's store, not the home one's

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        """Through the other cluster's ``POST /v1/fncall``: placed there on a node with a pool."""
        body = {"task": task.model_dump(mode="json"), **({"pool": pool} if pool else {})}
        return self._parse(FnResult, await self._read("POST", "/v1/fncall", json_body=body))

    async def fork(
        self, sandbox_id: str, req: ForkRequest, labels: dict[str, str], project: str
    ) -> list[SandboxInfo]:
        """Copies made by the other cluster's ``POST /v1/sandboxes/{id}/fork`` (its layers and
        the packed state are there, so the copies are too: their IDs name that cluster, as
        their source's does), with ``labels`` and home project ``project``."""
        body = req.model_copy(update={"labels": {**labels, HOME_PROJECT_LABEL: project}})
        raw = await self._read(
            "POST", self._sandbox(sandbox_id, "/fork"), json_body=body.model_dump(mode="json")
        )
        made = self._infos(raw)
        if len(made) != req.count:  # a copy without the home label would run unseen
            raise self._malformed("fork answer", ValueError(f"{len(made)} of {req.count} copies labelled"))
        return made

    # -- files --------------------------------------------------------------------------------

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        url = self._sandbox(sandbox_id, "/files/content")
        async with self._call("GET", url, params=path_query("path", path)) as resp:
            async for chunk in resp.content.iter_chunked(CHUNK):
                yield chunk

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        params = {**path_query("path", path), "mode": format(mode & 0o7777, "o")}
        target = self._sandbox(sandbox_id, "/files/content")
        raw = await send_stream(lambda body: self._read("PUT", target, params=params, data=body), chunks)
        return self._parse(FileStat, raw)

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        """The other cluster's ``GET /v1/sandboxes/{id}/ports/{port}`` WebSocket (its edge's
        port protocol, :mod:`dsec.apiserver.port_routes`)."""
        url = self.url + self._sandbox(sandbox_id, f"/ports/{check_port(port)}")
        return await open_remote_port(
            self._wire.session(),
            url,
            self.name,
            self._connect_timeout,
            peer=f"overflow cluster {self.name!r}",
            reason=InfraReason.overflow_unreachable,
        )
