"""Creating sandboxes: from a create (or a whole-VM fork) admitted to a sandbox running.

A create is checked against the node (its fences, backends and hardware), its image resolved
to layers, given an ID and room (:class:`~dsec.edge.admission.Admission`), then started:
journaled ``creating`` before anything is made, its layers mounted, the backend run, its
network connected, journaled ``running`` and admitted to the sandbox table. A failure at any
step leaves a ``failed`` record saying why and no layer reference. A fork starts its copies
the same way from one snapshot, all or none. The phases are timed (admission, layer_mount,
runtime_start: :mod:`dsec.observe.edge_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend, CreateContext, Forkable
from dsec.backends.handle import Handle
from dsec.edge.admission import Admission
from dsec.edge.config import EdgeConfig
from dsec.edge.journal import Journal, Record
from dsec.edge.networking import Networking
from dsec.edge.pausing import Pausing
from dsec.edge.tally import LiveSandboxes, _Live
from dsec.edge.users import resolve_user
from dsec.images.mounts import LayerMounts
from dsec.images.oci import drop_shadowed_duplicates
from dsec.images.store import LayerStore
from dsec.netpolicy.policy import EgressPolicy
from dsec.observe.edge_metrics import EdgeMetrics
from dsec.protocol.errors import (
    CapacityExhausted,
    Conflict,
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
)
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import RESERVED_LABEL_PREFIX, ContainerSpec, SandboxInfo, SandboxState


class Creating:
    """The edge's create service: admits and starts sandboxes, and forks running VMs.

    ``epoch``, ``fenced`` and ``drain_fence`` read the edge's current ones (they change while
    it runs); ``admit`` puts a started sandbox in the table; ``stop`` stops one (a fork's
    copies when another copy failed).
    """

    def __init__(
        self,
        config: EdgeConfig,
        store: LayerStore,
        mounts: LayerMounts,
        journal: Journal,
        egress: EgressPolicy,
        prom: EdgeMetrics,
        live: LiveSandboxes,
        backends: Mapping[str, Backend],
        hardware: dict[str, Any],
        admission: Admission,
        networking: Networking,
        pausing: Pausing,
        *,
        epoch: Callable[[], int],
        fenced: Callable[[], str],
        drain_fence: Callable[[], str],
        admit: Callable[[_Live], None],
        stop: Callable[[str], Awaitable[SandboxInfo]],
        volume_sources: Callable[[ContainerSpec], Awaitable[dict[str, str]]] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.mounts = mounts
        self.journal = journal
        self.egress = egress
        self.prom = prom
        self.live = live
        self.backends = backends
        self.hardware = hardware
        self.admission = admission
        self.networking = networking
        self.pausing = pausing
        self.epoch = epoch
        self.fenced = fenced
        self.drain_fence = drain_fence
        self.admit = admit
        self.stop = stop
        self.volume_sources = volume_sources
        self.under_way = 0  # creates started and not yet running or failed

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        """Admit and start a sandbox; ``sandbox_id`` is the ID the apiserver chose, if it did."""
        node = self.config.node
        if why := self.fenced() or self.drain_fence():
            raise CapacityExhausted(f"node {node} refuses creates: {why}")
        backend = self.backends.get(spec.type)
        if backend is None:
            raise CapacityExhausted(f"node {node} does not run {spec.type} sandboxes")
        unmet = spec.hardware.unmet(self.hardware)
        if unmet is not None:
            raise CapacityExhausted(f"node {node} cannot host this sandbox: it {unmet}")
        # LayerNotFound if unknown; an image name expands to its layers, base first
        stacked = [layer for ref in spec.layer_refs() for layer in self.store.resolve_image(ref)]
        # overlayfs refuses one lower directory twice; the upper-most copy alone means the same
        by_digest = {layer.digest: layer for layer in stacked}
        layers = [by_digest[d] for d in drop_shadowed_duplicates([layer.digest for layer in stacked])]
        sid = self._new_id(sandbox_id)
        spec = self.admission.with_default_disk(spec, backend)
        admitting = time.perf_counter()
        try:
            async with self.admission.reserve(spec):
                self.prom.phase("admission", admitting)
                digests = [layer.digest for layer in layers]
                return await self._start(sid, spec, backend, digests, backend.create)
        except CapacityExhausted as exc:
            self.prom.refused(exc)
            raise

    async def fork(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        """Copies of a running VM sandbox on this node, memory and processes included: one
        snapshot restored ``len(new_ids)`` times (IDs chosen by the apiserver), all or none."""
        live = await self.pausing.use(sandbox_id)
        backend = self.backends[live.record.backend]
        if not isinstance(backend, Forkable):
            raise InvalidRequest(f"sandbox {sandbox_id} ({live.record.backend}) cannot be forked whole")
        ids = [self._new_id(i) for i in new_ids]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("fork: the new sandbox IDs must differ")
        rec = live.record
        own = {k: v for k, v in rec.spec.labels.items() if k.startswith(RESERVED_LABEL_PREFIX)}
        spec = rec.spec if labels is None else rec.spec.model_copy(update={"labels": {**own, **labels}})
        with live.working():
            source = await backend.fork_source(sandbox_id, rec.handle)
        try:
            made = await asyncio.gather(
                *(
                    self._start(nid, spec, backend, rec.layers, lambda ctx: backend.create_fork(ctx, source))
                    for nid in ids
                ),
                return_exceptions=True,
            )
        finally:
            await backend.release_fork_source(source)
        failed = [m for m in made if not isinstance(m, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self.stop(m.id) for m in made if isinstance(m, SandboxInfo)))
            raise failed[0]
        return [m for m in made if isinstance(m, SandboxInfo)]

    async def _start(
        self,
        sid: str,
        spec: ContainerSpec,
        backend: Backend,
        digests: list[str],
        start: Callable[[CreateContext], Awaitable[Handle]],
    ) -> SandboxInfo:
        """Journal a new sandbox, mount its layers and have ``start`` run it; on failure the
        record says why and no layer reference is kept."""
        self.networking.check(spec, backend)
        volumes = {}
        if spec.volumes:
            if self.volume_sources is None:
                raise InvalidRequest(f"node {self.config.node} keeps no shared volumes")
            volumes = await self.volume_sources(spec)  # VolumeNotFound before anything is made
        if drain := self.drain_fence():  # fenced while admission held it: a drain counts on none landing
            raise CapacityExhausted(f"node {self.config.node} refuses creates: {drain}")
        self.under_way += 1
        acquired: list[str] = []
        rec: Record | None = None
        try:
            dirs = []
            mounting = time.perf_counter()
            for digest in digests:
                dirs.append(await self._acquire_layer(digest))
                acquired.append(digest)
            self.prom.phase("layer_mount", mounting)
            user = resolve_user(dirs, spec.init_user)
            rec = Record(sid, SandboxState.creating, backend.name, spec, acquired, dataclasses.asdict(user))
            self.journal.insert(rec)
            ctx = CreateContext(sid, spec, dirs, user, self.config.workdir(sid), layer_digests=acquired)
            ctx.nameserver = self.egress.config.gateway if self.egress.enabled else None
            ctx.volume_mounts = volumes
            await self.networking.open_link(ctx, backend)  # a VM's tap, before its QEMU starts
            starting = time.perf_counter()
            rec.handle = await start(ctx)  # cleans up after itself when it fails
            try:
                await self.networking.connect(rec)
            except BaseException:
                await self.egress.release(sid)
                await backend.destroy(sid, rec.handle, ctx.workdir)
                raise
            rec.state = SandboxState.running
            rec.last_active_at = time.time()
            self.journal.update(rec)
            self.prom.phase("runtime_start", starting)
            self.prom.created(sid, backend.name)
            self.admit(_Live(rec, user))
            self.pausing.take_lease(spec)  # after it is live: a lease covering nothing is dropped
            return rec.info(self.config.node)
        except BaseException as exc:
            self.prom.create_failed(backend.name, exc)
            for digest in acquired:
                self.mounts.release(digest)
            if rec is not None:
                with contextlib.suppress(Exception):
                    await self.egress.release(sid)  # a VM's tap made before it failed to start
                rec.state = SandboxState.failed
                rec.stop_reason = f"create failed: {exc}"[:500]
                self.journal.update(rec)
            if isinstance(exc, DSecError | asyncio.CancelledError):
                raise
            raise InfraFailure(f"create failed: {exc}", reason=InfraReason.runtime) from exc
        finally:
            self.under_way -= 1

    async def _acquire_layer(self, digest: str) -> Path:
        # Off the event loop: a node's first mount of a layer hashes it (a single image) or
        # copies its metadata (a split one). A cancelled create still waits for the mount to
        # finish and gives the reference back, so no reference leaks.
        job = asyncio.ensure_future(asyncio.to_thread(self.mounts.acquire_layer, self.store, digest))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await job
                self.mounts.release(digest)
            raise

    def _new_id(self, requested: str | None) -> str:
        node, epoch = self.config.node, self.epoch()
        if requested is None:
            return str(SandboxId.new(node, epoch))
        sid = SandboxId.parse(requested)
        if (sid.node, sid.epoch) != (node, epoch):
            # The apiserver's view of this node is out of date: it should place the create again.
            raise CapacityExhausted(
                f"{requested} is not an ID of node {node!r} epoch {epoch}: place it again"
            )
        if requested in self.live or self.journal.get(requested) is not None:
            raise Conflict(f"sandbox {requested} already exists")
        return requested
