"""The edge's HTTP face: one node's :class:`~dsec.edge.link.EdgeLink` served to apiservers.

Only apiservers talk to it (callers never do), so it trusts what they send as DSec's own: a
create may carry reserved ``dsec.*`` labels, which the apiserver sets (the sandbox's project).
Every request must carry the cluster secret, a bearer token shared by the apiservers and edges
of one cluster. The secret travels in the clear: run edges on a private network, or behind TLS.

Routes, all under ``/edge/v1`` (bodies are the wire models of :mod:`dsec.protocol.models`)::

    GET    /stats                                  the node's load, for the watcher
    POST   /sandboxes?id=                          ContainerSpec -> 201 SandboxInfo
    GET    /sandboxes?label=k=v...                 -> [SandboxInfo] (running ones)
    POST   /bulk/{stop|pause|resume}?label=k=v...&within=PROJECT -> BulkResult (a whole job)
    POST   /leases/{job}?within=PROJECT            LeaseRequest -> {"sandboxes", "expires_at"}
    GET    /sandbox-ids                            -> {"ids": [...]} (running, for reconciliation)
    POST   /fence                                  {"fenced": bool, "reason"} -> {"fenced": bool}
    GET    /sandboxes/{id}                         -> SandboxInfo
    DELETE /sandboxes/{id}                         -> SandboxInfo (stopped)
    POST   /sandboxes/{id}/ops/{kind}              an op (protocol/ops.py) as JSON -> its answer as JSON
    POST   /sandboxes/{id}/streams/{kind}          a stream op as JSON -> NDJSON of its events
    GET    /sandboxes/{id}/files/content?path=     -> the bytes, streamed
    PUT    /sandboxes/{id}/files/content?path=&mode=644   bytes streamed -> 201 FileStat
    GET    /sandboxes/{id}/ports/{port}            -> WebSocket: bytes of the sandbox's port (edge/ports.py)
    POST   /layers/in-use?unmount_idle=false       -> {"digests": [...]}
    POST   /fncall?pool=                           FnTask -> FnResult (a warm-pool call)

Every sandbox operation but a file's bytes and a port is one of the two ``ops``/``streams``
routes: the op's ``kind`` names its model, the body is the op, the answer is what the op names
(``null`` for none). Closing a stream's connection stops what the op stops on close (an exec's
process tree is killed, a kept process is detached from, a watch removed).

Errors are DSec wire bodies (``{"error": {"code", "message", "reason"}}``) with the error's
HTTP status. A stream that fails after it started ends with one such body as its last
line; a file download that fails after it started is cut off (the connection is dropped), so
a client can never take a short file for a whole one. Every authenticated response names the
node and its epoch in headers: an apiserver learns a restarted node's new epoch from any
answer, and notices when an address it was given belongs to another node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from dsec.edge.edge import Edge
from dsec.edge.link import FenceRequest, LocalEdgeLink
from dsec.edge.ports import port_param, serve_port
from dsec.edge.server_processes import stream_ndjson
from dsec.executor.file_ops import CHUNK
from dsec.observe.logs import echo_request_id, request_middleware
from dsec.observe.metrics import serve_metrics
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.fncall import FnTask
from dsec.protocol.http import (
    client_went,
    file_mode_param,
    flag_param,
    label_filter,
    listen,
    require_cluster_secret,
    respond,
    text_param,
)
from dsec.protocol.models import LeaseRequest, invalid_request, parse_spec
from dsec.protocol.ops import Call, Stream, parse_op
from dsec.protocol.volumes import WriteOptions, parse_volume_op

log = logging.getLogger("dsec.edge.server")

PREFIX = "/edge/v1"
NODE_HEADER = "X-DSec-Edge-Node"
EPOCH_HEADER = "X-DSec-Edge-Epoch"
SECRET_ENV = "DSEC_CLUSTER_SECRET"
STARTING_REASON = InfraReason.edge_starting
MIN_SECRET_LEN = 16
# Bodies read whole are JSON; the largest is an exec's stdin, base64 inside an ExecRequest
# that an apiserver accepted under its own 64 MiB limit. File content is streamed, not read whole.
MAX_JSON_BODY = 96 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_AUTHED = web.RequestKey("dsec_edge_authed", bool)


def check_secret(secret: str) -> str:
    if len(secret) < MIN_SECRET_LEN:
        raise InvalidRequest(f"the cluster secret must be at least {MIN_SECRET_LEN} characters")
    return secret


def read_cluster_secret(path: Path | None = None) -> str:
    """The cluster secret from ``path`` (first line) or else from ``$DSEC_CLUSTER_SECRET``."""
    if path is not None:
        try:
            text = path.read_text().strip()
        except OSError as exc:
            raise InvalidRequest(f"cannot read the cluster secret from {path}: {exc.strerror}") from exc
    else:
        text = os.environ.get(SECRET_ENV, "").strip()
        if not text:
            raise InvalidRequest(f"no cluster secret: give a secret file or set {SECRET_ENV}")
    return check_secret(text)


def _error(exc: DSecError) -> web.Response:
    return web.json_response(exc.to_wire(), status=exc.status)


def _param(request: web.Request, name: str) -> str:
    return text_param(request, name)


def _flag(request: web.Request, name: str, default: bool) -> bool:
    return flag_param(request, name, default)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DSecError as exc:
        return _error(exc)
    except ValidationError as exc:
        return _error(invalid_request(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        wrapped = (
            InvalidRequest(exc.reason)
            if exc.status < 500
            else InfraFailure(exc.reason, reason=InfraReason.http)
        )
        return web.json_response(wrapped.to_wire(), status=exc.status)
    except Exception as exc:
        if (went := client_went(request, exc)) is not None:
            return went
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(
            InfraFailure(f"edge internal error: {type(exc).__name__}: {exc}", reason=InfraReason.edge)
        )


class EdgeServer:
    """Serves one edge over HTTP; ``start`` listens, ``close`` stops listening (not the edge)."""

    def __init__(self, edge: Edge | LocalEdgeLink, secret: str, *, shutdown_timeout: float = 5.0) -> None:
        self.link = edge if isinstance(edge, LocalEdgeLink) else LocalEdgeLink(edge)
        self._secret = check_secret(secret).encode()
        # How long ``close`` lets requests in flight finish. Exec streams and shell commands may
        # run for hours: they are cut off (and their process trees killed) rather than awaited.
        self._shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.ready = True  # False while the edge behind it is still starting (see EdgeNode)

    # -- plumbing -----------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        require_cluster_secret(request, self._secret)
        request[_AUTHED] = True
        if not self.ready:
            # Before re-adoption, "no such sandbox" could be a lie: refuse everything instead.
            raise InfraFailure(f"edge {self.link.node!r} is starting", reason=STARTING_REASON)
        return await handler(request)

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        # Only to those holding the secret: a stranger learns nothing about the node.
        if request.get(_AUTHED):
            response.headers[NODE_HEADER] = self.link.node
            response.headers[EPOCH_HEADER] = str(self.link.epoch)

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[request_middleware("edge"), _errors, self._auth], client_max_size=MAX_JSON_BODY
        )
        app.on_response_prepare.extend([self._stamp, echo_request_id])
        r = app.router
        # First: aiohttp tries a path's routes in the order they were added, a regex each, and
        # nearly every request an apiserver sends is an op.
        r.add_post(PREFIX + "/sandboxes/{id}/ops/{kind}", self.op)
        r.add_get(f"{PREFIX}/stats", self.stats)
        r.add_post(f"{PREFIX}/sandboxes", self.create)
        r.add_get(f"{PREFIX}/sandboxes", self.list)
        r.add_post(PREFIX + "/bulk/{action}", self.bulk)
        r.add_post(PREFIX + "/leases/{job}", self.renew_lease)
        r.add_get(f"{PREFIX}/sandbox-ids", self.sandbox_ids)
        r.add_post(f"{PREFIX}/fence", self.fence)
        r.add_get(PREFIX + "/sandboxes/{id}", self.get)
        r.add_delete(PREFIX + "/sandboxes/{id}", self.stop)
        r.add_post(PREFIX + "/sandboxes/{id}/streams/{kind}", self.op_stream)
        r.add_get(PREFIX + "/sandboxes/{id}/files/content", self.download)
        r.add_put(PREFIX + "/sandboxes/{id}/files/content", self.upload)
        r.add_post(PREFIX + "/volumes/{kind}", self.volume_op)
        r.add_get(PREFIX + "/volumes/{id}/content", self.volume_download)
        r.add_put(PREFIX + "/volumes/{id}/content", self.volume_upload)
        r.add_get(PREFIX + "/sandboxes/{id}/ports/{port}", self.port)
        r.add_post(f"{PREFIX}/layers/in-use", self.layers_in_use)
        r.add_post(f"{PREFIX}/fncall", self.fncall)
        serve_metrics(app, self.link.edge.prom)  # GET /metrics, Prometheus (observe/edge_metrics.py)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: any free port); returns the URL apiservers use."""
        # handler_cancellation: an apiserver that hangs up (its own caller went away) cancels
        # the work it asked for, e.g. kills the process tree of an exec that still runs.
        self._runner, self.url = await listen(
            self.app(), host, port, handler_cancellation=True, shutdown_timeout=self._shutdown_timeout
        )
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- sandboxes ----------------------------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        return respond(await self.link.stats())

    async def create(self, request: web.Request) -> web.Response:
        # Trusted: the apiserver labels the spec with its project (a reserved dsec.* label).
        spec = parse_spec(await request.read() or b"{}", trusted=True)
        return respond(await self.link.create(spec, request.query.get("id")), status=201)

    async def list(self, request: web.Request) -> web.Response:
        return respond(await self.link.list_sandboxes(label_filter(request)))

    async def sandbox_ids(self, request: web.Request) -> web.Response:
        return respond({"ids": await self.link.sandbox_ids()})

    async def fence(self, request: web.Request) -> web.Response:
        """Refuse creates (scale-in drains the node) or lift that fence: every apiserver's
        placement then skips the node (its stats say ``fenced``), not only the caller's."""
        req = FenceRequest.model_validate_json(await request.read() or b"{}")
        return respond({"fenced": await self.link.fence(req.fenced, req.reason)})

    async def bulk(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("stop", "pause", "resume"):
            raise InvalidRequest(f"unknown bulk action {action!r}: stop, pause or resume")
        labels, within = label_filter(request), _param(request, "within")
        return respond(await self.link.bulk(action, labels, within))  # type: ignore[arg-type]

    async def renew_lease(self, request: web.Request) -> web.Response:
        req = LeaseRequest.model_validate_json(await request.read() or b"{}")
        job, within = request.match_info["job"], _param(request, "within")
        covered, expires = await self.link.renew_lease(job, req.lease_s, within)
        return respond({"sandboxes": covered, "expires_at": expires})

    async def get(self, request: web.Request) -> web.Response:
        return respond(await self.link.get(request.match_info["id"]))

    async def stop(self, request: web.Request) -> web.Response:
        return respond(await self.link.stop(request.match_info["id"]))

    # -- sandbox operations (protocol/ops.py) ---------------------------------------------------

    async def op(self, request: web.Request) -> web.Response:
        op = parse_op(request.match_info["kind"], await request.read())
        if not isinstance(op, Call):
            raise InvalidRequest(f"{op.kind!r} is a stream: POST .../streams/{op.kind}")
        answer = await self.link.call(request.match_info["id"], op)
        return web.Response(body=op.adapter.dump_json(answer), content_type="application/json")

    async def op_stream(self, request: web.Request) -> web.StreamResponse:
        op = parse_op(request.match_info["kind"], await request.read())
        if not isinstance(op, Stream):
            raise InvalidRequest(f"{op.kind!r} is not a stream: POST .../ops/{op.kind}")
        return await stream_ndjson(request, self.link.stream(request.match_info["id"], op))

    async def port(self, request: web.Request) -> web.StreamResponse:
        opening = self.link.open_port(request.match_info["id"], port_param(request))
        return await serve_port(request, opening)  # errors travel inside the WebSocket

    async def fncall(self, request: web.Request) -> web.Response:
        task = FnTask.model_validate_json(await request.read() or b"{}")
        return respond(await self.link.fncall(task, request.query.get("pool")))

    async def layers_in_use(self, request: web.Request) -> web.Response:
        digests = await self.link.layers_in_use(unmount_idle=_flag(request, "unmount_idle", False))
        return respond({"digests": sorted(digests)})

    # -- files --------------------------------------------------------------------------------

    async def download(self, request: web.Request) -> web.StreamResponse:
        return await _send_chunks(
            request, self.link.read_stream(request.match_info["id"], _param(request, "path"))
        )

    async def upload(self, request: web.Request) -> web.Response:
        path = _param(request, "path")
        mode = file_mode_param(request)
        # The body is pulled as it is written: TCP flow control holds back a faster sender.
        body = request.content.iter_chunked(CHUNK)
        info = await self.link.write_stream(request.match_info["id"], path, body, mode=mode)
        return respond(info, status=201)

    # -- shared volumes (protocol/volumes.py) ----------------------------------------------------

    async def volume_op(self, request: web.Request) -> web.Response:
        op = parse_volume_op(request.match_info["kind"], await request.read())
        answer = await self.link.volume(op)
        return web.Response(body=op.adapter.dump_json(answer), content_type="application/json")

    async def volume_download(self, request: web.Request) -> web.StreamResponse:
        vid, within, path = request.match_info["id"], _param(request, "within"), _param(request, "path")
        return await _send_chunks(request, self.link.volume_read(vid, within, path))

    async def volume_upload(self, request: web.Request) -> web.Response:
        vid, within, path = request.match_info["id"], _param(request, "within"), _param(request, "path")
        opts = WriteOptions.from_query(request.query)
        body = request.content.iter_chunked(CHUNK)
        return respond(await self.link.volume_write(vid, within, path, body, opts), status=201)


async def _send_chunks(request: web.Request, chunks: AsyncGenerator[bytes, None]) -> web.StreamResponse:
    try:
        chunk = await anext(chunks, None)  # a missing file is a 404, not an empty 200
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        while chunk is not None:
            await resp.write(chunk)
            try:
                chunk = await anext(chunks, None)
            except Exception:
                # Bytes are on the wire already: the only honest signal left is to cut the
                # stream off before its terminating chunk, so the client sees it incomplete.
                log.exception("download of %s from %s broke off", request.query.get("path"), request.path)
                if request.transport is not None:
                    request.transport.abort()
                return resp
        await resp.write_eof()
        return resp
    finally:
        await chunks.aclose()
