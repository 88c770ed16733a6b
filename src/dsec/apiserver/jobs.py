"""Routes for RL trainers: pause and resume (one sandbox or a whole job), job leases, fork,
and what a sandbox was asked to do (its trajectory) and changed (for grading).

Whole-job calls fan out as one request per node, like a bulk stop; a node that does not answer
is named in the result rather than skipped quietly.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL, read_body, respond
from dsec.apiserver.overflow_link import OverflowLink
from dsec.apiserver.sandboxes import WHOLE_FORK, SandboxRoutes, from_body
from dsec.images.store import LayerStore
from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.protocol.http import MAX_TRAJECTORY_PAGE, count_param, text_param
from dsec.protocol.models import (
    RESERVED_LABEL_PREFIX,
    ForkRequest,
    LeaseRequest,
    LeaseResult,
)
from dsec.protocol.ops import Changes, Pause, Resume, Screenshot, SendInput, Trajectory

_MAX_JOB_LEN = 256


class JobRoutes:
    def __init__(self, sandboxes: SandboxRoutes, store: LayerStore) -> None:
        self.sandboxes = sandboxes
        self.store = store

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/sandboxes/pause", self.pause_all)
        r.add_post("/v1/sandboxes/resume", self.resume_all)
        r.add_post("/v1/sandboxes/{id}/pause", self.pause)
        r.add_post("/v1/sandboxes/{id}/resume", self.resume)
        r.add_post("/v1/sandboxes/{id}/fork", self.fork)
        r.add_get("/v1/sandboxes/{id}/trajectory", self.trajectory)
        r.add_get("/v1/sandboxes/{id}/changes", self.changes)
        r.add_post("/v1/jobs/{job}/lease", self.renew_lease)
        r.add_get("/v1/sandboxes/{id}/screenshot", self.screenshot)
        r.add_post("/v1/sandboxes/{id}/input", self.send_input)

    async def pause_all(self, request: web.Request) -> web.Response:
        return respond(await self.sandboxes.bulk(request, "pause"))

    async def resume_all(self, request: web.Request) -> web.Response:
        return respond(await self.sandboxes.bulk(request, "resume"))

    # Each call below builds its op (dsec.protocol.ops) and forwards it: SandboxRoutes.forward.

    async def pause(self, request: web.Request) -> web.Response:
        return await self.sandboxes.answer(request, lambda _: Pause())

    async def resume(self, request: web.Request) -> web.Response:
        return await self.sandboxes.answer(request, lambda _: Resume())

    async def trajectory(self, request: web.Request) -> web.Response:
        def build(_: bytes) -> Trajectory:
            after = count_param(request, "after", 0)
            limit = count_param(request, "limit", 1000, maximum=MAX_TRAJECTORY_PAGE)
            return Trajectory(after=after, limit=limit)

        return await self.sandboxes.answer(request, build)

    async def changes(self, request: web.Request) -> web.Response:
        def build(_: bytes) -> Changes:
            return Changes(under=text_param(request, "under", "/"))

        return await self.sandboxes.answer(request, build)

    async def fork(self, request: web.Request) -> web.Response:
        """``count`` new sandboxes with the sandbox's disk state: its changes are packed once
        as a layer (``dsec-fork/<id>:<n>``) and every copy starts from its layers plus that one,
        created all or none like a batch."""
        link, sid = await self.sandboxes.owned(request)
        req = await read_body(request, ForkRequest)
        source = await link.get(sid)
        overflow = self.sandboxes.overflow
        if overflow is not None and isinstance(link, OverflowLink):  # made where the source runs
            made = await overflow.fork(self.sandboxes.tenancy, request[PRINCIPAL], link, source, req)
            return respond(made, status=201)
        if source.backend in WHOLE_FORK:
            made = await self.sandboxes.fork_whole(request[PRINCIPAL], link, source, req.count, req.labels)
            return respond(made, status=201)
        if req.processes:
            raise InvalidRequest(
                "fork(processes=True): this node cannot checkpoint a container's processes (no"
                " working CRIU); fork copies the disk state only (capability fork_processes=false)"
            )
        spec, layer = await link.fork_spec(sid, f"dsec-fork/{sid}")
        own = {k: v for k, v in spec.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)}
        clean = spec.model_copy(update={"labels": own if req.labels is None else req.labels})
        principal = request[PRINCIPAL]
        admitted = self.sandboxes.tenancy.admit(principal, source.project, clean)
        try:
            made = await self.sandboxes.create_many(principal, admitted, req.count, req.timeout)
        finally:
            # The copies name the packed layer by digest and hold it mounted: its tag would
            # only keep the blob in the store after the last copy is gone (gc takes it then).
            for ref in (n for n in layer.names if n.startswith(f"dsec-fork/{sid}:")):
                with contextlib.suppress(DSecError):
                    await asyncio.to_thread(self.store.untag, ref)
        return respond(made, status=201)

    async def screenshot(self, request: web.Request) -> web.Response:
        image = await self.sandboxes.forward(request, lambda _: Screenshot())
        return web.Response(body=image.png, content_type="image/png")

    async def send_input(self, request: web.Request) -> web.Response:
        return respond({"sent": await self.sandboxes.forward(request, from_body(SendInput))})

    async def renew_lease(self, request: web.Request) -> web.Response:
        """Renew job ``job``'s lease on every node that holds one of its sandboxes."""
        job = request.match_info["job"]
        if not job or len(job) > _MAX_JOB_LEN:
            raise InvalidRequest(f"job names are 1-{_MAX_JOB_LEN} characters")
        req = await read_body(request, LeaseRequest)
        within = request[PRINCIPAL].project
        links = self.sandboxes.links
        names = list(links)
        answers = await asyncio.gather(
            *(links[n].renew_lease(job, req.lease_s, within) for n in names), return_exceptions=True
        )
        result = LeaseResult(job=job, expires_at=0.0)
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, tuple):
                result.sandboxes += answer[0]
                result.expires_at = max(result.expires_at, answer[1])
            elif isinstance(answer, Exception):
                result.unreachable_nodes.append(name)
            else:
                raise answer
        return respond(result)
