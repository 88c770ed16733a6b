"""E2B's volumes on DSec's shared volumes (protocol/volumes.py): the REST API and the content API.

``POST/GET /volumes``, ``GET/DELETE /volumes/{id}`` take the API key, as E2B's API does; the
content API (``/volumecontent/{id}/path|dir|file``, E2B's "belt" service, reached by the SDK at
``E2B_VOLUME_API_URL``) takes the volume's token as a bearer: an HMAC naming the volume, its
project and an expiry (:data:`TOKEN_TTL_S`), so any apiserver of the cluster checks it without
state. Each call goes to the edge of the node the volume ID names; that edge resolves every
path inside the volume's root. A new volume goes to the node placement would give a container
sandbox now, and sandboxes mounting it (``volumeMounts``) are placed on that node.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hmac
import posixpath
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.apiserver._http import PRINCIPAL, read_body, stream_bytes
from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.apiserver.volumes import VolumeDirectory
from dsec.edge.link import EdgeLink
from dsec.executor.file_ops import CHUNK
from dsec.protocol.errors import Conflict, InvalidRequest, Unauthorized, VolumeNotFound
from dsec.protocol.files import FileType
from dsec.protocol.models import invalid_request
from dsec.protocol.volumes import (
    MAX_LIST_DEPTH,
    MAX_VOLUME_MOUNTS,
    CreateVolume,
    DeleteVolume,
    GetVolume,
    ListDir,
    MakeDir,
    RemovePath,
    StatPath,
    UpdatePath,
    VolumeEntry,
    VolumeInfo,
    WriteOptions,
)

CONTENT_PREFIX = "/volumecontent/"
TOKEN_TTL_S = 24 * 3600  # a Volume.connect / get_info gets a fresh one
_TYPES = {FileType.dir: "directory", FileType.file: "file", FileType.symlink: "symlink"}


def is_volume_content_path(path: str) -> bool:
    return path.startswith(CONTENT_PREFIX)


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NewVolume(_In):
    name: str = Field(max_length=256)


class VolumeMount(_In):
    name: str = Field(max_length=256)
    path: str = Field(max_length=4096)


class UpdateBody(_In):
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


def entry_json(e: VolumeEntry) -> dict[str, Any]:
    """E2B's ``VolumeEntryStat``: permission bits only (``Mode & os.ModePerm``), RFC 3339 times."""
    body: dict[str, Any] = {
        "name": e.name,
        "type": _TYPES.get(e.type, "unknown"),
        "path": e.path,
        "size": e.size,
        "mode": e.mode & 0o777,
        "uid": e.uid,
        "gid": e.gid,
        "atime": _iso(e.atime),
        "mtime": _iso(e.mtime),
        "ctime": _iso(e.ctime),
    }
    if e.target is not None:
        body["target"] = e.target
    return body


def _int_query(request: web.Request, name: str, default: int | None = None) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if not raw.lstrip("-").isdigit() or len(raw) > 12:
        raise InvalidRequest(f"{name} must be an integer")
    return int(raw)


def _bool_query(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name} must be true or false")
    return raw in ("true", "1")


def _path_query(request: web.Request) -> str:
    path = request.query.get("path")
    if not path:
        raise InvalidRequest("path is required")
    return path


class VolumeRoutes:
    def __init__(self, sandboxes: SandboxRoutes, tokens: EnvdTokens) -> None:
        self.directory = VolumeDirectory(sandboxes.links, sandboxes.placement)
        self.tokens = tokens

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/volumes", self.create)
        r.add_get("/volumes", self.list_volumes)
        r.add_get("/volumes/{id}", self.get)
        r.add_delete("/volumes/{id}", self.delete)
        c = CONTENT_PREFIX + "{id}"
        r.add_get(c + "/path", self.stat)
        r.add_delete(c + "/path", self.remove)
        r.add_patch(c + "/path", self.update)
        r.add_get(c + "/dir", self.list_dir)
        r.add_post(c + "/dir", self.make_dir)
        r.add_get(c + "/file", self.read)
        r.add_put(c + "/file", self.write)

    # -- tokens ---------------------------------------------------------------------------------

    def _mac(self, volume_id: str, project: str, expires: int) -> str:
        return self.tokens.issue(f"volume:{volume_id}:{project}:{expires}")  # no sandbox ID holds ':'

    def token(self, rec: VolumeInfo) -> str:
        expires = int(time.time()) + TOKEN_TTL_S
        project = base64.urlsafe_b64encode(rec.project.encode()).decode().rstrip("=")
        return f"{expires}.{project}.{self._mac(rec.id, rec.project, expires)}"

    def _project(self, request: web.Request, volume_id: str) -> str:
        """The project a content request's bearer token speaks for; 401 otherwise."""
        header = request.headers.get("Authorization", "")
        parts = header[7:].split(".") if header.startswith("Bearer ") and len(header) < 2048 else []
        try:
            expires_s, project_b64, mac = parts
            expires = int(expires_s)
            project = base64.urlsafe_b64decode(project_b64 + "=" * (-len(project_b64) % 4)).decode()
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise Unauthorized("missing or malformed volume token") from None
        if not hmac.compare_digest(self._mac(volume_id, project, expires), mac):
            raise Unauthorized(f"the token is not volume {volume_id[:80]}'s")
        if expires < time.time():
            raise Unauthorized("the volume token has expired: get a new one (Volume.connect)")
        return project

    # -- the REST API -----------------------------------------------------------------------------

    def _link(self, volume_id: str) -> EdgeLink:
        try:
            return self.directory.link(volume_id)
        except VolumeNotFound:
            raise VolumeNotFound("Volume not found") from None

    async def _record(self, request: web.Request) -> VolumeInfo:
        vid = request.match_info["id"]
        try:
            rec: VolumeInfo = await self._link(vid).volume(
                GetVolume(volume_id=vid, within=request[PRINCIPAL].project)
            )
        except VolumeNotFound:
            raise VolumeNotFound("Volume not found") from None
        return rec

    def _with_token(self, rec: VolumeInfo) -> dict[str, Any]:
        return {"volumeID": rec.id, "name": rec.name, "token": self.token(rec)}

    async def create(self, request: web.Request) -> web.Response:
        body = await read_body(request, NewVolume)
        project = request[PRINCIPAL].project
        try:
            op = CreateVolume(name=body.name, project=project)
        except InvalidRequest:
            raise InvalidRequest("Invalid volume name") from None
        if any(r.name == body.name and r.project == project for r in await self.directory.list(project)):
            raise InvalidRequest(f"Volume with name '{body.name}' already exists")
        try:
            rec = await self.directory.create(op)
        except Conflict as exc:
            raise InvalidRequest(f"Volume with name '{body.name}' already exists") from exc
        return web.json_response(self._with_token(rec), status=201)

    async def list_volumes(self, request: web.Request) -> web.Response:
        project = request[PRINCIPAL].project
        return web.json_response(
            [{"volumeID": r.id, "name": r.name} for r in await self.directory.list(project)]
        )

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._with_token(await self._record(request)))

    async def delete(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        await self._link(rec.id).volume(DeleteVolume(volume_id=rec.id, within=request[PRINCIPAL].project))
        return web.Response(status=204)

    # -- the content API --------------------------------------------------------------------------

    def _target(self, request: web.Request) -> tuple[EdgeLink, str, str]:
        vid = request.match_info["id"]
        project = self._project(request, vid)
        return self._link(vid), vid, project

    async def _entry(
        self, request: web.Request, op_type: type[Any], status: int = 200, **kw: Any
    ) -> web.Response:
        link, vid, project = self._target(request)
        entry: VolumeEntry = await link.volume(
            op_type(volume_id=vid, within=project, path=_path_query(request), **kw)
        )
        return web.json_response(entry_json(entry), status=status)

    async def stat(self, request: web.Request) -> web.Response:
        return await self._entry(request, StatPath)

    async def update(self, request: web.Request) -> web.Response:
        body = await read_body(request, UpdateBody)
        return await self._entry(request, UpdatePath, **body.model_dump())

    async def make_dir(self, request: web.Request) -> web.Response:
        kw = {k: v for k in ("uid", "gid", "mode") if (v := _int_query(request, k)) is not None}
        return await self._entry(request, MakeDir, 201, force=_bool_query(request, "force"), **kw)

    async def remove(self, request: web.Request) -> web.Response:
        link, vid, project = self._target(request)
        await link.volume(RemovePath(volume_id=vid, within=project, path=_path_query(request)))
        return web.Response(status=204)

    async def list_dir(self, request: web.Request) -> web.Response:
        link, vid, project = self._target(request)
        depth = max(_int_query(request, "depth", 1) or 1, 1)  # E2B's max(depth, minDepth)
        if depth > MAX_LIST_DEPTH:
            raise InvalidRequest(f"depth must be between 1 and {MAX_LIST_DEPTH}")
        entries = await link.volume(
            ListDir(volume_id=vid, within=project, path=_path_query(request), depth=depth)
        )
        return web.json_response([entry_json(e) for e in entries])

    async def read(self, request: web.Request) -> web.StreamResponse:
        link, vid, project = self._target(request)
        return await stream_bytes(request, link.volume_read(vid, project, _path_query(request)))

    async def write(self, request: web.Request) -> web.Response:
        link, vid, project = self._target(request)
        kw = {k: v for k in ("uid", "gid", "mode") if (v := _int_query(request, k)) is not None}
        try:
            opts = WriteOptions(force=_bool_query(request, "force"), **kw)
        except ValidationError as exc:
            raise invalid_request(exc) from exc
        entry = await link.volume_write(
            vid, project, _path_query(request), request.content.iter_chunked(CHUNK), opts
        )
        return web.json_response(entry_json(entry), status=201)

    # -- mounts -----------------------------------------------------------------------------------

    async def mounts(self, principal_project: str, raw: list[dict[str, Any]]) -> dict[str, str]:
        """E2B's ``volumeMounts`` (``[{name, path}]``) as a spec's ``volumes`` (path -> ID):
        E2B's checks and messages (sandbox_create.go), each mount by its index."""
        if len(raw) > MAX_VOLUME_MOUNTS:
            raise InvalidRequest(f"at most {MAX_VOLUME_MOUNTS} volume mounts")
        try:
            mounts = [VolumeMount.model_validate(m) for m in raw]
        except ValidationError as exc:
            raise invalid_request(exc) from exc
        by_name = {
            r.name: r for r in await self.directory.list(principal_project) if r.project == principal_project
        }
        out: dict[str, str] = {}
        bad: list[str] = []
        for i, m in enumerate(mounts):
            rec = by_name.get(m.name)
            if rec is None:
                bad.append(f"\t- volume mount #{i}: volume '{m.name}' not found")
            elif not m.path:
                bad.append(f"\t- volume mount #{i}: path cannot be empty")
            elif not m.path.startswith("/"):
                bad.append(f"\t- volume mount #{i}: path must be absolute")
            elif posixpath.normpath(m.path) != m.path or "//" in m.path:
                bad.append(f"\t- volume mount #{i}: path must not contain any '.' or '..' components")
            elif m.path in out:
                bad.append(f"\t- volume mount #{i}: path '{m.path}' is already used")
            else:
                out[m.path] = rec.id
        if bad:
            raise InvalidRequest("invalid mounts:\n" + "\n".join(bad))
        return out


__all__ = ["VolumeRoutes", "entry_json", "is_volume_content_path"]
