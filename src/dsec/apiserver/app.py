"""The HTTP API: the only path from trusted clients to sandboxes.

It keeps no per-sandbox state: every request names a sandbox ID, the ID names its node and
that node's epoch, and the request goes straight there. Creates go through placement and are
retried on another node when an edge rejects them for capacity.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from dsec.apiserver._http import (
    IAM_KEY,
    PRINCIPAL,
    label_filter,
    query_param,
    read_body,
    require_admin,
    respond,
)
from dsec.apiserver.projects import ProjectRoutes
from dsec.apiserver.tenancy import Tenancy
from dsec.edge.edge import Edge
from dsec.iam import IamStore
from dsec.images.oci import import_oci
from dsec.images.store import LayerStore
from dsec.placement.placement import Placement
from dsec.protocol.errors import (
    CapacityExhausted,
    DSecError,
    InfraFailure,
    InvalidRequest,
    SandboxNotFound,
)
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    CommitRequest,
    ContainerSpec,
    CreateRequest,
    ExecRequest,
    GcRequest,
    RetagRequest,
    SandboxInfo,
    ShellRequest,
    invalid_request,
)

log = logging.getLogger("dsec.apiserver")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CHUNK = 1 << 20


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DSecError as exc:
        return web.json_response(exc.to_wire(), status=exc.status)
    except ValidationError as exc:
        err = invalid_request(exc)
        return web.json_response(err.to_wire(), status=err.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        wrapped: DSecError = (
            InvalidRequest(exc.reason) if exc.status < 500 else InfraFailure(exc.reason, reason="http")
        )
        return web.json_response(wrapped.to_wire(), status=exc.status)
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        infra = InfraFailure(f"internal error: {type(exc).__name__}: {exc}", reason="apiserver")
        return web.json_response(infra.to_wire(), status=500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    header = request.headers.get("Authorization", "")
    key = header[7:] if header.startswith("Bearer ") else request.headers.get("X-API-Key")
    request[PRINCIPAL] = await request.app[IAM_KEY].authenticate(key)
    return await handler(request)


class ApiServer:
    def __init__(
        self, edges: dict[str, Edge], placement: Placement, store: LayerStore, iam: IamStore
    ) -> None:
        self.edges = edges
        self.placement = placement
        self.store = store
        self.iam = iam
        self.tenancy = Tenancy(iam)

    def edge_for(self, sandbox_id: str) -> Edge:
        sid = SandboxId.parse(sandbox_id)
        edge = self.edges.get(sid.node)
        if edge is None:
            raise SandboxNotFound(f"sandbox {sandbox_id}: node {sid.node!r} is not part of this cluster")
        if edge.epoch != sid.epoch:
            raise SandboxNotFound(
                f"sandbox {sandbox_id} belonged to an earlier incarnation of node {sid.node!r}"
                f" (epoch {sid.epoch}, now {edge.epoch}): it no longer exists"
            )
        return edge

    def owned(self, request: web.Request) -> tuple[Edge, str]:
        """The sandbox a request names, if the request's key may see it (else: not found)."""
        sid = request.match_info["id"]
        edge = self.edge_for(sid)
        self.tenancy.check_visible(request[PRINCIPAL], edge.get(sid))
        return edge, sid

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=64 << 20)
        app[IAM_KEY] = self.iam
        r = app.router
        r.add_get("/v1/health", self.health)
        r.add_post("/v1/sandboxes", self.create)
        r.add_get("/v1/sandboxes", self.list)
        r.add_delete("/v1/sandboxes", self.stop_by_label)
        r.add_get("/v1/sandboxes/{id}", self.get)
        r.add_delete("/v1/sandboxes/{id}", self.stop)
        r.add_post("/v1/sandboxes/{id}/shell", self.shell)
        r.add_post("/v1/sandboxes/{id}/exec", self.exec)
        r.add_post("/v1/sandboxes/{id}/commit", self.commit)
        r.add_get("/v1/sandboxes/{id}/files/content", self.download)
        r.add_put("/v1/sandboxes/{id}/files/content", self.upload)
        r.add_get("/v1/sandboxes/{id}/files/stat", self.stat)
        r.add_get("/v1/sandboxes/{id}/files/list", self.list_dir)
        r.add_post("/v1/sandboxes/{id}/files/mkdir", self.mkdir)
        r.add_delete("/v1/sandboxes/{id}/files", self.remove)
        r.add_get("/v1/layers", self.layers)
        r.add_post("/v1/layers", self.import_layer)
        r.add_post("/v1/images", self.import_image)
        r.add_post("/v1/layers/retag", self.retag)
        r.add_delete("/v1/layers", self.untag)
        r.add_post("/v1/layers/verify", self.verify)
        r.add_post("/v1/layers/gc", self.gc)
        ProjectRoutes(self.iam).register(r)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return respond({"ok": True, "nodes": self.placement.watcher.snapshot})

    # -- sandboxes --------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        req: CreateRequest = await read_body(request, CreateRequest)
        token, spec = await self.tenancy.reserve(request[PRINCIPAL], req.project, req.spec)
        try:
            info = await self._place(spec, req.timeout)
        except BaseException:
            await asyncio.shield(self.tenancy.release(token))
            raise
        await self.tenancy.bind(token, info)
        return respond(info, status=201)

    async def _place(self, spec: ContainerSpec, timeout: float) -> SandboxInfo:
        tried: set[str] = set()
        async with asyncio.timeout(timeout):
            while True:
                node = self.placement.choose(spec.type, tried)
                with self.placement.reserve(node):
                    try:
                        return await self.edges[node].create(spec)
                    except CapacityExhausted:
                        tried.add(node)  # the edge has the final word; try the next node

    def _listed(self, request: web.Request) -> list[SandboxInfo]:
        labels = label_filter(request)
        everything = [info for edge in self.edges.values() for info in edge.list_sandboxes(labels)]
        return self.tenancy.visible(request[PRINCIPAL], everything)

    async def list(self, request: web.Request) -> web.Response:
        return respond(self._listed(request))

    async def stop_by_label(self, request: web.Request) -> web.Response:
        """Stop every sandbox carrying all the given labels, on every node: "this job is gone"."""
        if not label_filter(request):
            raise InvalidRequest("give at least one label=key=value: stopping everything is not a bulk call")
        targets = [(self.edge_for(info.id), info.id) for info in self._listed(request)]
        results = await asyncio.gather(*(edge.stop(sid) for edge, sid in targets), return_exceptions=True)
        for sid, result in zip((sid for _, sid in targets), results, strict=True):
            if not isinstance(result, BaseException):
                await self.tenancy.release(sid)
        stopped = [r for r in results if not isinstance(r, BaseException)]
        failed = {
            sid: str(r) for (_, sid), r in zip(targets, results, strict=True) if isinstance(r, BaseException)
        }
        return respond({"stopped": [i.model_dump(mode="json") for i in stopped], "failed": failed})

    async def get(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        return respond(edge.get(sid))

    async def stop(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        info = await edge.stop(sid)
        await self.tenancy.release(sid)
        return respond(info)

    async def shell(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        req: ShellRequest = await read_body(request, ShellRequest)
        return respond(await edge.run_shell(sid, req))

    async def exec(self, request: web.Request) -> web.StreamResponse:
        edge, sid = self.owned(request)
        req: ExecRequest = await read_body(request, ExecRequest)
        try:
            stdin = base64.b64decode(req.stdin_b64, validate=True) if req.stdin_b64 is not None else None
        except ValueError as exc:
            raise InvalidRequest("stdin_b64 is not valid base64") from exc
        events = edge.exec_stream(
            sid,
            req.argv,
            stdin=stdin,
            env=req.env,
            cwd=req.cwd,
            timeout=req.timeout,
            max_output=req.max_output_bytes,
        )
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
        edge, sid = self.owned(request)
        req: CommitRequest = await read_body(request, CommitRequest)
        return respond(await edge.commit(sid, req), status=201)

    # -- files ------------------------------------------------------------------------------

    async def download(self, request: web.Request) -> web.StreamResponse:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        path = query_param(request, "path")
        fh = await asyncio.to_thread(files.open_read, path)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await resp.prepare(request)
            while chunk := await asyncio.to_thread(fh.read, _CHUNK):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            fh.close()

    async def upload(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        path = query_param(request, "path")
        try:
            mode = int(request.query.get("mode", "644"), 8)
        except ValueError as exc:
            raise InvalidRequest("mode must be octal, e.g. 644") from exc
        writer = await asyncio.to_thread(files.open_write, path, mode)
        try:
            async for chunk in request.content.iter_chunked(_CHUNK):
                await asyncio.to_thread(writer.write, chunk)
            await asyncio.to_thread(writer.commit)
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        return respond(await asyncio.to_thread(files.stat, path), status=201)

    async def stat(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        return respond(await asyncio.to_thread(files.stat, query_param(request, "path")))

    async def list_dir(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        return respond(await asyncio.to_thread(files.list_dir, query_param(request, "path")))

    async def mkdir(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        path = query_param(request, "path")
        parents = request.query.get("parents", "true") == "true"
        await asyncio.to_thread(files.mkdir, path, parents)
        return respond(await asyncio.to_thread(files.stat, path), status=201)

    async def remove(self, request: web.Request) -> web.Response:
        edge, sid = self.owned(request)
        files = edge.files(sid)
        recursive = request.query.get("recursive", "false") == "true"
        await asyncio.to_thread(files.remove, query_param(request, "path"), recursive)
        return respond({"removed": True})

    # -- layers -----------------------------------------------------------------------------

    async def layers(self, request: web.Request) -> web.Response:
        return respond(await asyncio.to_thread(self.store.list))

    async def import_image(self, request: web.Request) -> web.StreamResponse:
        """Import an OCI image (docker save, or an OCI layout tarball) streamed as the body.

        Answers with NDJSON: ``{"t": "progress", ...}`` lines as the import goes, then one
        ``{"t": "done", "layers": [...]}`` or ``{"t": "error", "error": {...}}``.
        """
        ref = query_param(request, "ref")
        try:
            merge_below = int(float(request.query.get("merge_below_mb", "0")) * (1 << 20))
        except ValueError as exc:
            raise InvalidRequest("merge_below_mb must be a number") from exc
        selector = request.query.get("image") or None
        with tempfile.NamedTemporaryFile(dir=self.store.tmp_dir, suffix=".tar") as tmp:
            async for chunk in request.content.iter_chunked(_CHUNK):
                await asyncio.to_thread(tmp.write, chunk)
            await asyncio.to_thread(tmp.flush)
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

            def progress(stage: str, done: int, total: int) -> None:  # called in the import thread
                loop.call_soon_threadsafe(
                    events.put_nowait, {"t": "progress", "stage": stage, "done": done, "total": total}
                )

            job = asyncio.create_task(
                asyncio.to_thread(
                    import_oci,
                    self.store,
                    Path(tmp.name),
                    ref,
                    merge_below_bytes=merge_below,
                    progress=progress,
                    image=selector,
                )
            )
            while not job.done() or not events.empty():
                getter = asyncio.create_task(events.get())
                await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    await resp.write(json.dumps(getter.result()).encode() + b"\n")
                else:
                    getter.cancel()
            try:
                layers = job.result()
                final: dict[str, Any] = {"t": "done", "layers": [x.model_dump(mode="json") for x in layers]}
            except DSecError as exc:
                final = {"t": "error", **exc.to_wire()}
            except Exception as exc:
                log.exception("image import %s failed", ref)
                final = {"t": "error", **InfraFailure(f"import failed: {exc}", reason="storage").to_wire()}
            await resp.write(json.dumps(final).encode() + b"\n")
            await resp.write_eof()
            return resp

    async def retag(self, request: web.Request) -> web.Response:
        require_admin(request)
        req: RetagRequest = await read_body(request, RetagRequest)
        return respond(await asyncio.to_thread(self.store.retag, req.ref, req.target))

    async def untag(self, request: web.Request) -> web.Response:
        require_admin(request)
        digests = await asyncio.to_thread(self.store.untag, query_param(request, "ref"))
        return respond({"untagged": digests})

    async def verify(self, request: web.Request) -> web.Response:
        return respond(await asyncio.to_thread(self.store.verify, query_param(request, "ref")))

    async def gc(self, request: web.Request) -> web.Response:
        """Delete blobs no tag names and no node uses; every edge reports what it has mounted."""
        require_admin(request)
        req: GcRequest = await read_body(request, GcRequest)
        in_use = set().union(*(edge.layers_in_use(unmount_idle=True) for edge in self.edges.values()))
        removed = await asyncio.to_thread(self.store.gc, in_use, grace_s=req.grace_s)
        return respond({"removed": removed, "in_use": sorted(in_use)})

    async def import_layer(self, request: web.Request) -> web.Response:
        """Import a tar archive streamed as the request body as layer ``?ref=name:version``."""
        ref = query_param(request, "ref")
        with tempfile.NamedTemporaryFile(dir=self.store.tmp_dir, suffix=".tar") as tmp:
            async for chunk in request.content.iter_chunked(_CHUNK):
                await asyncio.to_thread(tmp.write, chunk)
            await asyncio.to_thread(tmp.flush)
            info = await asyncio.to_thread(self.store.import_path, Path(tmp.name), ref)
        return respond(info, status=201)
