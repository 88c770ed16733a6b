"""An edge in another process, reached over HTTP: the cluster's :class:`~dsec.edge.link.EdgeLink`.

It speaks the routes of :mod:`dsec.edge.server`. Errors come back as the same DSec classes the
edge raised, so the apiserver cannot tell a remote edge from a local one; what only a network
adds is classified: an edge that cannot be reached, or that stops answering mid-stream, is
``InfraFailure(reason="edge_unreachable")`` naming the node (a trainer masks it; placement may
try another node), or ``node_lost`` when the cluster's registry says the node is gone
(:mod:`dsec.apiserver.node_verdict`). An answer that is not a DSec edge's is
``InfraFailure(reason="protocol")``, never a validation error that would read as the caller's mistake.

Requests go through :class:`~dsec.protocol.wire_client.WireClient`, the SDK's client too (error
decoding by code, NDJSON streams, the one ``edge_unreachable`` reason); this link adds the edge's
node and epoch headers check and the registry's verdict on a node that stops answering.

Nothing is retried here: a create or a command the edge may already have received must not
run twice. Retrying is the caller's decision (placement retries creates on another node).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, TypeAdapter, ValidationError

from dsec.apiserver.node_verdict import NODE_LOST, NodeView
from dsec.apiserver.remote_ports import open_remote_port
from dsec.edge.link import EdgeLink, FenceRequest
from dsec.edge.ports import PortStream, check_port
from dsec.edge.server import EPOCH_HEADER, NODE_HEADER, PREFIX, STARTING_REASON
from dsec.executor.file_ops import CHUNK, DEFAULT_FILE_MODE
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason
from dsec.protocol.files import path_query
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.models import (
    BulkAction,
    BulkResult,
    ContainerSpec,
    FileStat,
    LeaseRequest,
    SandboxInfo,
)
from dsec.protocol.ops import Call, Stream
from dsec.protocol.volumes import VolumeEntry, VolumeOp, WriteOptions
from dsec.protocol.wire_client import WireClient, ndjson, never_sent, send_stream, unreachable

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")
E = TypeVar("E")
_INFOS = TypeAdapter(list[SandboxInfo])
_TRUSTED = {"trusted": True}
_JSON = {"Content-Type": "application/json"}


def never_reached_edge(exc: BaseException) -> bool:
    """Whether ``exc`` (from a link call) means the request never reached the edge.

    Only then may a create be retried on another node without risking a sandbox that runs
    but that nobody knows about: an edge killed a moment ago refuses connections until the
    watcher notices, and placement should move on rather than fail the caller.
    """
    if not isinstance(exc, InfraFailure):
        return False
    # A starting edge refuses everything until it has re-adopted its sandboxes (EdgeServer).
    return exc.reason == STARTING_REASON or (
        exc.reason in (InfraReason.edge_unreachable, NODE_LOST) and never_sent(exc.__cause__)
    )


class RemoteEdgeLink(EdgeLink):
    """Node ``node``'s edge at ``url`` (e.g. ``http://10.0.0.7:8643``), authenticated by ``secret``.

    ``connect_timeout`` bounds reaching the edge (an edge that is down must be noticed quickly);
    ``control_timeout`` bounds the quick calls (stats, get, list, layers in use). Creates,
    commands and transfers are bounded by their callers: a command may legitimately run for a day.
    """

    def __init__(
        self,
        url: str,
        secret: str,
        node: str,
        *,
        connect_timeout: float = 5.0,
        control_timeout: float = 30.0,
        epoch: int | None = None,
    ) -> None:
        self.node = node
        self._wire = WireClient(
            url.rstrip("/"), {"Authorization": f"Bearer {secret}"}, on_response=self._observe
        )
        self._connect_timeout = connect_timeout
        self._control_timeout = control_timeout
        self._epoch = epoch
        self.view = NodeView(node)  # the registry's word on the node, kept by the membership

    @property
    def url(self) -> str:
        return self._wire.url

    @url.setter
    def url(self, url: str) -> None:
        self._wire.url = url

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def follow(
        self, url: str, epoch: int, last_seen: float | None = None, read_at: float | None = None
    ) -> None:
        """The registry says where the node is now, under which epoch, and when it last heard
        from it (read at ``read_at``): calls in flight on a node now lost are cut."""
        self.url = url.rstrip("/")
        self._epoch = epoch
        if last_seen is not None and read_at is not None:
            self.view.update(epoch, last_seen, read_at)

    async def close(self) -> None:
        await self._wire.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _unreachable(self, what: str, exc: BaseException) -> InfraFailure:
        return unreachable(what, exc, f"edge {self.node!r} at {self.url}")

    def _observe(self, resp: aiohttp.ClientResponse) -> None:
        node, epoch = resp.headers.get(NODE_HEADER), resp.headers.get(EPOCH_HEADER)
        if node is None or epoch is None or not epoch.isdigit():
            if resp.status == 401:
                return  # refused before it said who it is; the 401 body tells the rest
            raise InfraFailure(
                f"{self.url} (node {self.node!r}) answered HTTP {resp.status} but is not a DSec edge",
                reason=InfraReason.protocol,
            )
        if node != self.node:
            raise InfraFailure(
                f"{self.url} is node {node!r}, not {self.node!r}: the cluster's list of edges is wrong",
                reason=InfraReason.edge_misconfigured,
            )
        self._epoch = int(epoch)
        self.view.heard()  # it answered: alive, whatever the registry says

    @asynccontextmanager
    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | list[tuple[str, str]] | None = None,
        data: Any = None,
        headers: Mapping[str, str] | None = None,
        quick: bool = False,
        creates: bool = False,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request; yields the response once it is known to be a success.

        Network failures while the caller reads the body (an edge dying mid-stream) are
        classified here too: they surface through the ``yield``.
        """
        what = f"{method} {path}"
        timeout = aiohttp.ClientTimeout(
            total=self._control_timeout if quick else None, sock_connect=self._connect_timeout
        )
        # A create is never cut: one the node made as it changed epoch would run unknown to all.
        task = None if creates else self.view.begin()
        try:
            async with self._wire.send(
                method, PREFIX + path, params=params, data=data, headers=headers, timeout=timeout
            ) as resp:
                yield resp
        except DSecError:
            raise
        except asyncio.CancelledError:
            if self.view.was_cut(task):
                raise self.view.lost_error(what) from None
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            started_epoch = self.view.started_epoch(task)
            self.view.end(task)  # before any await: from here on nothing cuts this task
            if never_sent(exc):
                gone = self.view.lost_error(what) if self.view.lost else self._unreachable(what, exc)
                raise gone from exc
            lost = await self.view.after_break(what, started_epoch)
            raise (lost or self._unreachable(what, exc)) from exc
        finally:
            self.view.end(task)

    def _parse(self, model: type[M], data: bytes) -> M:
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            # Version skew between apiserver and edge: the platform's fault, not the caller's.
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed {model.__name__}: {exc}", reason=InfraReason.protocol
            ) from exc

    async def _json(
        self, method: str, path: str, *, body: BaseModel | None = None, quick: bool = False, **kw: Any
    ) -> bytes:
        data = None if body is None else body.model_dump_json()
        async with self._call(method, path, data=data, headers=_JSON, quick=quick, **kw) as resp:
            return await resp.read()

    @staticmethod
    def _sandbox(sandbox_id: str, tail: str = "") -> str:
        # Quoted: an ID is validated by the edge, and a malformed one must reach it intact.
        return f"/sandboxes/{quote(sandbox_id, safe='')}{tail}"

    # -- sandbox operations (protocol/ops.py) ---------------------------------------------------

    async def call(self, sandbox_id: str, op: Call[R]) -> R:
        path = self._sandbox(sandbox_id, f"/ops/{op.kind}")
        async with self._call(
            "POST", path, data=op.model_dump_json(), headers=_JSON, quick=op.quick, creates=op.creates
        ) as resp:
            raw = await resp.read()
        try:
            # Trusted: a fork's spec carries the reserved labels the edge's records have.
            return cast(R, op.adapter.validate_json(raw, context=_TRUSTED))
        except ValidationError as exc:
            # Version skew between apiserver and edge: the platform's fault, not the caller's.
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed answer to {op.kind}: {exc}", reason=InfraReason.protocol
            ) from exc

    async def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        path = self._sandbox(sandbox_id, f"/streams/{op.kind}")
        started_epoch = self.view.epoch
        async with self._call("POST", path, data=op.model_dump_json(), headers=_JSON) as resp:
            # Closing this generator closes the response: the edge sees the hang-up and stops
            # (or detaches from) what the op started.
            async for event in ndjson(resp, op.response, peer=f"edge {self.node!r}"):
                yield event
                if op.last is not None and getattr(event, "t", None) == op.last:
                    return
        if op.last is not None:
            raise await self.view.ended_early(f"a {op.kind} stream", self.url, started_epoch)

    # -- sandboxes ----------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        raw = await self._json("GET", "/stats", quick=True)
        try:
            stats = json.loads(raw)
        except ValueError as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent malformed stats", reason=InfraReason.protocol
            ) from exc
        if not isinstance(stats, dict):
            raise InfraFailure(f"edge {self.node!r} sent malformed stats", reason=InfraReason.protocol)
        return stats

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        params = {"id": sandbox_id} if sandbox_id else None
        raw = await self._json("POST", "/sandboxes", body=spec, params=params, creates=True)
        return self._parse(SandboxInfo, raw)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._parse(SandboxInfo, await self._json("GET", self._sandbox(sandbox_id), quick=True))

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        raw = await self._json("GET", "/sandboxes", params=params, quick=True)
        try:
            return _INFOS.validate_json(raw)
        except ValidationError as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed list: {exc}", reason=InfraReason.protocol
            ) from exc

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return self._parse(SandboxInfo, await self._json("DELETE", self._sandbox(sandbox_id)))

    async def sandbox_ids(self) -> list[str]:
        raw = await self._json("GET", "/sandbox-ids", quick=True)
        try:
            ids = json.loads(raw)["ids"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed ID list", reason=InfraReason.protocol
            ) from exc
        return [str(i) for i in ids]

    async def fence(self, fenced: bool, reason: str = "") -> bool:
        body = FenceRequest(fenced=fenced, reason=reason)
        try:
            return bool(json.loads(await self._json("POST", "/fence", body=body, quick=True))["fenced"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed fence answer", reason=InfraReason.protocol
            ) from exc

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        params = [("label", f"{k}={v}") for k, v in labels.items()] + [("within", within)]
        return self._parse(BulkResult, await self._json("POST", f"/bulk/{action}", params=params))

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        path = f"/leases/{quote(job, safe='')}"
        raw = await self._json("POST", path, body=LeaseRequest(lease_s=lease_s), params={"within": within})
        try:
            body = json.loads(raw)
            return int(body["sandboxes"]), float(body["expires_at"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed lease answer", reason=InfraReason.protocol
            ) from exc

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        url = self.url + PREFIX + self._sandbox(sandbox_id, f"/ports/{check_port(port)}")
        return await open_remote_port(self._wire.session(), url, self.node, self._connect_timeout)

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        raw = await self._json("POST", "/fncall", body=task, params={"pool": pool} if pool else None)
        return self._parse(FnResult, raw)

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        params = {"unmount_idle": "true" if unmount_idle else "false"}
        raw = await self._json("POST", "/layers/in-use", params=params, quick=True)
        try:
            digests = json.loads(raw)["digests"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed layer list", reason=InfraReason.protocol
            ) from exc
        return {str(d) for d in digests}

    # -- files --------------------------------------------------------------------------------

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        url = self._sandbox(sandbox_id, "/files/content")
        async with self._call("GET", url, params=path_query("path", path)) as resp:
            # A download the edge cuts off mid-way fails here (payload error), never as a short file.
            async for chunk in resp.content.iter_chunked(CHUNK):
                yield chunk

    # -- shared volumes -------------------------------------------------------------------------

    async def volume(self, op: VolumeOp) -> Any:
        raw = await self._json("POST", f"/volumes/{op.kind}", body=op, quick=True)
        try:
            return op.adapter.validate_json(raw)
        except ValidationError as exc:
            raise InfraFailure(
                f"edge {self.node!r} sent a malformed answer to volume {op.kind}: {exc}",
                reason=InfraReason.protocol,
            ) from exc

    @staticmethod
    def _volume(volume_id: str, within: str, path: str) -> tuple[str, dict[str, str]]:
        return f"/volumes/{quote(volume_id, safe='')}/content", {"within": within, **path_query("path", path)}

    async def volume_read(self, volume_id: str, within: str, path: str) -> AsyncGenerator[bytes, None]:
        url, params = self._volume(volume_id, within, path)
        async with self._call("GET", url, params=params) as resp:
            async for chunk in resp.content.iter_chunked(CHUNK):
                yield chunk

    async def volume_write(
        self, volume_id: str, within: str, path: str, chunks: AsyncIterable[bytes], opts: WriteOptions
    ) -> VolumeEntry:
        url, params = self._volume(volume_id, within, path)
        params.update(opts.to_query())

        async def put(body: AsyncIterator[bytes]) -> bytes:
            async with self._call("PUT", url, params=params, data=body) as resp:
                return await resp.read()

        return self._parse(VolumeEntry, await send_stream(put, chunks))

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        params = {**path_query("path", path), "mode": format(mode & 0o7777, "o")}

        async def put(body: AsyncIterator[bytes]) -> bytes:
            async with self._call(
                "PUT", self._sandbox(sandbox_id, "/files/content"), params=params, data=body
            ) as resp:
                return await resp.read()

        return self._parse(FileStat, await send_stream(put, chunks))
