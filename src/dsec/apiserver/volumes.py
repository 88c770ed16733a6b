"""Shared volumes on DSec's own API, and where any front finds them in the cluster.

:class:`VolumeDirectory` routes a volume operation (protocol/volumes.py) to the node its ID
names, makes a new volume on the node placement gives a container now, and lists volumes over
every node. It fills in what only the key may say, the project (``within``, and a new volume's
``project``), so a client's own word on either is never taken.

DSec's routes (an API key; the volume the key's project's or its subtree's)::

    POST   /v1/volumes/ops/{kind}           a volume op as JSON -> its answer as JSON
    GET    /v1/volumes/{id}/content?path=    -> the file's bytes, streamed
    PUT    /v1/volumes/{id}/content?path=&uid=&gid=&mode=&force=   bytes -> 201 its entry
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL, stream_bytes
from dsec.edge.link import EdgeLink
from dsec.executor.file_ops import CHUNK
from dsec.iam.base import Principal, can_access
from dsec.placement.placement import Placement
from dsec.protocol.errors import DSecError, Forbidden, VolumeNotFound
from dsec.protocol.http import text_param
from dsec.protocol.volumes import (
    CreateVolume,
    ListVolumes,
    VolumeEntry,
    VolumeId,
    VolumeInfo,
    VolumeOp,
    WriteOptions,
    parse_volume_op,
)


class VolumeDirectory:
    def __init__(self, links: Mapping[str, EdgeLink], placement: Placement) -> None:
        self.links = links
        self.placement = placement

    def link(self, volume_id: str) -> EdgeLink:
        link = self.links.get(VolumeId.parse(volume_id).node)
        if link is None:
            raise VolumeNotFound(f"volume {volume_id[:80]!r} not found")
        return link

    def scoped(self, principal: Principal, op: VolumeOp) -> VolumeOp:
        """``op`` as the key may ask it: its project's subtree, a new volume in the key's
        project unless it names one the key may reach."""
        if isinstance(op, CreateVolume):
            project = op.project or principal.project
            if not can_access(principal, project):
                raise Forbidden(f"this key may not make volumes in project {project!r}")
            return op.model_copy(update={"project": project})
        return op.model_copy(update={"within": principal.project})

    async def call(self, principal: Principal, op: VolumeOp) -> Any:
        op = self.scoped(principal, op)
        if isinstance(op, CreateVolume):
            return await self.create(op)
        if isinstance(op, ListVolumes):
            return await self.list(op.within)
        return await self.link(op.volume_id).volume(op)  # type: ignore[attr-defined]

    async def create(self, op: CreateVolume) -> VolumeInfo:
        node = await self.placement.choose("container")
        rec: VolumeInfo = await self.links[node].volume(op)
        return rec

    async def list(self, within: str) -> list[VolumeInfo]:
        """Every node's volumes under ``within``, oldest first; a node that does not answer, or
        keeps none, adds none."""
        links = list(self.links.values())
        found = await asyncio.gather(
            *(ln.volume(ListVolumes(within=within)) for ln in links), return_exceptions=True
        )
        out: list[VolumeInfo] = []
        for answer in found:
            if isinstance(answer, BaseException):
                if not isinstance(answer, DSecError):
                    raise answer
                continue
            out.extend(answer)
        return sorted(out, key=lambda r: r.created_at)


class VolumeApi:
    def __init__(self, directory: VolumeDirectory) -> None:
        self.directory = directory

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/volumes/ops/{kind}", self.op)
        r.add_get("/v1/volumes/{id}/content", self.read)
        r.add_put("/v1/volumes/{id}/content", self.write)

    async def op(self, request: web.Request) -> web.Response:
        op = parse_volume_op(request.match_info["kind"], await request.read())
        answer = await self.directory.call(request[PRINCIPAL], op)
        return web.Response(body=op.adapter.dump_json(answer), content_type="application/json")

    async def read(self, request: web.Request) -> web.StreamResponse:
        vid = request.match_info["id"]
        chunks = self.directory.link(vid).volume_read(
            vid, request[PRINCIPAL].project, text_param(request, "path")
        )
        return await stream_bytes(request, chunks)

    async def write(self, request: web.Request) -> web.Response:
        vid = request.match_info["id"]
        opts = WriteOptions.from_query(request.query)
        link = self.directory.link(vid)
        path = text_param(request, "path")
        entry: VolumeEntry = await link.volume_write(
            vid, request[PRINCIPAL].project, path, request.content.iter_chunked(CHUNK), opts
        )
        return web.Response(body=entry.model_dump_json(), status=201, content_type="application/json")


__all__ = ["VolumeApi", "VolumeDirectory"]
