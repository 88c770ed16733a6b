"""E2B's template build API over DSec layer builds.

Routes (what the v2 ``Template()`` builder of SDKs 2.34 and 2.63 calls)::

    POST   /v3/templates                              BuildRequest -> 202 {templateID, buildID, ...}
    GET    /templates/{id}/files/{hash}               -> 201 {present, url}: where to PUT the files
    PUT    /templates/uploads/{token}                 the files' tarball (a one-time link) -> 200
    POST   /v2/templates/{id}/builds/{buildID}        BuildStart -> 202; the build runs
    GET    /templates/{id}/builds/{buildID}/status    ?logsOffset=&limit= -> TemplateBuildInfo
    GET    /templates/aliases/{alias}                 -> {templateID, public} (404: none of yours)
    ...    /templates/tags, /templates/{id}/tags, /templates/{id}/builds/{buildID}/logs (.template_tags)
    GET    /templates                                 -> [Template] of the key's project
    GET    /templates/{id}                            -> Template with its builds
    DELETE /templates/{id}                            -> 204 (the layers stay: `dsec layer rm`)

A template belongs to the key's project; to every other project it does not exist (404), and
its layers are the project's (:mod:`dsec.apiserver.layer_access`). ``Sandbox.create(name)``
resolves through :meth:`Templates.resolve`; the start command runs at create and the ready
command is polled until it succeeds (bounded), since DSec snapshots no running processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL, read_body
from dsec.apiserver.e2b.template_build import Build, BuildState, reuse_build, run_build
from dsec.apiserver.e2b.template_models import (
    DEFAULT_TAG,
    HASH_RE,
    BuildRequest,
    BuildStart,
    TemplateConfig,
    TemplateRecord,
    build_key,
    forced,
    split_name,
)
from dsec.apiserver.e2b.template_tags import TemplateTagRoutes
from dsec.apiserver.layer_access import layer_viewer
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.iam import Principal, can_access
from dsec.images.base import E2B_BASE_REF, E2B_USER
from dsec.images.store import LayerStore
from dsec.protocol.errors import CommandTimeout, Conflict, InvalidRequest, LayerNotFound, TooLarge
from dsec.protocol.processes import ProcessStart

log = logging.getLogger("dsec.apiserver.e2b.templates")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
UPLOAD_PREFIX = "/templates/uploads/"
MAX_UPLOAD = 1 << 30  # one COPY's files: 1 GiB
MAX_TEMPLATES = 256  # per project
UPLOAD_TTL_S = 3600.0
READY_TIMEOUT_S = 60.0  # how long a create waits for a template's ready command
_READY_POLL_S = 0.2
_E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/base:latest", "e2bdev/code-interpreter")
BASE_ALIAS = "base"  # E2B's public base template (`Template.exists("base")`, `from_template("base")`)
_CHUNK = 1 << 20
_BUILDS_KEPT = 32  # finished builds whose status stays answerable
_BUILDS_WAITING = 256  # requested, not started: the oldest give way


def is_template_upload_path(path: str) -> bool:
    """The upload link carries its own one-time token (as E2B's presigned URL does): no key."""
    return path.startswith(UPLOAD_PREFIX)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _not_found(what: str) -> LayerNotFound:
    return LayerNotFound(f"template {what[:140]!r} not found")


@dataclass
class _Upload:
    template_id: str
    files_hash: str
    expires: float


class Templates:
    def __init__(
        self,
        sandboxes: SandboxRoutes,
        store: LayerStore,
        default_base: Callable[[], Awaitable[str]],
        internet: Callable[[EdgeLink, str], Awaitable[bool]],
    ) -> None:
        self.sandboxes, self.store = sandboxes, store
        self.default_base, self.internet = default_base, internet
        self.dir = Path(store.root) / "e2b-templates"
        self.records: dict[str, TemplateRecord] | None = None  # loaded at first use
        self.builds: dict[str, BuildState] = {}
        self.uploads: dict[str, _Upload] = {}
        self._lock = asyncio.Lock()
        self.delete_fallback: Handler | None = None  # DELETE of an ID no template has (snapshots)

    def register(self, r: web.UrlDispatcher) -> None:
        TemplateTagRoutes(self).register(r)  # first: /templates/tags is no template ID
        r.add_post("/v3/templates", self.request_build)
        r.add_put(UPLOAD_PREFIX + "{token}", self.upload)
        r.add_get("/templates/aliases/{alias}", self.alias)
        r.add_get("/templates/{id}/files/{hash}", self.file_link)
        r.add_post("/v2/templates/{id}/builds/{build}", self.start_build)
        r.add_get("/templates/{id}/builds/{build}/status", self.status)
        r.add_get("/templates", self.list)
        r.add_get("/templates/{id}", self.get)
        r.add_delete("/templates/{id}", self.delete)

    async def close(self) -> None:
        for state in self.builds.values():
            if state.task is not None:
                state.task.cancel()

    # -- records ------------------------------------------------------------------------------

    def _file(self) -> Path:
        return self.dir / "templates.json"

    async def _records(self) -> dict[str, TemplateRecord]:
        if self.records is None:

            def load() -> dict[str, TemplateRecord]:
                try:
                    raw = json.loads(self._file().read_text())
                except FileNotFoundError:
                    return {}
                records = [TemplateRecord.model_validate(t) for t in raw]
                for rec in records:
                    if rec.last_status in ("waiting", "building"):
                        rec.last_status = "error"  # its build died with the last apiserver
                return {rec.template_id: rec for rec in records}

            self.records = await asyncio.to_thread(load)
        return self.records

    async def _save(self) -> None:
        data = json.dumps([r.model_dump() for r in (await self._records()).values()])

        def write() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)  # tenants' env, commands and uploaded files: root's alone
            tmp = self._file().with_suffix(".tmp")
            tmp.write_text(data)
            os.replace(tmp, self._file())

        await asyncio.to_thread(write)

    async def _find(self, principal: Principal, id_or_name: str) -> TemplateRecord | None:
        """The key's project's template by ID, ``name`` or ``name:tag`` (tag ignored here)."""
        name = id_or_name.partition(":")[0]
        for rec in (await self._records()).values():
            if rec.project == principal.project and name in (rec.template_id, rec.name):
                return rec
        return None

    async def _owned(self, request: web.Request) -> TemplateRecord:
        raw = request.match_info["id"]
        rec = await self._find(request[PRINCIPAL], raw)
        if rec is None:
            raise _not_found(raw)
        return rec

    def _build(self, rec: TemplateRecord, build_id: str) -> BuildState:
        state = self.builds.get(build_id)
        if state is None or state.template_id != rec.template_id:
            raise LayerNotFound(f"build {build_id[:64]!r} of template {rec.template_id} not found")
        return state

    # -- sandbox create -----------------------------------------------------------------------

    async def resolve(self, principal: Principal, template_id: str) -> TemplateConfig | None:
        """The config ``name``, ``name:tag`` or a template ID stands for in the key's project;
        None: not a template of it (the caller tries it as a layer)."""
        rec = await self._find(principal, template_id)
        if rec is None:
            return None
        tag = template_id.partition(":")[2]
        config = rec.tags.get(tag or DEFAULT_TAG)
        if config is None and tag:
            return None  # "debian:bookworm" stays the layer though a template is named "debian"
        if config is None:
            raise LayerNotFound(f"template {template_id[:140]!r} has no ready build")
        return config

    async def start(self, link: EdgeLink, sandbox_id: str, config: TemplateConfig) -> None:
        """The template's start command (left running), then its ready command until it
        succeeds, within READY_TIMEOUT_S (CommandTimeout past that)."""
        if config.start_cmd:
            proc = ProcessStart(
                argv=["/bin/sh", "-c", config.start_cmd],
                cwd=config.workdir,
                user=config.user,
                stdin=False,
                tag="e2b-start-cmd",
            )
            events = link.start_process(sandbox_id, proc)
            try:
                await anext(events)  # "start": it runs; closing detaches
            finally:
                await events.aclose()
        if not config.ready_cmd:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimeout(
                    f"the template's ready command did not succeed within {READY_TIMEOUT_S:.0f} s"
                )
            check = ProcessStart(
                argv=["/bin/sh", "-c", config.ready_cmd],
                cwd=config.workdir,
                user=config.user,
                stdin=False,
                timeout=max(1.0, left),
            )
            codes = [e.exit_code async for e in link.start_process(sandbox_id, check) if e.t == "end"]
            if codes == [0]:
                return
            await asyncio.sleep(_READY_POLL_S)  # a poll interval, as E2B's envd polls

    # -- building -----------------------------------------------------------------------------

    async def request_build(self, request: web.Request) -> web.Response:
        req = await read_body(request, BuildRequest)
        name, tags = req.name_and_tags()
        principal = request[PRINCIPAL]
        async with self._lock:
            records = await self._records()
            rec = await self._find(principal, name)
            if rec is None:
                if sum(r.project == principal.project for r in records.values()) >= MAX_TEMPLATES:
                    raise Conflict(f"the project has {MAX_TEMPLATES} templates: delete one first")
                now = time.time()
                rec = TemplateRecord(
                    template_id=secrets.token_hex(10),
                    project=principal.project,
                    name=name,
                    created_at=now,
                    updated_at=now,
                )
                records[rec.template_id] = rec
            rec.cpu_count = req.cpu_count or rec.cpu_count
            rec.memory_mb = req.memory_mb or rec.memory_mb
            rec.build_count += 1
            rec.last_build, rec.last_status, rec.updated_at = str(uuid.uuid4()), "waiting", time.time()
            await self._save()
        self._forget_old_builds()
        state = BuildState(rec.last_build, rec.template_id, principal, tags)
        self.builds[state.build_id] = state
        body = {
            "templateID": rec.template_id,
            "buildID": state.build_id,
            "public": False,
            "names": [name],
            "aliases": [name],
            "tags": tags,
        }
        return web.json_response(body, status=202)

    def _forget_old_builds(self) -> None:
        for statuses, keep in ((("ready", "error"), _BUILDS_KEPT), (("waiting",), _BUILDS_WAITING)):
            old = [b for b in self.builds.values() if b.status in statuses]  # oldest first
            for state in old[: max(0, len(old) - keep)]:
                del self.builds[state.build_id]

    def _files(self, template_id: str) -> Path:
        return self.dir / "files" / template_id

    async def file_link(self, request: web.Request) -> web.Response:
        rec = await self._owned(request)
        files_hash = request.match_info["hash"]
        if not HASH_RE.match(files_hash):
            raise InvalidRequest("the files hash is 1 to 128 of letters, digits, '_', '-'")
        present = await asyncio.to_thread((self._files(rec.template_id) / files_hash).exists)
        now = time.time()
        self.uploads = {t: u for t, u in self.uploads.items() if u.expires > now}
        if len(self.uploads) > 10_000:
            raise Conflict("too many uploads pending: retry later")
        token = secrets.token_urlsafe(32)
        self.uploads[token] = _Upload(rec.template_id, files_hash, now + UPLOAD_TTL_S)
        url = str(request.url.with_path(UPLOAD_PREFIX + token).with_query(None))
        return web.json_response({"present": present, "url": url}, status=201)

    async def upload(self, request: web.Request) -> web.Response:
        up = self.uploads.pop(request.match_info["token"], None)
        if up is None or up.expires < time.time():
            raise LayerNotFound("no such upload link (each is good once, for an hour)")
        if request.content_length is not None and request.content_length > MAX_UPLOAD:
            raise TooLarge(f"the files are larger than {MAX_UPLOAD >> 20} MiB")
        folder = self._files(up.template_id)
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(os.chmod, self.dir, 0o700)  # a tenant's files: root's alone
        tmp = folder / f".{secrets.token_hex(8)}.part"
        size = 0
        try:
            with tmp.open("wb") as fh:
                async for chunk in request.content.iter_chunked(_CHUNK):
                    size += len(chunk)
                    if size > MAX_UPLOAD:
                        raise TooLarge(f"the files are larger than {MAX_UPLOAD >> 20} MiB")
                    await asyncio.to_thread(fh.write, chunk)
            await asyncio.to_thread(os.replace, tmp, folder / up.files_hash)
        finally:
            await asyncio.to_thread(tmp.unlink, True)
        return web.Response(status=200)

    async def _base(self, principal: Principal, start: BuildStart) -> TemplateConfig:
        if start.from_template:
            config = await self.resolve(principal, start.from_template)
            if config is not None:
                return config.model_copy(update={"start_cmd": None, "ready_cmd": None})
            if start.from_template != BASE_ALIAS:  # a layer's name works too: DSec's bases are layers
                return await self._layer_base(principal, start.from_template)
        image = start.from_image
        if image is None or image in _E2B_BASE_IMAGES:
            ref = await self.default_base()  # E2B's base once `dsec base` built it
            return TemplateConfig(refs=[ref], user=E2B_USER if ref == E2B_BASE_REF else None)
        return await self._layer_base(principal, image)

    async def _layer_base(self, principal: Principal, ref: str) -> TemplateConfig:
        viewer = layer_viewer(principal)
        try:
            await asyncio.to_thread(self.store.resolve_image, ref, viewer=viewer)
        except LayerNotFound as exc:
            raise LayerNotFound(
                f"{ref[:140]!r} is not a template of this project nor a layer on this node: "
                "DSec pulls no registry images in a build; import the image on the node first "
                "(`dsec image import`, from `docker save` or `skopeo copy` output)"
            ) from exc
        return TemplateConfig(refs=[ref], user=E2B_USER if ref == E2B_BASE_REF else None)

    async def start_build(self, request: web.Request) -> web.Response:
        rec = await self._owned(request)
        state = self._build(rec, request.match_info["build"])
        start = await read_body(request, BuildStart)
        start.check()
        if state.status != "waiting":
            raise Conflict(f"build {state.build_id} was already started")
        files = self._files(rec.template_id)
        for step in start.steps:
            if step.type == "COPY" and not (files / str(step.files_hash)).exists():
                raise InvalidRequest(f"COPY {step.args[0][:140]!r}: its files were not uploaded")
        state.status = "building"
        state.task = asyncio.create_task(self._run(rec, state, start))
        return web.Response(status=202)

    async def _run(self, rec: TemplateRecord, state: BuildState, start: BuildStart) -> None:
        rec.last_status = "building"
        files = self._files(rec.template_id)
        try:  # a base that is not there fails the build, as an image E2B cannot pull does
            base = await self._base(state.principal, start)
            key = await self._build_key(state.principal, base, start)
        except LayerNotFound as exc:
            state.fail(exc.message, "base")
            config = None
        else:
            cached = None if forced(start) else await self._cached(state.principal, key)
            if cached is not None:
                config = reuse_build(state, start, cached)
            else:
                build = Build(self.sandboxes, state, start, base, lambda h: files / h, self.internet)
                ref = f"e2b/{rec.template_id}:{rec.build_count}"
                config = await run_build(build, ref, rec.cpu_count, rec.memory_mb)
                if config is not None:
                    config.build_key = key
        async with self._lock:
            rec.last_status = state.status
            rec.updated_at = time.time()
            if config is not None:
                for tag in state.tags:
                    rec.tags[tag] = config
                    rec.tagged_at[tag] = rec.updated_at
            await self._save()

    async def _build_key(self, principal: Principal, base: TemplateConfig, start: BuildStart) -> str:
        """:func:`build_key` over the base's layers by digest: a base rebuilt under the same
        name is another base."""
        viewer = layer_viewer(principal)
        digests: list[str] = []
        for ref in base.refs:
            layers = await asyncio.to_thread(self.store.resolve_image, ref, viewer=viewer)
            digests += [layer.digest for layer in layers]
        return build_key(digests, base, start)

    async def _cached(self, principal: Principal, key: str) -> TemplateConfig | None:
        """A ready build of the project's templates with this key whose layers all still resolve
        (`dsec layer rm` may have taken one)."""
        async with self._lock:
            records = list((await self._records()).values())
        viewer = layer_viewer(principal)
        for rec in records:
            if rec.project != principal.project:
                continue
            for config in rec.tags.values():
                if config.build_key != key:
                    continue
                try:
                    for ref in config.refs:
                        await asyncio.to_thread(self.store.resolve_image, ref, viewer=viewer)
                except LayerNotFound:
                    continue
                return config
        return None

    async def status(self, request: web.Request) -> web.Response:
        rec = await self._owned(request)
        state = self._build(rec, request.match_info["build"])
        offset = _int_param(request, "logsOffset", 0, 0, 1 << 31)
        limit = _int_param(request, "limit", 100, 0, 100)
        body: dict[str, Any] = {
            "templateID": rec.template_id,
            "buildID": state.build_id,
            "status": state.status,
            "logs": [],
            "logEntries": state.entries(offset, limit),
        }
        if state.reason is not None:
            body["reason"] = state.reason
        return web.json_response(body)

    # -- listing ------------------------------------------------------------------------------

    def _template(self, rec: TemplateRecord) -> dict[str, Any]:
        return {
            "templateID": rec.template_id,
            "buildID": rec.last_build,
            "cpuCount": rec.cpu_count,
            "memoryMB": rec.memory_mb,
            "diskSizeMB": 0,
            "public": False,
            "aliases": [rec.name],
            "names": [rec.name],
            "createdAt": _iso(rec.created_at),
            "updatedAt": _iso(rec.updated_at),
            "createdBy": None,
            "lastSpawnedAt": None,
            "spawnCount": 0,
            "buildCount": rec.build_count,
            "envdVersion": "dsec",
            "buildStatus": rec.last_status,
        }

    async def alias(self, request: web.Request) -> web.Response:
        raw = request.match_info["alias"]
        split_name(raw)  # 400 for what can be no name
        rec = await self._find(request[PRINCIPAL], raw)
        if rec is None and raw == BASE_ALIAS:  # E2B's public base: every key may use it
            return web.json_response({"templateID": BASE_ALIAS, "public": True})
        if rec is None:
            raise _not_found(raw)
        return web.json_response({"templateID": rec.template_id, "public": False})

    async def list(self, request: web.Request) -> web.Response:
        principal = request[PRINCIPAL]
        mine = [r for r in (await self._records()).values() if can_access(principal, r.project)]
        return web.json_response([self._template(r) for r in sorted(mine, key=lambda r: r.created_at)])

    async def get(self, request: web.Request) -> web.Response:
        rec = await self._owned(request)
        builds = [
            {
                "buildID": b.build_id,
                "status": b.status,
                "createdAt": b.created_at,
                "updatedAt": b.finished_at or b.created_at,
                "finishedAt": b.finished_at,
                "cpuCount": rec.cpu_count,
                "memoryMB": rec.memory_mb,
            }
            for b in self.builds.values()
            if b.template_id == rec.template_id
        ]
        return web.json_response({**self._template(rec), "builds": builds})

    async def delete(self, request: web.Request) -> web.StreamResponse:
        rec = await self._find(request[PRINCIPAL], request.match_info["id"])
        if rec is None:
            if self.delete_fallback is not None:
                return await self.delete_fallback(request)
            raise _not_found(request.match_info["id"])
        async with self._lock:
            (await self._records()).pop(rec.template_id, None)
            await self._save()
        await asyncio.to_thread(shutil.rmtree, self._files(rec.template_id), True)
        return web.Response(status=204)


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or len(raw) > 12 or not low <= int(raw) <= high:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}")
    return int(raw)
