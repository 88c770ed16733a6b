"""Projects, quotas and API keys: the part of :class:`DSecClient` an agent harness uses to give
each rollout its own bounded project."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dsec.protocol.models import KeyCreate, ProjectCreate, QuotaModel, QuotaUpdate

if TYPE_CHECKING:
    from dsec.sdk._transport import Transport


class ProjectCalls:
    if TYPE_CHECKING:

        @property
        def _t(self) -> Transport: ...

    async def create_project(
        self,
        parent: str,
        name: str,
        *,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mib: int | None = None,
        storage_mib: int | None = None,
    ) -> dict[str, Any]:
        """Create ``parent/name`` with quotas bounding its whole subtree (``None``: only the
        parent's bounds apply; a child's quota may not exceed its parent's). ``storage_mib``
        bounds the bytes of layers the subtree owns (imports and commits past it: QuotaExceeded)."""
        quota = QuotaModel(
            sandboxes=sandboxes, cpu_cores=cpu_cores, memory_mib=memory_mib, storage_mib=storage_mib
        )
        req = ProjectCreate(parent=parent, name=name, quota=quota)
        body: dict[str, Any] = await self._t.request("POST", "/v1/projects", json_body=req.model_dump())
        return body

    async def list_projects(self, under: str | None = None) -> list[dict[str, Any]]:
        """``under`` (default: the key's project) and its descendants, with quotas and usage."""
        params = {"under": under} if under else None
        body: list[dict[str, Any]] = await self._t.request("GET", "/v1/projects", params=params)
        return body

    async def set_quota(
        self,
        project: str,
        *,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mib: int | None = None,
        storage_mib: int | None = None,
    ) -> dict[str, Any]:
        quota = QuotaModel(
            sandboxes=sandboxes, cpu_cores=cpu_cores, memory_mib=memory_mib, storage_mib=storage_mib
        )
        req = QuotaUpdate(project=project, quota=quota)
        body: dict[str, Any] = await self._t.request("POST", "/v1/projects/quota", json_body=req.model_dump())
        return body

    async def delete_project(self, project: str) -> None:
        await self._t.request("DELETE", "/v1/projects", params={"project": project})

    async def project_usage(self, project: str | None = None) -> dict[str, Any]:
        params = {"project": project} if project else None
        body: dict[str, Any] = await self._t.request("GET", "/v1/projects/usage", params=params)
        return body

    async def issue_key(
        self, project: str, *, admin: bool = False, name: str = "", format: Literal["dsec", "e2b"] = "dsec"
    ) -> str:
        """A new API key for ``project`` (shown once: only its digest is stored); ``format="e2b"``
        gives an ``e2b_<hex>`` key for E2B's SDKs (same project, quotas and visibility)."""
        req = KeyCreate(project=project, admin=admin, name=name, format=format)
        body = await self._t.request("POST", "/v1/keys", json_body=req.model_dump())
        return str(body["key"])

    async def list_keys(self, project: str | None = None) -> list[dict[str, Any]]:
        params = {"project": project} if project else None
        body: list[dict[str, Any]] = await self._t.request("GET", "/v1/keys", params=params)
        return body

    async def revoke_key(self, key_id: str) -> bool:
        body = await self._t.request("DELETE", "/v1/keys", params={"key_id": key_id})
        return bool(body["revoked"])
