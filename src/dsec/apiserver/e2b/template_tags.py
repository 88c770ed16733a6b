"""E2B's template tags and build logs routes, on the templates of :mod:`.templates`.

Routes (E2B's openapi ``spec/openapi.yml``, handlers ``template_tags.go`` and
``template_build_logs.go`` of e2b-dev/infra)::

    POST   /templates/tags                          {target: "name:tag", tags} -> 201 {tags, buildID}
    DELETE /templates/tags                          {name, tags} -> 204
    GET    /templates/{id}/tags                     -> [{tag, buildID, createdAt}]
    GET    /templates/{id}/builds/{buildID}/logs    ?cursor=&limit=&direction=&level=&source=

A tag names one build of a template: assigning points more tags at the build the target tag
names (a template's layers and defaults, :class:`TemplateConfig`), so ``Sandbox.create(
"name:tag")`` starts that build. ``default`` is every template's tag of its latest build and
cannot be removed. E2B's v1 builds (``POST /templates``, ``/templates/{id}`` and
``/templates/{id}/builds/{buildID}``, the CLI's Dockerfile flow) push an image to E2B's own
registry with an access token: DSec runs no such registry, so they answer 501 saying so.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver._http import PRINCIPAL, read_body
from dsec.apiserver.e2b import logs
from dsec.apiserver.e2b.lifecycle import NotSupported
from dsec.apiserver.e2b.template_models import DEFAULT_TAG, MAX_TAGS, split_name
from dsec.protocol.errors import InvalidRequest, LayerNotFound

if TYPE_CHECKING:
    from dsec.apiserver.e2b.templates import Templates

_MAX_LOGS = 100  # E2B's maxLogEntriesPerRequest
_V1_BUILDS = (
    "v1 template builds (the CLI's Dockerfile flow: an image pushed to E2B's registry) are not "
    "supported by DSec: build with the SDK's Template() (POST /v3/templates)"
)


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AssignTags(_In):
    target: str = Field(max_length=300)
    tags: list[str] = Field(max_length=MAX_TAGS)


class DeleteTags(_In):
    name: str = Field(max_length=300)
    tags: list[str] = Field(max_length=MAX_TAGS)


def _tags(raw: list[str]) -> list[str]:
    """E2B's ValidateAndDeduplicateTags: trimmed, lowercased, a tag's characters, no UUID."""
    out: list[str] = []
    for tag in raw:
        cleaned = tag.strip().lower()
        if not cleaned or ":" in cleaned:
            raise InvalidRequest(f"Invalid tag: invalid tag '{tag[:80]}': a tag is not empty, has no ':'")
        split_name(f"x:{cleaned}")  # DSec's tag form: 1 to 64 of letters, digits, '.', '_', '-'
        try:
            uuid.UUID(cleaned)
        except ValueError:
            out.append(cleaned)
        else:
            raise InvalidRequest(f"Invalid tag: invalid tag '{tag[:80]}': tag cannot be a UUID")
    return list(dict.fromkeys(out))


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


class TemplateTagRoutes:
    def __init__(self, templates: Templates) -> None:
        self.templates = templates

    def register(self, r: web.UrlDispatcher) -> None:
        """Before ``/templates/{id}``: ``DELETE /templates/tags`` is not the template "tags"."""
        r.add_post("/templates/tags", self.assign)
        r.add_delete("/templates/tags", self.remove)
        r.add_get("/templates/{id}/tags", self.list)
        r.add_get("/templates/{id}/builds/{build}/logs", self.logs)
        for path in ("/templates", "/templates/{id}", "/templates/{id}/builds/{build}"):
            r.add_post(path, self.v1_build)

    async def v1_build(self, request: web.Request) -> web.StreamResponse:
        raise NotSupported(_V1_BUILDS)

    async def assign(self, request: web.Request) -> web.Response:
        body = await read_body(request, AssignTags)
        if not body.tags:
            raise InvalidRequest("At least one tag is required")
        name, tag = split_name(body.target.strip())
        tags = _tags(body.tags)
        t = self.templates
        async with t._lock:
            rec = await t._find(request[PRINCIPAL], name)
            config = rec.tags.get(tag) if rec is not None else None
            if rec is None or config is None:
                raise LayerNotFound(f"Template '{body.target[:140]}' with tag '{tag}' not found")
            now = time.time()
            for new in tags:
                rec.tags[new] = config
                rec.tagged_at[new] = now
            await t._save()
        return web.json_response({"tags": tags, "buildID": config.build_id or rec.last_build}, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        body = await read_body(request, DeleteTags)
        tags = _tags(body.tags)
        if not tags:
            raise InvalidRequest("At least one tag is required")
        if DEFAULT_TAG in tags:
            raise InvalidRequest(f"Cannot delete the '{DEFAULT_TAG}' tag")
        raw = body.name.strip()
        name, tag = split_name(raw)
        if ":" in raw and tag != DEFAULT_TAG:
            raise InvalidRequest("Template name should not contain a tag, use the 'tags' field instead")
        t = self.templates
        async with t._lock:
            rec = await t._find(request[PRINCIPAL], name)
            if rec is None:
                raise LayerNotFound(f"template {name[:140]!r} not found")
            for gone in tags:  # a tag the template does not have is removed already (E2B's DELETE)
                rec.tags.pop(gone, None)
                rec.tagged_at.pop(gone, None)
            await t._save()
        return web.Response(status=204)

    async def list(self, request: web.Request) -> web.Response:
        raw = request.match_info["id"]
        split_name(raw)  # 400 for what can be no template
        rec = await self.templates._find(request[PRINCIPAL], raw)
        if rec is None:
            raise LayerNotFound(f"template {raw[:140]!r} not found")
        out = [
            {
                "tag": tag,
                "buildID": config.build_id or rec.last_build,
                "createdAt": _iso(rec.tagged_at.get(tag, rec.updated_at)),
            }
            for tag, config in rec.tags.items()
        ]
        return web.json_response(sorted(out, key=lambda t: (t["createdAt"], t["tag"])))

    async def logs(self, request: web.Request) -> web.Response:
        """A build's log entries from ``cursor`` (ms since the epoch) on (``forward``, oldest
        first) or back (``backward``, newest first), at or above ``level``, <= 100."""
        build_id = request.match_info["build"]
        try:
            uuid.UUID(build_id)
        except ValueError:
            raise InvalidRequest("Invalid build id") from None
        cursor = logs.ms_param(request, "cursor")
        limit = logs.limit_param(request, _MAX_LOGS, _MAX_LOGS)
        backward = logs.choice(request, "direction", ("forward", "backward"), "forward") == "backward"
        level = logs.choice(request, "level", logs.LEVELS, "debug")
        logs.choice(request, "source", ("temporary", "persistent"), "persistent")  # one store here
        rec = await self.templates._find(request[PRINCIPAL], request.match_info["id"])
        state = self.templates.builds.get(build_id)
        if rec is None or state is None or state.template_id != rec.template_id:
            raise InvalidRequest(f"Build '{build_id}' not found")  # E2B's answer: 400
        entries = logs.select(state.logs, cursor=cursor, backward=backward, level=level, limit=limit)
        return web.json_response({"logs": entries})
