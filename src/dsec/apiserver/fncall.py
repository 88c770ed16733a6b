"""FnCall routes: one short stateless call, placed on a node with a warm pool.

``POST /v1/fncall`` takes a :class:`FnCallRequest` and answers the :class:`FnResult`.
``POST /sandboxfusion/{key}/run_code`` speaks SandboxFusion's schema (see
``apiserver/sandboxfusion.py``), so an existing SandboxFusion client only changes its URL;
the API key rides in that URL because such clients send no headers of their own.

Calls go through placement like creates (nodes that offer the ``fncall`` backend, power of
k on load) and move to another node when one refuses (no such pool, or all its sandboxes
busy past the queue timeout) or cannot be reached; when no node here serves it, to an
overflow target's ``/v1/fncall`` (:meth:`~dsec.apiserver.overflow.Overflow.fncall`). Pool
sandboxes belong to the edge, so a call holds no quota of the caller's project.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver._http import read_body, respond
from dsec.apiserver.overflow import Overflow
from dsec.apiserver.sandboxes import attempt_on
from dsec.apiserver.sandboxfusion import RunCodeRequest, RunCodeResponse, Unsupported, from_result, to_task
from dsec.edge.link import EdgeLink
from dsec.placement.placement import Placement
from dsec.protocol.errors import CapacityExhausted, DSecError
from dsec.protocol.fncall import FnResult, FnTask

FNCALL_BACKEND = "fncall"


class FnCallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: FnTask
    pool: str | None = Field(
        default=None, pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$", description="None: by the task's language"
    )
    timeout: float = Field(default=600, gt=0, le=3600, description="for placement and the call")


class FnCallRoutes:
    def __init__(
        self, links: Mapping[str, EdgeLink], placement: Placement, overflow: Overflow | None = None
    ) -> None:
        self.links = links
        self.placement = placement
        self.overflow = overflow  # where a call goes when no node here serves it

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/fncall", self.fncall)
        r.add_post("/sandboxfusion/{sf_key}/run_code", self.run_code)

    async def fncall(self, request: web.Request) -> web.Response:
        req: FnCallRequest = await read_body(request, FnCallRequest)
        _, result = await self.call(req.task, req.pool, req.timeout)
        return respond(result)

    async def run_code(self, request: web.Request) -> web.Response:
        """SandboxFusion answers 200 with ``SandboxError`` for what it cannot run; so do we."""
        sf: RunCodeRequest = await read_body(request, RunCodeRequest)
        try:
            task = to_task(sf)
            node, result = await self.call(task, None, task.compile_timeout_s + task.run_timeout_s + 60)
        except (Unsupported, DSecError, TimeoutError) as exc:
            why = str(exc) or "timed out waiting for a free sandbox"
            return respond(RunCodeResponse(status="SandboxError", message=why))
        return respond(from_result(result, node))

    async def call(self, task: FnTask, pool: str | None, timeout: float) -> tuple[str, FnResult]:
        tried: set[str] = set()
        async with asyncio.timeout(timeout):
            while True:
                try:
                    node = await self.placement.choose(FNCALL_BACKEND, tried)
                except CapacityExhausted:
                    made = None if self.overflow is None else await self.overflow.fncall(task, pool)
                    if made is None:
                        raise
                    return made
                call = functools.partial(self.links[node].fncall, task, pool)
                result = await attempt_on(self.placement, node, tried, call)
                if result is not None:
                    return node, result
