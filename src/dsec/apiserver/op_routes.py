"""``POST /v1/sandboxes/{id}/ops/{kind}``: a sandbox operation as data on the public API.

The body is the op of ``kind`` (:mod:`dsec.protocol.ops`, the same JSON the apiserver sends an
edge), the answer is what the op names (``null`` for none). The route resolves the sandbox and
checks the key may see it once (:meth:`SandboxRoutes.owned`: another project's sandbox is not
found), then forwards the op unchanged to the sandbox's node, in this process or across the
network: :meth:`SandboxRoutes.forward`, the path the REST routes of these kinds take too.

Only the kinds in :data:`~dsec.protocol.ops.PUBLIC` are served: those whose own REST route (kept for the SDK's
earlier releases) does no more than that check and forward, and a deadline and a file's
extended attributes (the E2B front's timeouts and file metadata, which another cluster's
apiserver reaches here for its overflow sandboxes: only the sandbox's own files and lifetime,
which the key's holder controls from inside anyway). The others stay internal: a whole fork
takes sandbox IDs and quota the apiserver reserves, a fork spec names a layer the fork route
chooses, and streams keep their NDJSON routes.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.ops import OPS, PUBLIC, Call, parse_op


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
        answer = await self.sandboxes.forward(request, lambda body: _call(kind, body))
        return web.Response(body=OPS[kind].adapter.dump_json(answer), content_type="application/json")


def _call(kind: str, body: bytes) -> Call[Any]:
    op = parse_op(kind, body)
    assert isinstance(op, Call)  # PUBLIC holds calls only (tests/unit/test_op_routes.py)
    return op
