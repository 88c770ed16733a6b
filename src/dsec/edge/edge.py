"""The edge: one per node, the final authority over the sandboxes it runs.

It admits or rejects creates, journals each transition before acting on it, mounts layers
once per node, drives the backend, owns every session and pipe, and reclaims sandboxes whose
idle TTL or maximum lifetime ran out. A restart reconciles the journal with the runtime.

The edge is the lifecycle (create, fork, stop, reconcile) and builds its services, each given
what it uses and none importing the edge: ``edge.admission``, ``.creating`` (a create's steps
from admission to running, and forks), ``.pausing`` (with job leases), ``.reclaimer``,
``.networking``, ``.processes``, ``.commands`` (:mod:`.op_handlers` calls them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dsec.backends.base import Backend, CollectsUnused, User
from dsec.density.ksm import Ksm
from dsec.density.swap import Swap, free_swap_bytes
from dsec.edge import hardware, volumes
from dsec.edge.admission import Admission
from dsec.edge.commands import Commands
from dsec.edge.config import EdgeConfig
from dsec.edge.creating import Creating
from dsec.edge.fncall.pool import POOL_LABEL, FnPool
from dsec.edge.journal import Journal, Record
from dsec.edge.metrics import MetricsSampler
from dsec.edge.networking import Networking
from dsec.edge.pausing import PauseTotals, Pausing
from dsec.edge.processes import Processes
from dsec.edge.reclaim import Reclaimer
from dsec.edge.tally import LiveSandboxes, _Live
from dsec.edge.trajectory import Recorder, TrajectoryLog
from dsec.edge.wakeups import Wakeups
from dsec.executor.process import SandboxProcess, watch_children_with_pidfds
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.netpolicy.policy import EgressPolicy
from dsec.observe.edge_metrics import EdgeMetrics
from dsec.protocol.errors import (
    CapacityExhausted,
    DSecError,
    InfraFailure,
    InfraReason,
    SandboxNotFound,
)
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    ContainerSpec,
    SandboxInfo,
    SandboxState,
)

log = logging.getLogger("dsec.edge")

# Registers this node with its cluster: given the epoch the journal claims (None: no state),
# returns the epoch to use (iam/registry.py has the rule).
Registrar = Callable[[int | None], Awaitable[int]]
_MAX_LABELS_REPORTED = 1000
_DRAIN_FENCE = "drain_fence"  # the journal's meta key for Edge.drain_fence ("": not fenced)


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
        # Journaled: an edge restarted mid-drain must go on refusing creates (set_drain_fence).
        self.drain_fence = self.journal.meta(_DRAIN_FENCE) or ""
        self._taking: asyncio.Future[None] | None = None  # start()'s hold on the host
        self.hardware = hardware.detect(config.node_labels)
        self.pools = {c.name: FnPool(self, c) for c in config.fncall_pools}
        self.swap = Swap(config.swap, config.data_dir)
        self.ksm = Ksm(config.ksm, self.journal, owner=config.data_dir)  # claimed per node
        self.recorder = Recorder(TrajectoryLog(config.data_dir / "edge" / "trajectory.sqlite"))
        self.egress = EgressPolicy(config.egress, config.node, self.journal, config.data_dir / "edge")
        # The edge's services (each given what it uses, none the edge), over one sandbox table.
        self._live = LiveSandboxes()
        self._wakeups = Wakeups()  # when the reaper next looks at each sandbox
        self.metrics = MetricsSampler(lambda: self._live, self.backend_of)  # E2B's get_metrics
        self.prom = EdgeMetrics()  # Prometheus: this edge's own registry (observe/edge_metrics.py)
        self.pause_totals = PauseTotals()
        self.volumes = volumes.for_backend(backend, config.node, self._live)
        live, journal, recorder, backend_of = self._live, self.journal, self.recorder, self.backend_of
        self.networking: Networking = Networking(
            self.egress, journal, recorder, live, backend_of, config.node
        )
        self.pausing: Pausing = Pausing(
            config, journal, recorder, live, self._wakeups, self.prom, backend_of, self.pause_totals
        )
        self.admission: Admission = Admission(
            config, live, creating=lambda: self.creating.under_way, pause=self.pausing.pause
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
        self.creating: Creating = Creating(
            config, store, mounts, journal, self.egress, self.prom, live, self.backends, self.hardware,
            self.admission, self.networking, self.pausing, epoch=lambda: self.epoch,
            fenced=lambda: self.fenced, drain_fence=lambda: self.drain_fence, admit=self._admit,
            stop=self.stop, volume_sources=self.volumes.mount_sources
        )  # fmt: skip
        journal.observe_write = self.prom.journal_write.observe
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
        if self.drain_fence:
            log.warning("edge starts fenced by an apiserver, creates refused: %s", self.drain_fence)
        # Until here a cancelled start (a node stopped while it starts) has taken nothing of
        # the host. From here it takes LXCFS, mounts, cgroups, swap and nftables, partly in
        # threads a cancel does not stop: the rest runs to its end, and close() waits for it
        # before it gives them back.
        self._taking = asyncio.ensure_future(self._take_node())
        await asyncio.shield(self._taking)

    async def _take_node(self) -> None:
        watch_children_with_pidfds()
        # The node's state is tenants' (their upper layers, setuid programs of theirs among
        # them; the journal's specs and env; the trajectory's commands and outputs): no host
        # user but root walks in.
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.data_dir, 0o700)
        for each in self.backends.values():
            await each.prepare_node()
        await asyncio.to_thread(self.swap.ensure)
        self.ksm.ensure()  # before the pools start: their runners mark memory only for a ksmd
        await self._reconcile()
        specs = {sid: live.record.spec for sid, live in self._live.items()}
        await self.egress.start(
            {sid: spec.network_rules for sid, spec in specs.items()},
            {sid: (s.egress_headers, s.egress_secrets) for sid, s in specs.items() if s.egress_headers},
        )
        self.reclaimer.start()
        self.metrics.start()
        # Pool sandboxes do not outlive their runners' pipes, which died with the last edge.
        stale = [sid for sid, live in self._live.items() if POOL_LABEL in live.record.spec.labels]
        await asyncio.gather(*(self.stop(sid, reason="fncall pool restarted") for sid in stale))
        await asyncio.gather(*(pool.start() for pool in self.pools.values()))

    async def close(self, *, stop_sandboxes: bool = False) -> None:
        if self._taking is not None:
            # A start that failed has said so to its caller (shield marks the error retrieved
            # if the start was cancelled first); what it took is given back below.
            await asyncio.wait([self._taking])
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

    @property
    def live(self) -> LiveSandboxes:
        """The sandbox table, for readers outside the edge (observe/edge_metrics.py)."""
        return self._live

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

    def set_drain_fence(self, reason: str) -> None:
        """Refuse creates while ``reason`` is set, "" lifts it (an apiserver's scale-in drain).
        Journaled before it takes effect, so a restart neither forgets a fence (creates would
        land on a node about to be stopped) nor brings back a lifted one."""
        self.journal.set_meta(_DRAIN_FENCE, reason)
        self.drain_fence = reason

    def stats(self) -> dict[str, Any]:
        """Health and load for the watcher: totals, and running counts per backend, project, label."""
        live = self._live  # counted as sandboxes come and go (edge/tally.py), not here
        return {
            "node": self.config.node,
            "epoch": self.epoch,
            "backends": [*self.backends, *(["fncall"] if self._fncall_serving() else [])],
            "running": len(self._live),  # paused ones included: they hold the node's disk
            "paused": len(live.paused),
            "creating": self.creating.under_way,
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
        return await self.creating.create(spec, sandbox_id)

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        """Copies of a running VM sandbox on this node, memory and processes included: one
        snapshot restored ``len(new_ids)`` times (IDs chosen by the apiserver), all or none."""
        return await self.creating.fork(sandbox_id, new_ids, labels)

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
