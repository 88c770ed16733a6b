"""The process table and directory watches on the public API: ``/v1/sandboxes/{id}/processes...``.

The edge's own routes (:mod:`dsec.edge.server_processes`), served by the apiserver for API
keys: each request is checked like any sandbox route (the key must see the sandbox) and goes
to the sandbox's node over its link, in this process or across the network. This is what
``dsec sandbox shell`` drives (a terminal the edge holds; input, resize and signals as calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.edge.server_processes import ProcessRoutes
from dsec.protocol.ops import Call

PREFIX = "/v1"
R = TypeVar("R")


class SandboxProcessRoutes(ProcessRoutes):
    def __init__(self, sandboxes: SandboxRoutes) -> None:  # no local link: each sandbox's own
        self.sandboxes = sandboxes

    async def target(self, request: web.Request) -> tuple[EdgeLink, str]:
        return await self.sandboxes.owned(request)

    async def forward(self, request: web.Request, build: Callable[[bytes], Call[R]]) -> R:
        return await self.sandboxes.forward(request, build)  # the path every sandbox op takes

    def register_public(self, r: web.UrlDispatcher) -> None:
        self.register(r, PREFIX)
