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
from dsec.apiserver.console import is_console_path, register_console
from dsec.apiserver.e2b import E2BFront, E2BOptions
from dsec.apiserver.e2b.envd import is_envd_path
from dsec.apiserver.e2b.front import e2b_errors_middleware
from dsec.apiserver.e2b.templates import is_template_upload_path
from dsec.apiserver.e2b.volumes import is_volume_content_path
from dsec.apiserver.fncall import FnCallRoutes
from dsec.apiserver.jobs import JobRoutes
from dsec.apiserver.layer_access import LayerLimits, layer_viewer
from dsec.apiserver.op_routes import OpRoutes
from dsec.apiserver.overflow import Overflow
from dsec.apiserver.port_routes import PortRoutes
from dsec.apiserver.processes import SandboxProcessRoutes
from dsec.apiserver.projects import ProjectRoutes, sync_storage_quotas
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.apiserver.tenancy import Tenancy
from dsec.apiserver.vm_images import VmImageRoutes, vm_image_store
from dsec.apiserver.volumes import VolumeApi, VolumeDirectory
from dsec.edge.link import EdgeLink
from dsec.iam import IamStore
from dsec.images.oci import import_oci
from dsec.images.store import LayerStore
from dsec.observe.api_metrics import ApiMetrics
from dsec.observe.audit import AUDIT_KEY, AuditLog, audited
from dsec.observe.logs import echo_request_id, request_middleware
from dsec.observe.metrics import serve_metrics
from dsec.placement.placement import Placement
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.http import client_went
from dsec.protocol.models import (
    GcRequest,
    LayerInfo,
    RetagRequest,
    invalid_request,
)

log = logging.getLogger("dsec.apiserver")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CHUNK = 1 << 20
CLUSTER_PREFIX = "/cluster/v1/"
_MAX_MERGE_MB = 1 << 20


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
            InvalidRequest(exc.reason)
            if exc.status < 500
            else InfraFailure(exc.reason, reason=InfraReason.http)
        )
        return web.json_response(wrapped.to_wire(), status=exc.status)
    except Exception as exc:
        if (went := client_went(request, exc)) is not None:
            return went
        log.exception("unhandled error on %s %s", request.method, request.path)
        infra = InfraFailure(f"internal error: {type(exc).__name__}: {exc}", reason=InfraReason.apiserver)
        return web.json_response(infra.to_wire(), status=500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(CLUSTER_PREFIX):
        return await handler(request)  # edges, with the cluster secret (apiserver/membership.py)
    if is_envd_path(request.path):
        return await handler(request)  # E2B's in-sandbox API: a sandbox's envd token (e2b/tokens.py)
    if is_template_upload_path(request.path):
        return await handler(request)  # a one-time upload link E2B's SDK PUTs to, keyless
    if is_volume_content_path(request.path):
        return await handler(request)  # E2B's volume content API: the volume's token (e2b/volumes.py)
    if is_console_path(request.path):
        return await handler(request)  # static pages; its terminal checks the key (apiserver/console/)
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
        layer_limits: LayerLimits | None = None,
        audit: AuditLog | None = None,
        overflow: Overflow | None = None,
    ) -> None:
        self.edges = edges
        self.audit = audit or AuditLog(None)  # None: admin actions go to the log only
        self.placement = placement
        self.store = store
        self.iam = iam
        self.layer_limits = layer_limits or LayerLimits()
        self.tenancy = Tenancy(iam)
        self.sandboxes = SandboxRoutes(edges, placement, self.tenancy, store, overflow=overflow)
        self.fncalls = FnCallRoutes(edges, placement, overflow)
        self.e2b = E2BFront(self.sandboxes, store, e2b)
        self.prom = ApiMetrics(placement, edges)  # its own registry: an edge may share the process

    def app(self) -> web.Application:
        app = web.Application(
            # The request's ID first: sandbox traffic (a port tunnel) carries one as every request
            # does. Then sandbox traffic: its paths are the sandbox's, and it carries no API key.
            middlewares=[
                request_middleware("apiserver"),  # outside the errors: it sees every answer
                self.e2b.traffic.middleware,
                errors_middleware,
                e2b_errors_middleware,
                auth_middleware,
            ],
            client_max_size=64 << 20,
        )
        app[IAM_KEY] = self.iam
        app[AUDIT_KEY] = self.audit
        app.on_response_prepare.append(echo_request_id)  # X-Request-ID on every answer
        r = app.router
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/nodes", self.nodes)
        serve_metrics(app, self.prom, require_admin)  # GET /metrics, Prometheus (observe/api_metrics.py)
        # aiohttp tries a path's routes in the order they were added, a regex each: the op route,
        # what the SDK sends every operation to, goes before the REST routes beside it.
        OpRoutes(self.sandboxes).register(r)  # any operation as data: apiserver/op_routes.py
        self.sandboxes.register(r)
        SandboxProcessRoutes(self.sandboxes).register_public(r)  # terminals: apiserver/processes.py
        PortRoutes(self.sandboxes).register(r)  # a sandbox's TCP port: apiserver/port_routes.py
        JobRoutes(self.sandboxes, self.store).register(r)
        self.fncalls.register(r)
        r.add_get("/v1/layers", self.layers)
        r.add_post("/v1/layers", self.import_layer)
        r.add_post("/v1/images", self.import_image)
        r.add_post("/v1/layers/retag", self.retag)
        r.add_delete("/v1/layers", self.untag)
        r.add_post("/v1/layers/verify", self.verify)
        r.add_post("/v1/layers/public", self.mark_public)
        r.add_post("/v1/layers/gc", self.gc)
        VmImageRoutes(self.store).register(r)
        ProjectRoutes(self.iam, self.store).register(r)
        VolumeApi(VolumeDirectory(self.sandboxes.links, self.placement)).register(r)  # apiserver/volumes.py
        app.on_startup.append(lambda _: sync_storage_quotas(self.iam, self.store))
        register_console(r, self.sandboxes, self.iam)  # the web console: apiserver/console/
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
        """The layers the key's project and its sub-projects own, and the public ones."""
        viewer = layer_viewer(request[PRINCIPAL])
        return respond(await asyncio.to_thread(lambda: self.store.list(viewer=viewer)))

    async def import_image(self, request: web.Request) -> web.StreamResponse:
        """Import an OCI image (docker save, or an OCI layout tarball) streamed as the body.

        Answers with NDJSON: ``{"t": "progress", ...}`` lines as the import goes, then one
        ``{"t": "done", "layers": [...]}`` or ``{"t": "error", "error": {...}}``.
        """
        ref = query_param(request, "ref")
        try:
            merge_mb = float(request.query.get("merge_below_mb", "0"))
        except ValueError as exc:
            raise InvalidRequest("merge_below_mb must be a number") from exc
        # "inf" and 1e400 parse as floats (int() of them raised a 500); a layer is below 1 TiB.
        if not 0 <= merge_mb <= _MAX_MERGE_MB:
            raise InvalidRequest(f"merge_below_mb must be from 0 to {_MAX_MERGE_MB}")
        merge_below = int(merge_mb * (1 << 20))
        selector = request.query.get("image") or None
        principal = request[PRINCIPAL]
        await asyncio.to_thread(self.store.check_name, ref, layer_viewer(principal))  # before the upload
        limits = self.layer_limits
        async with body_to_file(
            request, self.store.tmp_dir, ".tar", max_bytes=limits.max_upload_bytes
        ) as upload:
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
                    owner=principal.project,
                    viewer=layer_viewer(principal),
                    max_bytes=limits.expand_cap(upload.stat().st_size),
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
                final = {
                    "t": "error",
                    **InfraFailure(f"import failed: {exc}", reason=InfraReason.storage).to_wire(),
                }
            await resp.write(json.dumps(final).encode() + b"\n")
            await resp.write_eof()
            return resp

    @audited("layer.retag", body=("ref", "target"))
    async def retag(self, request: web.Request) -> web.Response:
        """Move (or create) a tag: one of the key's subtree, to layers the key may see."""
        req: RetagRequest = await read_body(request, RetagRequest)
        principal = request[PRINCIPAL]
        viewer = layer_viewer(principal)
        return respond(
            await asyncio.to_thread(
                lambda: self.store.retag(req.ref, req.target, owner=principal.project, viewer=viewer)
            )
        )

    @audited("layer.untag", query=("ref",))
    async def untag(self, request: web.Request) -> web.Response:
        viewer = layer_viewer(request[PRINCIPAL])
        ref = query_param(request, "ref")
        digests = await asyncio.to_thread(lambda: self.store.untag(ref, viewer=viewer))
        return respond({"untagged": digests})

    async def verify(self, request: web.Request) -> web.Response:
        viewer = layer_viewer(request[PRINCIPAL])
        ref = query_param(request, "ref")
        return respond(await asyncio.to_thread(lambda: self.store.verify(ref, viewer=viewer)))

    @audited("layer.mark_public", query=("ref",))
    async def mark_public(self, request: web.Request) -> web.Response:
        """Make a layer or image (``?ref=``) usable by every project (admin keys only)."""
        require_admin(request)
        viewer = layer_viewer(request[PRINCIPAL])
        ref = query_param(request, "ref")

        def mark() -> list[LayerInfo]:
            self.store.resolve_image(ref, viewer=viewer)  # the admin's own scope: not found else
            return self.store.mark_public(ref)

        return respond(await asyncio.to_thread(mark))

    @audited("layer.gc", body=("grace_s",))
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
        """Import a tar archive streamed as the request body as layer ``?ref=name:version``,
        owned by the key's project; capped in upload and in expanded size (413 past either)."""
        ref = query_param(request, "ref")
        principal = request[PRINCIPAL]
        viewer = layer_viewer(principal)
        await asyncio.to_thread(
            self.store.check_name, ref, viewer
        )  # before the upload: the name may be taken
        limits = self.layer_limits
        async with body_to_file(
            request, self.store.tmp_dir, ".tar", max_bytes=limits.max_upload_bytes
        ) as upload:
            cap = limits.expand_cap(upload.stat().st_size)
            info = await asyncio.to_thread(
                lambda: self.store.import_path(
                    upload, ref, owner=principal.project, viewer=viewer, max_bytes=cap
                )
            )
        return respond(info, status=201)
