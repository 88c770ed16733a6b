"""Sandbox routes: create through placement, everything else routed by the ID to its node.

Nodes are :class:`~dsec.edge.link.EdgeLink` s, in this process (``dsec up``) or across the
network (a cluster); this module holds no per-sandbox state, so any apiserver instance serves
any request.

A sandbox operation (:mod:`dsec.protocol.ops`) takes one path whatever route it came by (its
REST shape of the SDK's earlier releases, or as data on ``.../ops/{kind}``): the route builds
the op from its request and :meth:`SandboxRoutes.forward` checks the key may see the sandbox
(:meth:`SandboxRoutes.owned`, once) and hands the op unchanged to ``link.call``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from dsec.apiserver._http import (
    PRINCIPAL,
    file_mode_param,
    label_filter,
    query_param,
    read_body,
    respond,
    stream_bytes,
)
from dsec.apiserver.layer_access import admit_layers
from dsec.apiserver.overflow import Overflow
from dsec.apiserver.remote_edge import never_reached_edge
from dsec.apiserver.tenancy import Tenancy
from dsec.edge.admission import NEVER_FITS
from dsec.edge.link import EdgeLink
from dsec.iam import Principal
from dsec.images.store import LayerStore
from dsec.placement.placement import Placement
from dsec.protocol.errors import (
    CapacityExhausted,
    InfraFailure,
    InvalidRequest,
    NotFoundReason,
    SandboxNotFound,
    VolumeNotFound,
)
from dsec.protocol.http import flag_param
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    BatchCreateRequest,
    BulkAction,
    BulkResult,
    ContainerSpec,
    CreateRequest,
    SandboxInfo,
)
from dsec.protocol.ops import (
    Call,
    Commit,
    Exec,
    ListDir,
    Mkdir,
    Move,
    Remove,
    RunShell,
    SetNetworkRules,
    Stat,
)
from dsec.protocol.volumes import volume_node

_CHUNK = 1 << 20
T = TypeVar("T")
R = TypeVar("R")
Op = TypeVar("Op", bound=Call[Any])
_PROJECT_CACHE = 100_000
# Quota reconciliation spares rows younger than 30 s; a create slower than this re-confirms its row.
_SLOW_CREATE_S = 10.0
UNREACHABLE_HEADER = "X-DSec-Unreachable-Nodes"


async def attempt_on(
    placement: Placement,
    node: str,
    tried: set[str],
    call: Callable[[], Awaitable[T]],
    never_fits: list[CapacityExhausted] | None = None,
) -> T | None:
    """``call`` on ``node``; None when the node refused it before doing anything (add it to
    ``tried`` and place again): the edge has the final word, and a node that is down never
    saw the request. Any other failure is raised: the work may have happened there. Refusals
    of what the node could never take go to ``never_fits``."""
    with placement.reserve(node):
        try:
            return await call()
        except CapacityExhausted as exc:
            if never_fits is not None and exc.reason == NEVER_FITS:
                never_fits.append(exc)
            tried.add(node)
        except InfraFailure as exc:
            if not never_reached_edge(exc):
                raise  # e.g. a create that may have run: retrying could make two
            tried.add(node)
        return None


def from_body(model: type[Op]) -> Callable[[bytes], Op]:
    """Builds a ``model`` op from a JSON request body (a bad field: a 400 naming it)."""

    def build(body: bytes) -> Op:
        return model.model_validate_json(body or b"{}")

    return build


WHOLE_FORK = ("microvm", "vm")  # backends forked with memory and processes, on their own node


class SandboxRoutes:
    def __init__(
        self,
        links: Mapping[str, EdgeLink],
        placement: Placement,
        tenancy: Tenancy,
        store: LayerStore | None = None,
        *,
        overflow: Overflow | None = None,
    ) -> None:
        self.links = links  # with an overflow: local nodes and overflow targets (apiserver/overflow.py)
        self.overflow = overflow
        self.placement = placement
        self.tenancy = tenancy
        self.store = store  # None: no layer checks (tests that drive routes without a store)
        self._projects: dict[str, str] = {}  # sandbox ID -> project, oldest first

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/sandboxes", self.create)
        r.add_post("/v1/sandboxes/batch", self.create_batch)
        r.add_get("/v1/sandboxes", self.list)
        r.add_delete("/v1/sandboxes", self.stop_by_label)
        r.add_get("/v1/sandboxes/{id}", self.get)
        r.add_delete("/v1/sandboxes/{id}", self.stop)
        r.add_put("/v1/sandboxes/{id}/network", self.set_network_rules)
        r.add_post("/v1/sandboxes/{id}/shell", self.shell)
        r.add_post("/v1/sandboxes/{id}/exec", self.exec)
        r.add_post("/v1/sandboxes/{id}/commit", self.commit)
        r.add_get("/v1/sandboxes/{id}/files/content", self.download)
        r.add_put("/v1/sandboxes/{id}/files/content", self.upload)
        r.add_get("/v1/sandboxes/{id}/files/stat", self.stat)
        r.add_get("/v1/sandboxes/{id}/files/list", self.list_dir)
        r.add_post("/v1/sandboxes/{id}/files/mkdir", self.mkdir)
        r.add_delete("/v1/sandboxes/{id}/files", self.remove)
        r.add_post("/v1/sandboxes/{id}/files/move", self.move)

    def link_for(self, sandbox_id: str) -> EdgeLink:
        sid = SandboxId.parse(sandbox_id)
        link = self.links.get(sid.node)
        if link is None and sid.cluster is not None and self.overflow is not None:
            return self.overflow.link(sid.cluster)  # another cluster's: the ID names it
        if link is None:
            raise SandboxNotFound(f"sandbox {sandbox_id}: node {sid.node!r} is not part of this cluster")
        if link.epoch is not None and link.epoch != sid.epoch:
            raise SandboxNotFound(
                f"sandbox {sandbox_id} belonged to an earlier incarnation of node {sid.node!r}"
                f" (epoch {sid.epoch}, now {link.epoch}): it no longer exists",
                reason=NotFoundReason.stale_epoch,
            )
        return link

    async def owned(self, request: web.Request) -> tuple[EdgeLink, str]:
        """The sandbox a request names, if the request's key may see it (else: not found)."""
        sid = request.match_info["id"]
        link = self.link_for(sid)
        project = self._projects.get(sid)
        if project is None:
            # A sandbox's project never changes, so one lookup per sandbox (not per request)
            # keeps exec and shell at one round trip to the edge; the cache is derived, bounded.
            project = (await link.get(sid)).project
            if len(self._projects) >= _PROJECT_CACHE:
                self._projects.pop(next(iter(self._projects)))
            self._projects[sid] = project
        self.tenancy.check_visible(request[PRINCIPAL], sid, project)
        return link, sid

    async def forward(self, request: web.Request, build: Callable[[bytes], Call[R]]) -> R:
        """The op ``build`` makes of the request's body, run on the sandbox the request names
        (once :meth:`owned` let the key see it) and its answer: every route of a sandbox
        operation, whatever its shape, goes this way to ``link.call``."""
        link, sid = await self.owned(request)
        return await link.call(sid, build(await request.read()))

    async def answer(
        self, request: web.Request, build: Callable[[bytes], Call[Any]], status: int = 200
    ) -> web.Response:
        """:meth:`forward`, its answer as the JSON response."""
        return respond(await self.forward(request, build), status=status)

    # -- lifecycle ----------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        req = await read_body(request, CreateRequest)
        principal = request[PRINCIPAL]
        spec = await self.admit_layers(principal, self.tenancy.admit(principal, req.project, req.spec))
        return respond(await self._create(principal, spec, req.timeout), status=201)

    async def create_batch(self, request: web.Request) -> web.Response:
        """``count`` sandboxes of one spec in one request: what a trainer's step asks for.

        Each is created as by a single create (own placement, reservation and retries); the
        reservations share transactions (group commit) and the request's HTTP cost is paid once.
        All or nothing: if any fails, those made are stopped and the first error is the answer.
        """
        req = await read_body(request, BatchCreateRequest)
        principal = request[PRINCIPAL]
        spec = await self.admit_layers(principal, self.tenancy.admit(principal, req.project, req.spec))
        return respond(await self.create_many(principal, spec, req.count, req.timeout), status=201)

    async def admit_layers(self, principal: Principal, spec: ContainerSpec) -> ContainerSpec:
        """``spec`` if the key may use its layers (LayerNotFound else), digests pinned; a fork
        skips this: its copies run on the layers the source already runs on."""
        return spec if self.store is None else await admit_layers(self.store, principal, spec)

    async def create_many(
        self, principal: Principal, spec: ContainerSpec, count: int, timeout: float
    ) -> list[SandboxInfo]:
        made = await asyncio.gather(
            *(self._create(principal, spec, timeout) for _ in range(count)), return_exceptions=True
        )
        ok = [m for m in made if isinstance(m, SandboxInfo)]
        failed = [m for m in made if not isinstance(m, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self._undo(info) for info in ok), return_exceptions=True)
            raise failed[0]
        return ok

    async def fork_whole(
        self,
        principal: Principal,
        link: EdgeLink,
        source: SandboxInfo,
        count: int,
        labels: dict[str, str] | None,
    ) -> list[SandboxInfo]:
        """Copies of a VM (:data:`WHOLE_FORK`), memory and processes too, made on its own node
        (the snapshot is local), all or none: the copies' IDs are that node's, each reserved
        in the source's project before the edge makes them."""
        epoch = link.epoch if link.epoch is not None else SandboxId.parse(source.id).epoch
        ids = [str(SandboxId(source.node, epoch, SandboxId.new_tag())) for _ in range(count)]
        resources = ContainerSpec(
            layers=source.layers,
            memory_limit_mb=source.memory_limit_mb,
            cpu_cores_limit=source.cpu_cores_limit,
        )
        bill = self.tenancy.admit(principal, source.project, resources)
        reserved: list[str] = []
        try:
            for sid in ids:
                await self.tenancy.reserve(principal, sid, bill)
                reserved.append(sid)
            return await link.fork_local(source.id, ids, labels)
        except BaseException:
            await asyncio.shield(self.tenancy.release_many(reserved))
            raise

    async def _undo(self, info: SandboxInfo) -> None:
        await self.link_for(info.id).stop(info.id)
        await self.tenancy.release(info.id)

    async def _create(self, principal: Principal, spec: ContainerSpec, timeout: float) -> SandboxInfo:
        """On a node here; on an overflow target when the cluster is past its threshold or
        placement finds no node (and home again once it is not)."""
        overflow = self.overflow
        if overflow is None or spec.volumes:  # a volume's node is here: its sandboxes are too
            return await self._create_here(principal, spec, timeout)
        started = time.monotonic()
        tried = overflow.over_threshold()
        if tried:
            made = await overflow.create(self.tenancy, principal, spec, timeout)
            if made is not None:
                return made
        try:
            return await self._create_here(principal, spec, timeout - (time.monotonic() - started))
        except CapacityExhausted:
            made = None if tried else await overflow.create(self.tenancy, principal, spec, timeout)
            if made is None:
                raise
            return made

    async def _create_here(self, principal: Principal, spec: ContainerSpec, timeout: float) -> SandboxInfo:
        started = time.monotonic()
        tag = SandboxId.new_tag()  # the sandbox keeps it on whichever node takes it
        reserved: str | None = None
        tried: set[str] = set()
        if spec.volumes:  # only the node keeping its volumes (the model made sure it is one)
            node = volume_node(next(iter(spec.volumes.values())))
            if node not in self.links:
                raise VolumeNotFound(f"volume node {node!r} is not part of this cluster")
            tried = set(self.links) - {node}
        excluded = len(tried)  # nodes never asked: not among those that said it never fits
        never_fits: list[CapacityExhausted] = []
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        node = await self.placement.choose(
                            spec.type, tried, spec.hardware, tuple(spec.required_capabilities())
                        )
                    except CapacityExhausted as exc:
                        if never_fits and len(never_fits) == len(tried) - excluded:
                            # Every node asked can never take it: waiting will not help.
                            raise InvalidRequest(never_fits[-1].message) from exc
                        raise
                    epoch = self.links[node].epoch
                    if epoch is None:  # never reached: no ID can be made for it yet
                        tried.add(node)
                        continue
                    sid = str(SandboxId(node, epoch, tag))
                    if reserved is None:
                        await self.tenancy.reserve(principal, sid, spec)
                    elif reserved != sid:
                        await self.tenancy.move(reserved, sid)
                    reserved = sid
                    info = await self._create_on(node, spec, sid, tried, never_fits)
                    if info is not None:
                        break
        except BaseException:
            if reserved is not None:
                await asyncio.shield(self.tenancy.release(reserved))
            raise
        if time.monotonic() - started > _SLOW_CREATE_S:
            await self.tenancy.confirm(principal, info.id, spec)
        return info

    async def _create_on(
        self, node: str, spec: ContainerSpec, sid: str, tried: set[str], never_fits: list[CapacityExhausted]
    ) -> SandboxInfo | None:
        call = lambda: self.links[node].create(spec, sid)  # noqa: E731
        return await attempt_on(self.placement, node, tried, call, never_fits)

    async def list(self, request: web.Request) -> web.Response:
        """Running sandboxes on every node; nodes that did not answer are named in a header."""
        labels = label_filter(request)
        names = list(self.links)
        answers = await asyncio.gather(
            *(self.links[n].list_sandboxes(labels) for n in names), return_exceptions=True
        )
        everything = [info for a in answers if not isinstance(a, BaseException) for info in a]
        resp = respond(self.tenancy.visible(request[PRINCIPAL], everything))
        missing = [n for n, a in zip(names, answers, strict=True) if isinstance(a, BaseException)]
        if missing:
            resp.headers[UNREACHABLE_HEADER] = ",".join(missing)
        return resp

    async def stop_by_label(self, request: web.Request) -> web.Response:
        """Stop every sandbox carrying all the given labels, on every node: "this job is gone"."""
        return respond(await self.bulk(request, "stop"))

    async def bulk(self, request: web.Request, action: BulkAction) -> BulkResult:
        """Stop, pause or resume every sandbox carrying all the given labels, on every node.

        One request per node (the edge acts on its own matches), so a job of any size costs the
        same number of round trips; a node that does not answer is reported, not skipped quietly.
        """
        labels = label_filter(request)
        if not labels:
            raise InvalidRequest(
                f"give at least one label=key=value: a bulk {action} of everything is refused"
            )
        within = request[PRINCIPAL].project
        names = list(self.links)
        answers = await asyncio.gather(
            *(self.links[n].bulk(action, labels, within) for n in names), return_exceptions=True
        )
        total = BulkResult(action=action)
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BulkResult):
                total.done += answer.done
                total.failed.update(answer.failed)
            elif isinstance(answer, Exception):
                total.unreachable_nodes.append(name)
            else:
                raise answer
        if action == "stop":
            await self.tenancy.release_many([info.id for info in total.done])
        return total

    async def get(self, request: web.Request) -> web.Response:
        link, sid = await self.owned(request)
        return respond(await link.get(sid))

    async def set_network_rules(self, request: web.Request) -> web.Response:
        return await self.answer(request, from_body(SetNetworkRules))

    async def stop(self, request: web.Request) -> web.Response:
        link, sid = await self.owned(request)
        info = await link.stop(sid)
        await self.tenancy.release(sid)
        return respond(info)

    # -- commands -----------------------------------------------------------------------------

    async def shell(self, request: web.Request) -> web.Response:
        return await self.answer(request, from_body(RunShell))

    async def exec(self, request: web.Request) -> web.StreamResponse:
        link, sid = await self.owned(request)
        op = await read_body(request, Exec)
        op.stdin_bytes()  # bad base64 is the caller's 400 here, before the edge is asked
        events = link.stream(sid, op)
        try:
            first = await anext(events)  # errors before any output still become a proper 4xx/5xx
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            await resp.write(first.model_dump_json().encode() + b"\n")
            async for event in events:
                await resp.write(event.model_dump_json().encode() + b"\n")
            await resp.write_eof()
            return resp
        finally:
            await events.aclose()  # kills the process tree if the client went away

    async def commit(self, request: web.Request) -> web.Response:
        return await self.answer(request, from_body(Commit), status=201)

    # -- files --------------------------------------------------------------------------------

    async def download(self, request: web.Request) -> web.StreamResponse:
        link, sid = await self.owned(request)
        return await stream_bytes(request, link.read_stream(sid, query_param(request, "path")))

    async def upload(self, request: web.Request) -> web.Response:
        link, sid = await self.owned(request)
        mode = file_mode_param(request)
        path = query_param(request, "path")
        info = await link.write_stream(sid, path, request.content.iter_chunked(_CHUNK), mode=mode)
        return respond(info, status=201)

    # The file routes of the earlier SDK take their op's fields as query parameters.

    async def stat(self, request: web.Request) -> web.Response:
        return await self.answer(request, lambda _: Stat(path=query_param(request, "path")))

    async def list_dir(self, request: web.Request) -> web.Response:
        return await self.answer(request, lambda _: ListDir(path=query_param(request, "path")))

    async def mkdir(self, request: web.Request) -> web.Response:
        def build(_: bytes) -> Mkdir:
            parents = flag_param(request, "parents", True)
            return Mkdir(path=query_param(request, "path"), parents=parents)

        return await self.answer(request, build, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        def build(_: bytes) -> Remove:
            recursive = flag_param(request, "recursive", False)
            return Remove(path=query_param(request, "path"), recursive=recursive)

        await self.forward(request, build)
        return respond({"removed": True})

    async def move(self, request: web.Request) -> web.Response:
        def build(_: bytes) -> Move:
            return Move(
                source=query_param(request, "source"), destination=query_param(request, "destination")
            )

        return await self.answer(request, build)
