"""Admission by use, not by request: limits overcommitted by a ratio, room made by pausing.

Most sandboxes use a small part of what they ask for, so a node admits a create while it has
memory available (MemAvailable above ``memory_reserve_mb``), whatever the limits add up to.
An operator may also cap the sum of the memory (CPU) limits of running sandboxes at
``memory_overcommit`` (``cpu_overcommit``) times the node's RAM (cores); paused sandboxes
count for nothing, their memory is out. When a create does not fit, the idlest sandboxes that
are idle long enough are paused to make room before the create is refused; when the node runs
short of memory, the reaper pauses the idlest too, a few per pass, rather than letting the
kernel OOM-kill anything. A paused sandbox resumes transparently on its next use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from dsec.backends.base import Backend
from dsec.density.memory import mem_available_bytes, mem_total_bytes
from dsec.edge.config import EdgeConfig
from dsec.edge.tally import LiveSandboxes
from dsec.protocol.errors import CapacityExhausted, CapacityReason, DSecError
from dsec.protocol.models import ContainerSpec, SandboxInfo, SandboxState

log = logging.getLogger("dsec.edge")
MiB = 1 << 20
# CapacityExhausted's reason when no amount of waiting or pausing makes room: the apiserver
# tries other nodes, and answers InvalidRequest if none of them could ever take it either.
NEVER_FITS = CapacityReason.never_fits


class Pause(Protocol):
    """How admission pauses a sandbox to make room (:meth:`dsec.edge.pausing.Pausing.pause`)."""

    async def __call__(self, sandbox_id: str, *, reason: str, drain_s: float | None) -> SandboxInfo: ...


class Admission:
    """Whether a create fits the node, and room made for it by pausing the idlest."""

    # What the node has; replaced in tests to simulate a small or a pressed node.
    available_memory: Callable[[], int] = staticmethod(mem_available_bytes)
    total_memory: Callable[[], int] = staticmethod(mem_total_bytes)

    def __init__(
        self, config: EdgeConfig, live: LiveSandboxes, *, creating: Callable[[], int], pause: Pause
    ) -> None:
        """``creating``: how many creates are under way (they count against ``max_sandboxes``)."""
        self.config = config
        self.live = live
        self.creating = creating
        self.pause = pause
        self._reserved: tuple[int, float] = (0, 0.0)  # admitted creates not running yet
        self._enforces_disk: dict[str, bool] = {}  # backend name -> can it enforce disk_limit_mb
        self._default_disk_cap = 1 << 30  # MiB: the quota file system's size, once asked

    def with_default_disk(self, spec: ContainerSpec, backend: Backend) -> ContainerSpec:
        """``spec`` with the node's ``default_disk_limit_mb`` if it sets no limit of its own:
        without one, a sandbox's writes grow the node's disk without bound (its writable layer
        is a plain directory there). Where the node cannot enforce a limit (no btrfs or loop
        devices), sandboxes run unbounded as before rather than not at all (one warning)."""
        default = self.config.default_disk_limit_mb
        if default is None or spec.type != "container" or spec.disk_limit_mb is not None:
            return spec
        can = self._enforces_disk.get(backend.name)
        if can is None:
            caps = backend.capabilities()
            can = self._enforces_disk[backend.name] = bool(caps.get("disk_quota"))
            if not can:
                log.warning(
                    "default_disk_limit_mb=%d is not applied: this node cannot enforce disk limits", default
                )
            # A default larger than the quota file system would refuse every create that asked
            # for no limit (a small disk): the file system's size is then the default.
            self._default_disk_cap = int(caps.get("disk_quota_mb") or default)
        return (
            spec.model_copy(update={"disk_limit_mb": min(default, self._default_disk_cap)}) if can else spec
        )

    def committed(self) -> tuple[int, float]:
        """(memory bytes, CPU cores) the running sandboxes may use at most."""
        mem, cpu = 0, 0.0
        for live in self.live.values():
            if live.record.state in (SandboxState.running, SandboxState.creating):
                mem += live.record.spec.memory_limit_mb * MiB
                cpu += live.record.spec.cpu_cores_limit
        return mem, cpu

    def admitted(self) -> dict[str, float]:
        """How full admission is, for the apiserver's view of the cluster (overflow's threshold):
        memory in use against what admission lets sandboxes use (RAM less the reserve) and,
        where the operator caps limits, the limits' sums against those caps."""
        total, available = self.total_memory(), self.available_memory()
        usable = max(1, total - self.config.memory_reserve_mb * MiB)
        shares = {"memory_in_use": min(1.0, max(0, total - available) / usable)}
        mem_ratio, cpu_ratio = self.config.memory_overcommit, self.config.cpu_overcommit
        if mem_ratio is not None or cpu_ratio is not None:  # a pass over every sandbox: only if asked
            mem, cpu = self.committed()
            if mem_ratio is not None:
                shares["memory_limits"] = mem / max(1.0, mem_ratio * total)
            if cpu_ratio is not None:
                shares["cpu_limits"] = cpu / max(1e-9, cpu_ratio * (os.cpu_count() or 1))
        return shares

    def memory_limit_ceiling(self) -> int:
        """The largest memory limit (bytes) one sandbox may have here: the node's RAM (a limit
        above it limits nothing: 976 GiB on a 24 GiB node was admitted), or less where the
        operator caps all limits together below the RAM (``memory_overcommit`` < 1)."""
        ratio = self.config.memory_overcommit
        return int(self.total_memory() * min(1.0, ratio if ratio is not None else 1.0))

    def _fits(self, spec: ContainerSpec) -> str | None:
        mem_ratio, cpu_ratio = self.config.memory_overcommit, self.config.cpu_overcommit
        if mem_ratio is not None or cpu_ratio is not None:  # a pass over every sandbox: only if asked
            mem, cpu = self.committed()
            mem += self._reserved[0] + spec.memory_limit_mb * MiB
            cpu += self._reserved[1] + spec.cpu_cores_limit
        if mem_ratio is not None and mem > mem_ratio * self.total_memory():
            return f"memory limits would exceed {mem_ratio:g}x the node's RAM"
        if cpu_ratio is not None and cpu > cpu_ratio * (os.cpu_count() or 1):
            return f"CPU limits would exceed {cpu_ratio:g}x the node's cores"
        if self.available_memory() < self.config.memory_reserve_mb * MiB:
            return f"less than {self.config.memory_reserve_mb} MiB of memory is available"
        return None

    @contextlib.asynccontextmanager
    async def reserve(self, spec: ContainerSpec) -> AsyncIterator[None]:
        """Room for ``spec`` while it is created (held until it runs and counts by itself),
        made by pausing idle sandboxes if need be; else CapacityExhausted."""
        ceiling = self.memory_limit_ceiling()
        if spec.memory_limit_mb * MiB > ceiling:
            raise CapacityExhausted(
                f"memory_limit_mb={spec.memory_limit_mb} is more than node {self.config.node} can give"
                f" one sandbox ({ceiling // MiB} MiB)",
                reason=NEVER_FITS,
            )
        if len(self.live) + self.creating() >= self.config.max_sandboxes:
            full = f"{self.config.max_sandboxes} sandboxes"
            raise CapacityExhausted(f"node {self.config.node} is full ({full})")
        why = self._fits(spec)
        while why is not None:
            if not await self._pause_idlest("admission"):
                raise CapacityExhausted(f"node {self.config.node} is full: {why}")
            why = self._fits(spec)
        held = (spec.memory_limit_mb * MiB, spec.cpu_cores_limit)
        self._reserved = (self._reserved[0] + held[0], self._reserved[1] + held[1])
        try:
            yield
        finally:
            self._reserved = (self._reserved[0] - held[0], self._reserved[1] - held[1])

    async def relieve_pressure(self) -> None:
        """Called by every reaper pass: pause the idlest while the node is short of memory."""
        reserve = self.config.memory_reserve_mb * MiB
        for _ in range(self.config.pressure_pauses_per_pass):
            if self.available_memory() >= reserve:
                return
            if not await self._pause_idlest("memory_pressure"):
                return

    async def _pause_idlest(self, reason: str) -> bool:
        """Pause the running sandbox idle the longest (at least ``pressure_min_idle_s``, no
        command running); False if there is none."""
        cutoff = time.time() - self.config.pressure_min_idle_s
        idle = [
            live
            for live in self.live.values()
            if live.record.state is SandboxState.running
            and not live.busy
            and live.record.last_active_at <= cutoff
            and live.record.backend == "container"  # a VM's pause is a snapshot: not here
        ]
        for live in sorted(idle, key=lambda lv: lv.record.last_active_at):
            try:
                # No drain: it picked a sandbox with no command running, and a reaper pass must
                # not wait on one that starts meanwhile (it freezes and resumes with the sandbox).
                info = await self.pause(live.record.id, reason=reason, drain_s=0)
            except DSecError as exc:
                log.warning("pausing %s (%s) failed: %s", live.record.id, reason, exc)
                continue
            if info.state is SandboxState.paused:
                log.info("paused %s to make room (%s)", live.record.id, reason)
                return True
        return False
