"""NDJSON streams for the edge's HTTP face, and the REST routes of the process table and
directory watches (``/sandboxes/{id}/processes...``, ``/sandboxes/{id}/watch``) that the
apiserver serves under ``/v1`` (:mod:`dsec.apiserver.processes`); the edge itself serves these
operations as ops (:mod:`dsec.protocol.ops`, ``.../streams/{kind}`` and ``.../ops/{kind}``).

Streams are NDJSON, one :class:`~dsec.protocol.processes.ProcessEvent` or ``WatchEvent`` a
line. An error before the first event is an ordinary error answer with its status; one after
it is the stream's last line (a DSec error body). A client hanging up on a process stream
detaches from the process (it runs on); on a watch, it removes the watch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from dsec.edge.link import EdgeLink, LocalEdgeLink
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.http import respond, text_param
from dsec.protocol.ops import (
    Call,
    CloseProcessStdin,
    ListProcesses,
    ResizeProcess,
    SendProcessInput,
    SignalProcess,
)
from dsec.protocol.processes import ProcessInput, ProcessSignal, ProcessStart, PtySize

log = logging.getLogger("dsec.edge.server")
R = TypeVar("R")

SANDBOX = "/sandboxes/{id}"
PROCESS = "/sandboxes/{id}/processes/{pid}"


def _pid(request: web.Request) -> int:
    raw = request.match_info["pid"]
    if not raw.isdigit() or not 0 < int(raw) < 1 << 31:
        raise InvalidRequest(f"bad process ID {raw!r}")
    return int(raw)


async def stream_ndjson(request: web.Request, events: AsyncGenerator[BaseModel, None]) -> web.StreamResponse:
    """Answer with ``events`` as NDJSON (see the module's note on errors); closes ``events``."""
    try:
        event = await anext(events, None)  # errors before the first event get their own status
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        while event is not None:
            await resp.write(event.model_dump_json().encode() + b"\n")
            try:
                event = await anext(events, None)
            except DSecError as exc:
                await resp.write(json.dumps(exc.to_wire()).encode() + b"\n")
                break
            except Exception as exc:
                log.exception("stream %s failed mid-way", request.path)
                infra = InfraFailure(
                    f"the edge failed mid-stream: {type(exc).__name__}: {exc}", reason=InfraReason.edge
                )
                await resp.write(json.dumps(infra.to_wire()).encode() + b"\n")
                break
        await resp.write_eof()
        return resp
    finally:
        await events.aclose()


class ProcessRoutes:
    """``/sandboxes/{id}/processes...`` and ``/sandboxes/{id}/watch`` over a link.

    The apiserver serves them under ``/v1`` (:mod:`dsec.apiserver.processes`), each sandbox on
    its own node's link, by overriding :meth:`target`."""

    def __init__(self, link: LocalEdgeLink) -> None:
        self.link = link

    async def target(self, request: web.Request) -> tuple[EdgeLink, str]:
        """The link that holds the sandbox a request names, and its ID."""
        return self.link, request.match_info["id"]

    async def forward(self, request: web.Request, build: Callable[[bytes], Call[R]]) -> R:
        """The op ``build`` makes of the request's body, on the sandbox the request names."""
        link, sid = await self.target(request)
        return await link.call(sid, build(await request.read()))

    def register(self, r: web.UrlDispatcher, prefix: str) -> None:
        r.add_post(prefix + SANDBOX + "/processes", self.start)
        r.add_get(prefix + SANDBOX + "/processes", self.list)
        r.add_get(prefix + PROCESS + "/events", self.connect)
        r.add_post(prefix + PROCESS + "/input", self.input)
        r.add_post(prefix + PROCESS + "/close-stdin", self.close_stdin)
        r.add_post(prefix + PROCESS + "/signal", self.signal)
        r.add_post(prefix + PROCESS + "/resize", self.resize)
        r.add_get(prefix + SANDBOX + "/watch", self.watch)

    async def start(self, request: web.Request) -> web.StreamResponse:
        link, sid = await self.target(request)
        req = ProcessStart.model_validate_json(await request.read() or b"{}")
        return await stream_ndjson(request, link.start_process(sid, req))

    async def connect(self, request: web.Request) -> web.StreamResponse:
        link, sid = await self.target(request)
        return await stream_ndjson(request, link.connect_process(sid, _pid(request)))

    # The calls: each builds its op from the REST request (the PID from the path, the rest
    # from the body as before) and forwards it.

    async def list(self, request: web.Request) -> web.Response:
        processes = await self.forward(request, lambda _: ListProcesses())
        return respond(processes)

    async def input(self, request: web.Request) -> web.Response:
        def build(body: bytes) -> SendProcessInput:
            req = ProcessInput.model_validate_json(body or b"{}")
            return SendProcessInput(pid=_pid(request), data=req.data)

        await self.forward(request, build)
        return respond({})

    async def close_stdin(self, request: web.Request) -> web.Response:
        await self.forward(request, lambda _: CloseProcessStdin(pid=_pid(request)))
        return respond({})

    async def signal(self, request: web.Request) -> web.Response:
        def build(body: bytes) -> SignalProcess:
            req = ProcessSignal.model_validate_json(body or b"{}")
            return SignalProcess(pid=_pid(request), signal=req.signal)

        await self.forward(request, build)
        return respond({})

    async def resize(self, request: web.Request) -> web.Response:
        def build(body: bytes) -> ResizeProcess:
            size = PtySize.model_validate_json(body or b"{}")
            return ResizeProcess(pid=_pid(request), rows=size.rows, cols=size.cols)

        await self.forward(request, build)
        return respond({})

    async def watch(self, request: web.Request) -> web.StreamResponse:
        link, sid = await self.target(request)
        path = text_param(request, "path")
        recursive = request.query.get("recursive", "false")
        if recursive not in ("true", "false"):
            raise InvalidRequest("query parameter 'recursive' must be true or false")
        events = link.watch_dir(sid, path, recursive == "true")
        return await stream_ndjson(request, events)
