"""Projects, quotas and API keys over HTTP.

Every call acts as the request's key (``actor``): a key manages its own project's subtree,
never above it, and cannot raise its own quota (see :mod:`dsec.iam.base`). Project IDs are
paths (``root/team/rollout-17``), so they travel in bodies and query strings, not in routes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL, read_body, respond
from dsec.iam import IamStore, Quota
from dsec.protocol.models import KeyCreate, ProjectCreate, QuotaModel, QuotaUpdate


def _quota(model: QuotaModel) -> Quota:
    return Quota(sandboxes=model.sandboxes, cpu_cores=model.cpu_cores, memory_mib=model.memory_mib)


def _plain(value: Any) -> Any:
    return (
        dataclasses.asdict(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
        else value
    )


class ProjectRoutes:
    def __init__(self, iam: IamStore) -> None:
        self.iam = iam

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/projects", self.create)
        router.add_get("/v1/projects", self.list)
        router.add_post("/v1/projects/quota", self.set_quota)
        router.add_delete("/v1/projects", self.delete)
        router.add_get("/v1/projects/usage", self.usage)
        router.add_post("/v1/keys", self.issue_key)
        router.add_get("/v1/keys", self.list_keys)
        router.add_delete("/v1/keys", self.revoke_key)

    async def create(self, request: web.Request) -> web.Response:
        req: ProjectCreate = await read_body(request, ProjectCreate)
        info = await self.iam.create_project(
            req.parent, req.name, _quota(req.quota), actor=request[PRINCIPAL]
        )
        return respond(_plain(info), status=201)

    async def list(self, request: web.Request) -> web.Response:
        under = request.query.get("under") or request[PRINCIPAL].project
        infos = await self.iam.list_projects(under, actor=request[PRINCIPAL])
        return respond([_plain(i) for i in infos])

    async def set_quota(self, request: web.Request) -> web.Response:
        req: QuotaUpdate = await read_body(request, QuotaUpdate)
        info = await self.iam.set_quota(req.project, _quota(req.quota), actor=request[PRINCIPAL])
        return respond(_plain(info))

    async def delete(self, request: web.Request) -> web.Response:
        await self.iam.delete_project(request.query.get("project", ""), actor=request[PRINCIPAL])
        return respond({"deleted": True})

    async def usage(self, request: web.Request) -> web.Response:
        project = request.query.get("project") or request[PRINCIPAL].project
        return respond(_plain(await self.iam.usage(project, actor=request[PRINCIPAL])))

    async def issue_key(self, request: web.Request) -> web.Response:
        req: KeyCreate = await read_body(request, KeyCreate)
        key = await self.iam.issue_key(
            req.project, admin=req.admin, name=req.name, format=req.format, actor=request[PRINCIPAL]
        )
        return respond({"key": key, "project": req.project}, status=201)  # shown once, never again

    async def list_keys(self, request: web.Request) -> web.Response:
        project = request.query.get("project") or request[PRINCIPAL].project
        keys = await self.iam.list_keys(project, actor=request[PRINCIPAL])
        return respond([_plain(k) for k in keys])

    async def revoke_key(self, request: web.Request) -> web.Response:
        revoked = await self.iam.revoke_key(request.query.get("key_id", ""), actor=request[PRINCIPAL])
        return respond({"revoked": revoked})
