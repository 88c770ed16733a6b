"""``GET /v1/sandboxes/{id}/ports/{port}``: a TCP port in a sandbox as a WebSocket, for API keys.

The same protocol as the edge's own port route (:func:`dsec.edge.ports.serve_port`): the first
message is ``open`` or a DSec error body with its ``status``, then binary messages are the
bytes both ways, the text ``eof`` a half-close. The key must see the sandbox, as on every
sandbox route (another project's sandbox is not found, inside the socket like a closed port).

It is what another cluster's apiserver opens to reach a port of the sandboxes it overflowed
here (:meth:`dsec.apiserver.overflow_link.OverflowLink.open_port`: E2B's traffic to a port, at
the home cluster), and a plain client may use it too.
"""

from __future__ import annotations

from aiohttp import web

from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.ports import PortStream, port_param, serve_port


class PortRoutes:
    def __init__(self, sandboxes: SandboxRoutes) -> None:
        self.sandboxes = sandboxes

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/sandboxes/{id}/ports/{port}", self.port)

    async def port(self, request: web.Request) -> web.StreamResponse:
        port = port_param(request)  # a bad number is a plain 400, before the upgrade

        async def opening() -> PortStream:
            link, sid = await self.sandboxes.owned(request)
            return await link.open_port(sid, port)

        return await serve_port(request, opening())
