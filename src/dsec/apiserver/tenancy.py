"""Who may see a sandbox, and who pays for it.

A sandbox belongs to a project, written into its reserved ``dsec.project`` label at create
time, so any apiserver can check access from the sandbox alone (no per-sandbox state here).
A key sees its project's sandboxes and those of its sub-projects; any other sandbox answers
"not found", so its existence is not revealed.

Quotas are enforced by the IAM store's ledger: a create reserves its CPU and memory in the
project's whole ancestor chain in one transaction before any node works (no overshoot under
concurrent creates from several apiservers), under the ID the apiserver chose for the sandbox
on the node placement picked (one transaction per create; a retry on another node moves the
row), and releases it when the sandbox stops. What an edge reaps by itself (idle TTL, lifetime,
death) is released by :meth:`Tenancy.reconcile_forever`, which compares the ledger with what the
edges report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from dsec.edge.link import EdgeLink
from dsec.iam import IamStore, Principal, can_access
from dsec.protocol.errors import Forbidden, SandboxNotFound
from dsec.protocol.models import PROJECT_LABEL, ContainerSpec, SandboxInfo

log = logging.getLogger("dsec.apiserver")
_NODES_PER_PASS = 16


class Tenancy:
    def __init__(
        self, iam: IamStore, *, reconcile_interval_s: float = 5.0, pending_expiry_s: float = 3900
    ) -> None:
        self.iam = iam
        self.reconcile_interval_s = reconcile_interval_s
        self.pending_expiry_s = pending_expiry_s  # longer than any create may take
        self._task: asyncio.Task[None] | None = None

    def check_visible(self, principal: Principal, sandbox_id: str, project: str) -> None:
        if not can_access(principal, project):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")

    def visible(self, principal: Principal, infos: list[SandboxInfo]) -> list[SandboxInfo]:
        return [i for i in infos if can_access(principal, i.project)]

    def admit(self, principal: Principal, project: str | None, spec: ContainerSpec) -> ContainerSpec:
        """The spec labelled with the project it is billed to (default: the key's project)."""
        project = project or principal.project
        if not can_access(principal, project):
            raise Forbidden(f"this key cannot create sandboxes in project {project!r}")
        return spec.model_copy(update={"labels": {**spec.labels, PROJECT_LABEL: project}})

    async def reserve(self, principal: Principal, sandbox_id: str, spec: ContainerSpec) -> None:
        """Hold the spec's resources under the ID the sandbox will have (``QuotaExceeded``)."""
        project = spec.labels[PROJECT_LABEL]
        await self.iam.reserve(
            project, sandbox_id, spec.cpu_cores_limit, spec.memory_limit_mb, actor=principal
        )

    async def move(self, old_id: str, new_id: str) -> None:
        """The create went to another node: its reservation follows it under the new ID."""
        await self.iam.bind(old_id, new_id)

    async def confirm(self, principal: Principal, sandbox_id: str, spec: ContainerSpec) -> None:
        """After a slow create: reconciliation may have released the reservation meanwhile
        (the edge did not list the sandbox yet); refresh it, or reserve again."""
        try:
            await self.iam.bind(sandbox_id, sandbox_id)
        except SandboxNotFound:
            await self.reserve(principal, sandbox_id, spec)

    async def release(self, sandbox_id: str) -> None:
        await self.iam.release(sandbox_id)

    async def release_many(self, sandbox_ids: list[str]) -> None:
        if sandbox_ids:
            await self.iam.release_many(sandbox_ids)

    async def reconcile(self, edges: Mapping[str, EdgeLink], *, grace_s: float = 30.0) -> None:
        """Release the quota of sandboxes the edges no longer run (reaped, died, lost).

        Reservations younger than ``grace_s`` are spared: a report may predate their create.
        """
        names = list(edges)
        # A few nodes per query: one query for the whole cluster would hold the event loop for
        # ~100 ms at 30k sandboxes (create p99 pays it); one per node costs 10x the CPU.
        for at in range(0, len(names), _NODES_PER_PASS):
            chunk = names[at : at + _NODES_PER_PASS]
            answers = await asyncio.gather(*(edges[n].sandbox_ids() for n in chunk), return_exceptions=True)
            # A node that does not answer keeps its quota: its sandboxes may still run.
            live = {n: a for n, a in zip(chunk, answers, strict=True) if not isinstance(a, BaseException)}
            released = await self.iam.reconcile_nodes(live, grace_s=grace_s)  # IDs only
            if released:
                log.info("released quota of %d sandboxes gone from their nodes", len(released))
        await self.iam.expire_pending(self.pending_expiry_s)

    def start(self, edges: Mapping[str, EdgeLink]) -> None:
        self._task = asyncio.create_task(self._reconcile_forever(edges))

    async def _reconcile_forever(self, edges: Mapping[str, EdgeLink]) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval_s)
            try:
                await self.reconcile(edges)
            except Exception:
                log.exception("quota reconciliation failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
