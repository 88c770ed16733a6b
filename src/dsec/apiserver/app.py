"""The HTTP API: the only path from trusted clients to sandboxes.

It keeps no per-sandbox state: every request names a sandbox ID, the ID names its node and
that node's epoch, and the request goes straight there. Creates go through placement and are
retried on another node when an edge rejects them for capacity.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from dsec.apiserver._http import (
    IAM_KEY,
    PRINCIPAL,
    body_to_file,
    query_param,
    read_body,
    require_admin,
    respond,
)
from dsec.apiserver.e2b import E2BFront, E2BOptions
from dsec.apiserver.e2b.envd import is_envd_path
from dsec.apiserver.e2b.front import e2b_errors_middleware
from dsec.apiserver.fncall import FnCallRoutes
from dsec.apiserver.jobs import JobRoutes
from dsec.apiserver.projects import ProjectRoutes
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.apiserver.tenancy import Tenancy
from dsec.apiserver.vm_images import VmImageRoutes, vm_image_store
from dsec.edge.link import EdgeLink
from dsec.iam import IamStore
from dsec.images.oci import import_oci
from dsec.images.store import LayerStore
from dsec.placement.placement import Placement
from dsec.protocol.errors import (
    DSecError,
    InfraFailure,
    InvalidRequest,
)
from dsec.protocol.models import (
    GcRequest,
    RetagRequest,
    invalid_request,
)

log = logging.getLogger("dsec.apiserver")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CHUNK = 1 << 20
CLUSTER_PREFIX = "/cluster/v1/"


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
    if request.path.startswith(CLUSTER_PREFIX):
        return await handler(request)  # edges, with the cluster secret (apiserver/membership.py)
    if is_envd_path(request.path):
        return await handler(request)  # E2B's in-sandbox API: a sandbox's envd token (e2b/tokens.py)
    header = request.headers.get("Authorization", "")
    key = header[7:] if header.startswith("Bearer ") else request.headers.get("X-API-Key")
    # SandboxFusion clients send no headers: their URL carries the key (apiserver/fncall.py).
    key = request.match_info.get("sf_key") or key
    request[PRINCIPAL] = await request.app[IAM_KEY].authenticate(key)
    return await handler(request)


class ApiServer:
    def __init__(
        self,
        edges: Mapping[str, EdgeLink],
        placement: Placement,
        store: LayerStore,
        iam: IamStore,
        *,
        e2b: E2BOptions | None = None,
    ) -> None:
        self.edges = edges
        self.placement = placement
        self.store = store
        self.iam = iam
        self.tenancy = Tenancy(iam)
        self.sandboxes = SandboxRoutes(edges, placement, self.tenancy)
        self.fncalls = FnCallRoutes(edges, placement)
        self.e2b = E2BFront(self.sandboxes, store, e2b)

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[errors_middleware, e2b_errors_middleware, auth_middleware], client_max_size=64 << 20
        )
        app[IAM_KEY] = self.iam
        r = app.router
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/nodes", self.nodes)
        self.sandboxes.register(r)
        JobRoutes(self.sandboxes, self.store).register(r)
        self.fncalls.register(r)
        r.add_get("/v1/layers", self.layers)
        r.add_post("/v1/layers", self.import_layer)
        r.add_post("/v1/images", self.import_image)
        r.add_post("/v1/layers/retag", self.retag)
        r.add_delete("/v1/layers", self.untag)
        r.add_post("/v1/layers/verify", self.verify)
        r.add_post("/v1/layers/gc", self.gc)
        VmImageRoutes(self.store).register(r)
        ProjectRoutes(self.iam).register(r)
        self.e2b.register(r)
        app.on_cleanup.append(lambda _: self.e2b.close())
        return app

    async def health(self, request: web.Request) -> web.Response:
        return respond({"ok": True, "nodes": self.placement.watcher.snapshot})

    async def nodes(self, request: web.Request) -> web.Response:
        """The registry joined with the watcher's latest poll of each node (admin keys only)."""
        require_admin(request)
        snapshot = self.placement.watcher.snapshot
        return respond(
            [
                {
                    "node": n.node,
                    "url": n.url,
                    "epoch": n.epoch,
                    "registered_at": n.registered_at,
                    "last_seen": n.last_seen,
                    **snapshot.get(n.node, {"healthy": False}),
                }
                for n in await self.iam.list_nodes()
            ]
        )

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
        async with body_to_file(request, self.store.tmp_dir, ".tar") as upload:
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
                    upload,
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
        # Every node must answer: a blob an unreachable node still uses must not go.
        reports = await asyncio.gather(*(e.layers_in_use(unmount_idle=True) for e in self.edges.values()))
        in_use = set().union(*reports)
        removed = await asyncio.to_thread(self.store.gc, in_use, grace_s=req.grace_s)
        # Imported VM images too: edges count the ones their VMs boot from as in use.
        images = vm_image_store(self.store)
        grace = 600.0 if req.grace_s is None else req.grace_s
        removed += await asyncio.to_thread(images.gc, in_use, grace_s=grace)
        return respond({"removed": removed, "in_use": sorted(in_use)})

    async def import_layer(self, request: web.Request) -> web.Response:
        """Import a tar archive streamed as the request body as layer ``?ref=name:version``."""
        ref = query_param(request, "ref")
        async with body_to_file(request, self.store.tmp_dir, ".tar") as upload:
            info = await asyncio.to_thread(self.store.import_path, upload, ref)
        return respond(info, status=201)
