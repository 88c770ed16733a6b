"""``POST /v1/sandboxes/{id}/ops/{kind}``: a sandbox operation as data on the public API.

The body is the op of ``kind`` (:mod:`dsec.protocol.ops`, the same JSON the apiserver sends an
edge), the answer is what the op names (``null`` for none). The route resolves the sandbox and
checks the key may see it once (:meth:`SandboxRoutes.owned`: another project's sandbox is not
found), then forwards the op unchanged to the sandbox's node, in this process or across the
network.

Only the kinds in :data:`~dsec.protocol.ops.PUBLIC` are served: those whose own REST route (kept for the SDK's
earlier releases) does no more than that check and forward. The others stay internal: a whole
fork takes sandbox IDs and quota the apiserver reserves, a fork spec names a layer the fork
route chooses, the xattrs carry the E2B front's metadata, and streams keep their NDJSON routes.
"""

from __future__ import annotations

from aiohttp import web

from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.ops import PUBLIC, Call, parse_op


class OpRoutes:
    def __init__(self, sandboxes: SandboxRoutes) -> None:
        self.sandboxes = sandboxes

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/sandboxes/{id}/ops/{kind}", self.op)

    async def op(self, request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        if kind not in PUBLIC:
            raise InvalidRequest(
                f"sandbox operation {kind[:64]!r} is not offered here; these are: {sorted(PUBLIC)}"
            )
        link, sid = await self.sandboxes.owned(request)
        op = parse_op(kind, await request.read())
        assert isinstance(op, Call)  # PUBLIC holds calls only (tests/unit/test_op_routes.py)
        answer = await link.call(sid, op)
        return web.Response(body=op.adapter.dump_json(answer), content_type="application/json")
