"""Projects, quotas and API keys over HTTP.

Every call acts as the request's key (``actor``): a key manages its own project's subtree,
never above it, and cannot raise its own quota (see :mod:`dsec.iam.base`). Project IDs are
paths (``root/team/rollout-17``), so they travel in bodies and query strings, not in routes.

Storage quotas are IAM's but enforced by the layer store, which every node writes to: each
change is mirrored into the store (:mod:`dsec.images.storage_quota`), and :func:`sync_storage_quotas`
rebuilds the mirror from IAM when an apiserver starts. Usage shows the bytes of layers each
subtree owns, counted by the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL, read_body, respond
from dsec.iam import ROOT_PROJECT, IamStore, ProjectInfo, Quota
from dsec.iam.base import in_subtree
from dsec.images.store import LayerStore
from dsec.observe.audit import audited
from dsec.protocol.models import KeyCreate, ProjectCreate, QuotaModel, QuotaUpdate


def _quota(model: QuotaModel) -> Quota:
    return Quota(
        sandboxes=model.sandboxes,
        cpu_cores=model.cpu_cores,
        memory_mib=model.memory_mib,
        storage_mib=model.storage_mib,
    )


async def sync_storage_quotas(iam: IamStore, store: LayerStore) -> None:
    """Make the store's mirror of storage quotas IAM's again (a change made while no apiserver
    ran, or lost when one died between IAM and the mirror)."""
    want = {p.id: p.quota.storage_mib for p in await iam.list_projects(ROOT_PROJECT)}

    def sync() -> None:
        have = store.storage_quotas()
        for project, mib in want.items():
            if have.get(project) != mib:
                store.set_storage_quota(project, mib)
        for project in have.keys() - want.keys():
            store.set_storage_quota(project, None)

    await asyncio.to_thread(sync)


def _plain(value: Any) -> Any:
    return (
        dataclasses.asdict(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
        else value
    )


class ProjectRoutes:
    def __init__(self, iam: IamStore, store: LayerStore) -> None:
        self.iam = iam
        self.store = store

    async def _mirror(self, info: ProjectInfo) -> None:
        await asyncio.to_thread(self.store.set_storage_quota, info.id, info.quota.storage_mib)

    async def _with_storage(self, infos: Sequence[ProjectInfo]) -> list[ProjectInfo]:
        used = await asyncio.to_thread(self.store.storage_usage, [i.id for i in infos])
        usage = {i.id: dataclasses.replace(i.usage, storage_bytes=used[i.id]) for i in infos}
        return [dataclasses.replace(i, usage=usage[i.id]) for i in infos]

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/projects", self.create)
        router.add_get("/v1/projects", self.list)
        router.add_post("/v1/projects/quota", self.set_quota)
        router.add_delete("/v1/projects", self.delete)
        router.add_get("/v1/projects/usage", self.usage)
        router.add_post("/v1/keys", self.issue_key)
        router.add_get("/v1/keys", self.list_keys)
        router.add_delete("/v1/keys", self.revoke_key)

    @audited("project.create", body=("parent", "name", "quota"))
    async def create(self, request: web.Request) -> web.Response:
        req: ProjectCreate = await read_body(request, ProjectCreate)
        info = await self.iam.create_project(
            req.parent, req.name, _quota(req.quota), actor=request[PRINCIPAL]
        )
        await self._mirror(info)
        return respond(_plain(info), status=201)

    async def list(self, request: web.Request) -> web.Response:
        under = request.query.get("under") or request[PRINCIPAL].project
        infos = await self.iam.list_projects(under, actor=request[PRINCIPAL])
        return respond([_plain(i) for i in await self._with_storage(infos)])

    @audited("project.set_quota", body=("project", "quota"))
    async def set_quota(self, request: web.Request) -> web.Response:
        req: QuotaUpdate = await read_body(request, QuotaUpdate)
        info = await self.iam.set_quota(req.project, _quota(req.quota), actor=request[PRINCIPAL])
        await self._mirror(info)
        return respond(_plain(info))

    @audited("project.delete", query=("project",))
    async def delete(self, request: web.Request) -> web.Response:
        project = request.query.get("project", "")
        await self.iam.delete_project(project, actor=request[PRINCIPAL])
        # Its layers stay (and count for the projects above it) until untagged and collected.
        gone = [p for p in await asyncio.to_thread(self.store.storage_quotas) if in_subtree(p, project)]
        for p in gone:
            await asyncio.to_thread(self.store.set_storage_quota, p, None)
        return respond({"deleted": True})

    async def usage(self, request: web.Request) -> web.Response:
        project = request.query.get("project") or request[PRINCIPAL].project
        info = await self.iam.get_project(project, actor=request[PRINCIPAL])
        return respond(_plain((await self._with_storage([info]))[0].usage))

    @audited("key.issue", body=("project", "admin", "name"))  # never the key: it is in the answer
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

    @audited("key.revoke", query=("key_id",))
    async def revoke_key(self, request: web.Request) -> web.Response:
        revoked = await self.iam.revoke_key(request.query.get("key_id", ""), actor=request[PRINCIPAL])
        return respond({"revoked": revoked})
