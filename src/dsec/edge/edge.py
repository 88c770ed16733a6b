"""The edge: one per node, the final authority over the sandboxes it runs.

It admits or rejects creates, journals each transition before acting on it, mounts layers
once per node, drives the backend, owns every session and pipe, and reclaims sandboxes whose
idle TTL or maximum lifetime ran out. A restart reconciles the journal with the runtime.

The edge is the lifecycle (create, fork, stop, reconcile) and builds its services, each given
what it uses and none importing the edge: ``edge.admission``, ``.pausing`` (with job leases),
``.reclaimer``, ``.networking``, ``.processes``, ``.commands`` (:mod:`.op_handlers` calls them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend, CollectsUnused, CreateContext, Forkable, User
from dsec.backends.handle import Handle
from dsec.density.ksm import Ksm
from dsec.density.swap import Swap, free_swap_bytes
from dsec.edge import hardware
from dsec.edge.admission import Admission
from dsec.edge.commands import Commands
from dsec.edge.config import EdgeConfig
from dsec.edge.fncall.pool import POOL_LABEL, FnPool
from dsec.edge.journal import Journal, Record
from dsec.edge.metrics import MetricsSampler
from dsec.edge.networking import Networking
from dsec.edge.pausing import PauseTotals, Pausing
from dsec.edge.processes import Processes
from dsec.edge.reclaim import Reclaimer
from dsec.edge.tally import LiveSandboxes, _Live
from dsec.edge.trajectory import Recorder, TrajectoryLog
from dsec.edge.users import resolve_user
from dsec.edge.wakeups import Wakeups
from dsec.executor.process import SandboxProcess, watch_children_with_pidfds
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
    SandboxNotFound,
)
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    RESERVED_LABEL_PREFIX,
    ContainerSpec,
    SandboxInfo,
    SandboxState,
)

log = logging.getLogger("dsec.edge")

# Registers this node with its cluster: given the epoch the journal claims (None: no state),
# returns the epoch to use (iam/registry.py has the rule).
Registrar = Callable[[int | None], Awaitable[int]]
_MAX_LABELS_REPORTED = 1000


class Edge:
    def __init__(
        self,
        config: EdgeConfig,
        backend: Backend,
        store: LayerStore,
        mounts: LayerMounts,
        *,
        more_backends: Sequence[Backend] = (),
    ) -> None:
        self.config = config
        self.backend = backend  # the one container sandboxes use
        # By the spec type each serves (a backend's name is the type: container, microvm).
        self.backends: dict[str, Backend] = {b.name: b for b in (backend, *more_backends)}
        self.store = store
        self.mounts = mounts
        handle_types = {name: b.handle_type for name, b in self.backends.items()}
        self.journal = Journal(config.data_dir / "edge" / "journal.sqlite", handle_types)
        claimed = self.journal.meta("epoch")
        # The epoch this node's journal was written under; start() confirms it with the cluster.
        self.epoch = int(claimed) if claimed is not None else 0
        self.fenced = ""  # why this edge must not create (another registration replaced it)
        # Why an apiserver fenced it (scale-in drains it: POST /edge/v1/fence); it may lift it.
        self.drain_fence = ""
        self.hardware = hardware.detect(config.node_labels)
        self.pools = {c.name: FnPool(self, c) for c in config.fncall_pools}
        self.swap = Swap(config.swap, config.data_dir)
        self.ksm = Ksm(config.ksm, self.journal, owner=config.data_dir)  # claimed per node
        self.recorder = Recorder(TrajectoryLog(config.data_dir / "edge" / "trajectory.sqlite"))
        self.egress = EgressPolicy(config.egress, config.node, self.journal, config.data_dir / "edge")
        # The edge's services (each given what it uses, none the edge), over one sandbox table.
        self._live = LiveSandboxes()
        self._creating = 0
        self._wakeups = Wakeups()  # when the reaper next looks at each sandbox
        self.metrics = MetricsSampler(lambda: self._live, self.backend_of)  # E2B's get_metrics
        self.prom = EdgeMetrics()  # Prometheus: this edge's own registry (observe/edge_metrics.py)
        self.pause_totals = PauseTotals()
        live, journal, recorder, backend_of = self._live, self.journal, self.recorder, self.backend_of
        self.networking: Networking = Networking(
            self.egress, journal, recorder, live, backend_of, config.node
        )
        self.pausing: Pausing = Pausing(
            config, journal, recorder, live, self._wakeups, self.prom, backend_of, self.pause_totals
        )
        self.admission: Admission = Admission(
            config, live, creating=lambda: self._creating, pause=self.pausing.pause
        )
        self.reclaimer: Reclaimer = Reclaimer(
            config, journal, recorder, live, self._wakeups, self.prom, backend_of, self.pausing,
            stop=self.stop, relieve_pressure=self.admission.relieve_pressure
        )  # fmt: skip
        self.processes: Processes = Processes(recorder, live, backend_of, self.pausing)
        self.commands: Commands = Commands(
            config, store, mounts, recorder, self.prom, live, backend_of, self.pausing, self.networking,
            get=self.get
        )  # fmt: skip
        self.prom.bind(self)

    # -- lifecycle of the edge itself -------------------------------------------------------

    async def start(self, register: Registrar | None = None) -> None:
        """Take the node's epoch (from the cluster's registry if given), then re-adopt.

        Without a registry the edge keeps its journal's epoch, or starts a new one from the
        clock. Sandboxes journaled under another epoch than the one granted cannot be reached
        by their IDs any more, so they are stopped rather than adopted.
        """
        claimed = self.epoch or None
        if register is not None:
            self.epoch = await register(claimed)
        elif claimed is None:
            self.epoch = int(time.time())
        if self.epoch != claimed:
            self.journal.set_meta("epoch", str(self.epoch))
        watch_children_with_pidfds()
        for each in self.backends.values():
            await each.prepare_node()
        await asyncio.to_thread(self.swap.ensure)
        self.ksm.ensure()  # before the pools start: their runners mark memory only for a ksmd
        await self._reconcile()
        await self.egress.start({sid: live.record.spec.network_rules for sid, live in self._live.items()})
        self.reclaimer.start()
        self.metrics.start()
        # Pool sandboxes do not outlive their runners' pipes, which died with the last edge.
        stale = [sid for sid, live in self._live.items() if POOL_LABEL in live.record.spec.labels]
        await asyncio.gather(*(self.stop(sid, reason="fncall pool restarted") for sid in stale))
        await asyncio.gather(*(pool.start() for pool in self.pools.values()))

    async def close(self, *, stop_sandboxes: bool = False) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()))
        await self.metrics.close()
        await self.reclaimer.close()
        if stop_sandboxes:
            await asyncio.gather(*(self.stop(i, reason="edge_shutdown") for i in list(self._live)))
        for live in self._live.values():
            for s in live.sessions.values():
                s.detach()  # what the agent started in the background keeps running
            live.processes.forget_all()
        for backend in self.backends.values():
            await backend.detach()
        if not any(live.record.state is SandboxState.paused for live in self._live.values()):
            # Swapping off pulls pages back into RAM: never while something is paused.
            await asyncio.to_thread(self.swap.release)
        if not self._live:
            self.ksm.release()  # VMs live on across an edge restart, and merge on meanwhile
        await self.egress.close()
        self.journal.close()
        self.recorder.log.close()

    async def _reconcile(self) -> None:
        known = set()
        for rec in self.journal.live():
            known.add(rec.id)
            user = User(**rec.user)
            current = SandboxId.parse(rec.id).epoch == self.epoch
            adoptable = rec.state in (SandboxState.running, SandboxState.paused)
            backend = self.backends.get(rec.backend)
            if backend is None:
                log.error("%s needs the %s backend, which this edge does not run", rec.id, rec.backend)
                continue
            if current and adoptable and await backend.alive(rec.id, rec.handle):
                for digest in rec.layers:
                    self.mounts.acquire_layer(self.store, digest)
                try:
                    await self.pausing.reapply_pause_state(rec)
                except DSecError as exc:  # its cgroup vanished: the liveness check will reap it
                    log.warning("re-adopting %s: %s", rec.id, exc)
                self._admit(_Live(rec, user))
                log.info("re-adopted %s (%s)", rec.id, rec.state.value)
                continue
            reason = {
                SandboxState.creating: "edge restarted during create",
                SandboxState.stopping: rec.stop_reason or "stopped",
            }.get(rec.state, "sandbox died while the edge was down")
            if not current and adoptable:
                reason = f"the node re-registered with a new epoch ({self.epoch})"
            await backend.destroy(rec.id, rec.handle, self.config.workdir(rec.id))
            rec.state = SandboxState.stopped if rec.state is SandboxState.stopping else SandboxState.failed
            rec.stop_reason = reason
            self.journal.update(rec)
        for each in self.backends.values():
            for orphan in await each.leftovers():
                if orphan not in known:
                    await each.destroy(orphan, each.handle_type(), self.config.workdir(orphan))

    def backend_of(self, rec: Record) -> Backend:
        return self.backends[rec.backend]

    # -- sandboxes --------------------------------------------------------------------------

    def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        """Digests this node has mounted or is using (garbage collection must keep them).

        ``unmount_idle`` first unmounts layers no sandbox uses (kept mounted otherwise, for
        the shared page cache), so a collection can free them.
        """
        if unmount_idle:
            self.mounts.unmount_unused()
            # The same round collects what backends built from layers on this node (bases).
            for backend in self.backends.values():
                if isinstance(backend, CollectsUnused):
                    backend.collect_unused()
        used = {digest for live in self._live.values() for digest in live.record.layers}
        for live in self._live.values():  # a full VM's imported image (kept by the same gc)
            if image := live.record.handle.image_in_use():
                used.add(image)
        return used | set(self.mounts.mounted())

    def committed(self) -> tuple[int, float]:
        """(memory bytes, CPU cores) the running sandboxes may use at most (observe/edge_metrics.py)."""
        return self.admission.committed()

    async def spawn_service(self, sandbox_id: str, argv: list[str]) -> SandboxProcess:
        """A FnCall runner (:class:`~dsec.edge.fncall.pool.PoolHost`)."""
        return await self.processes.spawn_service(sandbox_id, argv)

    def fence(self, reason: str) -> None:
        """Refuse creates from now on: this node's name and epoch belong to another edge."""
        if not self.fenced:
            log.error("edge fenced, creates refused: %s", reason)
        self.fenced = reason

    def stats(self) -> dict[str, Any]:
        """Health and load for the watcher: totals, and running counts per backend, project, label."""
        live = self._live  # counted as sandboxes come and go (edge/tally.py), not here
        return {
            "node": self.config.node,
            "epoch": self.epoch,
            "backends": [*self.backends, *(["fncall"] if self._fncall_serving() else [])],
            "running": len(self._live),  # paused ones included: they hold the node's disk
            "paused": len(live.paused),
            "creating": self._creating,
            "capacity": 0 if self.fenced or self.drain_fence else self.config.max_sandboxes,
            "fenced": bool(self.fenced or self.drain_fence),  # every apiserver's placement skips it
            "hardware": self.hardware,
            "by_backend": dict(live.by_backend),
            "by_project": dict(live.by_project),
            # Bounded: a label per rollout would otherwise make every poll as large as the node.
            "by_label": dict(live.by_label.most_common(_MAX_LABELS_REPORTED)),
            "fncall": {name: pool.stats() for name, pool in self.pools.items()},
            "pause": dataclasses.asdict(self.pause_totals),
            "admitted": self.admission.admitted(),  # shares of admission's limits (0-1), overflow reads them
            "swap_free_bytes": free_swap_bytes(),
            "ksm": self.ksm.stats(),
            "capabilities": {name: b.capabilities() for name, b in self.backends.items()},
            "network_permissions": sorted(self.egress.config.permissions),  # the names it offers
        }

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        """Admit and start a sandbox; ``sandbox_id`` is the ID the apiserver chose, if it did."""
        if self.fenced or self.drain_fence:
            why = self.fenced or self.drain_fence
            raise CapacityExhausted(f"node {self.config.node} refuses creates: {why}")
        backend = self.backends.get(spec.type)
        if backend is None:
            raise CapacityExhausted(f"node {self.config.node} does not run {spec.type} sandboxes")
        unmet = spec.hardware.unmet(self.hardware)
        if unmet is not None:
            raise CapacityExhausted(f"node {self.config.node} cannot host this sandbox: it {unmet}")
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

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        """Copies of a running VM sandbox on this node, memory and processes included: one
        snapshot restored ``len(new_ids)`` times (IDs chosen by the apiserver), all or none."""
        live = await self.pausing.use(sandbox_id)
        backend = self.backend_of(live.record)
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
        if self.drain_fence:  # fenced while admission held it: a drain counts on none landing
            raise CapacityExhausted(f"node {self.config.node} refuses creates: {self.drain_fence}")
        self._creating += 1
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
            self._admit(_Live(rec, user))
            self.pausing.take_lease(spec)  # after it is live: a lease covering nothing is dropped
            return self._info(rec)
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
            self._creating -= 1

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
        if requested is None:
            return str(SandboxId.new(self.config.node, self.epoch))
        sid = SandboxId.parse(requested)
        if (sid.node, sid.epoch) != (self.config.node, self.epoch):
            # The apiserver's view of this node is out of date: it should place the create again.
            raise CapacityExhausted(
                f"{requested} is not an ID of node {self.config.node!r} epoch {self.epoch}: place it again"
            )
        if requested in self._live or self.journal.get(requested) is not None:
            raise Conflict(f"sandbox {requested} already exists")
        return requested

    def _fncall_serving(self) -> bool:
        return any(pool.serving for pool in self.pools.values())

    async def fncall(self, task: FnTask, pool: str | None = None) -> FnResult:
        """Run ``task`` in pool ``pool``, or in the first pool serving its language."""
        if pool is None:
            found = next((p for p in self.pools.values() if p.serves(task.language)), None)
        else:
            found = self.pools.get(pool)
        if found is None:
            wanted = f"pool {pool!r}" if pool else f"a {task.language} pool"
            raise CapacityExhausted(f"node {self.config.node} has no fncall {wanted}")
        return await self.prom.fncall(task.language, found.call(task))

    def get(self, sandbox_id: str) -> SandboxInfo:
        SandboxId.parse(sandbox_id)
        live = self._live.get(sandbox_id)
        rec = live.record if live is not None else self.journal.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
        return self._info(rec)

    def sandbox_ids(self) -> list[str]:
        return list(self._live)

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        out = []
        for live in self._live.values():
            spec_labels = live.record.spec.labels
            if POOL_LABEL in spec_labels:
                continue  # the edge's own: FnCall pool members
            if not labels or all(spec_labels.get(k) == v for k, v in labels.items()):
                out.append(self._info(live.record))
        return sorted(out, key=lambda i: i.created_at)

    async def stop(
        self, sandbox_id: str, *, reason: str = "stopped by user", final: SandboxState = SandboxState.stopped
    ) -> SandboxInfo:
        SandboxId.parse(sandbox_id)
        live = self._live.get(sandbox_id)
        if live is None:
            return self.get(sandbox_id)  # already stopped: stopping twice is not an error
        live.stop_wanted = True  # a pause waiting for commands to end gives way (pausing.py)
        live.notify()
        async with live.stopping:
            rec = live.record
            if rec.state not in (SandboxState.running, SandboxState.paused, SandboxState.stopping):
                return self._info(rec)
            if rec.state is not SandboxState.stopping:
                rec.state = SandboxState.stopping
                self._live.mark_paused(sandbox_id, False)
                rec.stop_reason = reason
                rec.paused_at = rec.pause_reason = None
                self.journal.update(rec)
            # No process starts from now on; those starting finish joining before it all goes
            # (their commands then end with the sandbox, instead of failing as the edge's fault).
            live.notify()
            while live.entering:
                await live.changed()
            # A frozen process cannot die: thaw first (a no-op if it was never frozen).
            with contextlib.suppress(DSecError):
                await self.backend_of(rec).thaw(sandbox_id, rec.handle)
            for session in live.sessions.values():
                await session.kill()
            await live.processes.kill_all("sandbox stopped")
            try:
                await self.backend_of(rec).destroy(sandbox_id, rec.handle, self.config.workdir(sandbox_id))
            except Exception as exc:
                # Stays 'stopping': a later stop (or the reaper) tries again.
                self._wakeups.look_again(live)
                log.exception("destroying %s failed", sandbox_id)
                raise InfraFailure(
                    f"stopping {sandbox_id} failed: {exc}", reason=InfraReason.runtime
                ) from exc
            await self.egress.release(sandbox_id)
            self.networking.forget(sandbox_id)
            for digest in rec.layers:
                self.mounts.release(digest)
            rec.state = final
            self.journal.update(rec)
            self._live.release(sandbox_id)
            self.prom.stopped(sandbox_id, rec.stop_reason or reason)
            return self._info(rec)

    def _admit(self, live: _Live) -> None:
        self._live.admit(live)
        self._wakeups.look_again(live)

    def _info(self, rec: Record) -> SandboxInfo:
        return rec.info(self.config.node)
