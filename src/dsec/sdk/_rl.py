"""The SDK's RL calls: pause/resume, trajectories, changes, pack_diff and fork on a
:class:`~dsec.sdk.client.Sandbox`; whole-job pause/resume and lease renewal on the client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import (
    BulkAction,
    BulkResult,
    Change,
    ForkRequest,
    LayerInfo,
    LeaseRequest,
    LeaseResult,
    SandboxInfo,
    TrajectoryEntry,
)
from dsec.protocol.ops import Call, Changes, Commit, Pause, Resume, Trajectory

R = TypeVar("R")

if TYPE_CHECKING:
    from dsec.sdk._transport import Transport
    from dsec.sdk.client import Sandbox


class SandboxRlCalls:
    if TYPE_CHECKING:
        _t: Transport
        _base: str
        info: SandboxInfo

        def _sibling(self, info: SandboxInfo) -> Sandbox: ...

        async def _call(self, op: Call[R], *, timeout: float | None = None) -> R: ...

    async def pause(self) -> SandboxInfo:
        """Freeze the sandbox and push its memory out of RAM. Any later call resumes it."""
        self.info = await self._call(Pause())
        return self.info

    async def resume(self) -> SandboxInfo:
        """Resume now (memory prefetched, then thawed); calls resume by themselves anyway."""
        self.info = await self._call(Resume())
        return self.info

    async def trajectory(self, *, after: int = 0, limit: int = 1000) -> list[TrajectoryEntry]:
        """What this sandbox was asked to do and the outcomes, as its edge recorded them
        (oldest first; page with ``after`` = the last ``seq`` seen, until a page is empty: a
        page ends early once its steps hold 32 MiB)."""
        return await self._call(Trajectory(after=after, limit=limit))

    async def changes(self, under: str = "/") -> list[Change]:
        """Paths this sandbox added, modified or deleted relative to its layers, below ``under``
        (read on the host from its writable layer: the sandbox cannot hide a change)."""
        return await self._call(Changes(under=under))

    async def pack_diff(
        self, name: str, *, scrub_defaults: bool = True, exclude: list[str] | None = None
    ) -> LayerInfo:
        """Pack what this sandbox changed into the next version of layer ``name`` (or into
        ``name:version`` exactly). Only the diff is stored; ``exclude`` adds scrub patterns
        (paths relative to /, glob per component) to the default build residue. Restore with
        ``run_container(DSecContainerRunArgs(layers=[*sandbox.info.layers, layer.digest]))``.
        The sandbox keeps running, untouched."""
        op = Commit(ref=name, exclude=exclude or [], scrub_defaults=scrub_defaults)
        return await self._call(op, timeout=3600)

    async def fork(
        self, n: int, *, labels: dict[str, str] | None = None, processes: bool = False, timeout: float = 120
    ) -> list[Sandbox]:
        """``n`` new sandboxes with this one's disk state (created all or none). Process state
        is not copied: nodes report ``fork_processes`` in their capabilities, and asking for it
        where it is missing is an ``InvalidRequest``."""
        req = ForkRequest(count=n, labels=labels, processes=processes, timeout=timeout)
        body = await self._t.request(
            "POST", self._base + "/fork", json_body=req.model_dump(exclude_none=True), timeout=timeout + 60
        )
        return [self._sibling(SandboxInfo.model_validate(x)) for x in body]


class JobCalls:
    if TYPE_CHECKING:

        @property
        def _t(self) -> Transport: ...

    async def _bulk(self, action: BulkAction, labels: dict[str, str]) -> list[SandboxInfo]:
        if not labels:
            raise InvalidRequest(f"{action}_all needs at least one label")
        params = [("label", f"{k}={v}") for k, v in labels.items()]
        path = "/v1/sandboxes" if action == "stop" else f"/v1/sandboxes/{action}"
        method = "DELETE" if action == "stop" else "POST"
        result = BulkResult.model_validate(await self._t.request(method, path, params=params, timeout=600))
        if result.unreachable_nodes:
            raise InfraFailure(
                f"{action}: {len(result.done)} sandboxes done, but nodes {result.unreachable_nodes} did"
                " not answer: their sandboxes with these labels were not touched (call again)",
                reason=InfraReason.edge_unreachable,
            )
        if result.failed:
            raise InfraFailure(
                f"could not {action} {sorted(result.failed)}: {result.failed}", reason=InfraReason.runtime
            )
        return result.done

    async def stop_all(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Stop every sandbox that carries all ``labels`` (e.g. ``{"job": job_id}``), on every node,
        in one call. Returns what was stopped; raises if any could not be stopped."""
        return await self._bulk("stop", labels)

    async def pause_all(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Pause every sandbox carrying all ``labels``, cluster-wide, in one call (a preempted
        job); each resumes by itself on its next request."""
        return await self._bulk("pause", labels)

    async def resume_all(self, labels: dict[str, str]) -> list[SandboxInfo]:
        return await self._bulk("resume", labels)

    async def renew_lease(self, job: str, lease_s: float) -> LeaseResult:
        """Keep job ``job``'s sandboxes (created with ``lease_s``) alive for ``lease_s`` more
        seconds: one call per job, not per sandbox. Raises if a node holding some did not answer."""
        body: Any = await self._t.request(
            "POST", f"/v1/jobs/{job}/lease", json_body=LeaseRequest(lease_s=lease_s).model_dump()
        )
        result = LeaseResult.model_validate(body)
        if result.unreachable_nodes:
            raise InfraFailure(
                f"lease of job {job!r} renewed on all nodes but {result.unreachable_nodes}: call again",
                reason=InfraReason.edge_unreachable,
            )
        return result
