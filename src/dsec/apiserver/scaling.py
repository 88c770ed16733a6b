"""Scale-out: start provider nodes under sustained load, drain and stop them once idle.

An apiserver given a :class:`~dsec.node.provider.NodeProvider` and a :class:`ScalingConfig`
runs a :class:`Scaler`. Every ``interval_s`` it reads the watcher's view of the cluster:

- **Out.** When utilisation (:func:`~dsec.apiserver.overflow.utilisation`, the same figure the
  overflow threshold reads) has stayed at or past ``threshold`` for ``sustain_s`` without a
  dip (a tick when no node answers is a dip: no load was read), it asks the provider for one
  node (labels and size from the config), unless ``max_nodes`` provider nodes run or start
  already. The clock restarts: the next node needs another ``sustain_s`` of load, which the
  new node has had its chance to relieve. A blip shorter than ``sustain_s`` starts nothing.
- **In.** A provider node the watcher has seen holding no sandbox (running, paused or being
  created, nor placed there since the poll) for ``idle_s``, while the cluster is below the
  threshold, is *fenced*: this apiserver's placement sees it with no capacity at once, and
  the edge itself is told (``EdgeLink.fence``, ``POST /edge/v1/fence``): it refuses creates
  and reports ``fenced``, so every apiserver's placement skips it. After ``drain_s`` (creates
  placed before the fence reach the edge and are refused) the edge is asked, its stats and
  its sandbox IDs; only if it still refuses creates and holds nothing is it stopped. A node
  holding a sandbox, running or paused, or one that cannot be asked or told, is never
  stopped: it is unfenced (on the edge too) and its idle clock starts again.

Only nodes this scaler's provider started are ever stopped. Run the scaler on one apiserver
of a cluster (``dsec apiserver --scaling FILE``; :func:`build_provider` makes the provider
the config names): two would each start nodes for the same load.

Time comes from an injected clock, and :meth:`Scaler.tick` is one decision, so tests drive
the policy step by step without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from dsec.apiserver.overflow import load_config, utilisation
from dsec.edge.link import EdgeLink
from dsec.node.libvirt_provider import LibvirtProvider, LibvirtSettings
from dsec.node.provider import LocalNetnsProvider, NodeProvider, NodeRequest
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.errors import InvalidRequest

log = logging.getLogger("dsec.apiserver.scaling")


class LocalNetnsOptions(BaseModel):
    """How the ``local-netns`` provider starts its edges (:class:`LocalNetnsProvider`)."""

    model_config = ConfigDict(extra="forbid")

    apiserver_ports: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="the cluster's apiservers on this host its edges register with (none: this one)",
    )
    data_root: Path | None = Field(default=None, description="nodes' data and logs (<scratch>/nodes)")
    edge_args: list[str] = Field(default_factory=list, max_length=64, description="more `dsec edge` options")
    edge_port: int = Field(default=8643, ge=1, le=65535)
    start_timeout_s: float = Field(default=60.0, gt=0, le=3600)

    @field_validator("apiserver_ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        if any(not 0 < p < 65536 for p in v):
            raise ValueError(f"apiserver_ports {v}: each 1-65535")
        return v


class LibvirtOptions(BaseModel):
    """The ``libvirt`` provider's settings: the fields of :class:`LibvirtSettings`, flat, and
    the apiserver URLs its VMs register with (the VMs' view of the network, so no default)."""

    model_config = ConfigDict(extra="forbid")

    apiservers: list[str] = Field(min_length=1, max_length=64)
    settings: LibvirtSettings = Field(default_factory=LibvirtSettings)

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "settings" not in raw:
            rest = {k: v for k, v in raw.items() if k != "apiservers"}
            return {**({"apiservers": raw["apiservers"]} if "apiservers" in raw else {}), "settings": rest}
        return raw

    @field_validator("settings", mode="wrap")
    @classmethod
    def _settings(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> LibvirtSettings:
        try:
            return cast(LibvirtSettings, handler(v))
        except InvalidRequest as exc:  # LibvirtSettings' own checks
            raise ValueError(exc.message) from None

    @field_validator("apiservers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"apiservers: {url!r} is not an http(s):// URL")
        return v


class ScalingConfig(BaseModel):
    """What the scaler starts, how many at most, and how long load or idleness must last."""

    model_config = ConfigDict(extra="forbid")

    provider: str = Field(
        default="local-netns", pattern=r"^(local-netns|libvirt)$", description="which NodeProvider"
    )
    threshold: float = Field(default=0.8, gt=0, le=1, description="utilisation that counts as load")
    sustain_s: float = Field(default=60.0, ge=0, le=86_400, description="load this long starts a node")
    idle_s: float = Field(default=600.0, ge=0, le=7 * 86_400, description="idle this long: drained")
    drain_s: float = Field(default=30.0, ge=0, le=3600, description="fenced this long before the check")
    max_nodes: int = Field(default=4, ge=1, le=1000, description="provider nodes at most")
    interval_s: float = Field(default=5.0, ge=0.05, le=600, description="how often it decides")
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    cpus: float | None = Field(default=None, gt=0, le=4096)
    memory_mib: int | None = Field(default=None, gt=0, le=1 << 30)
    name_prefix: str = Field(default="burst", pattern=r"^[a-z][a-z0-9]{0,15}$")
    local_netns: LocalNetnsOptions = Field(default_factory=LocalNetnsOptions)
    libvirt: LibvirtOptions | None = Field(default=None, description="required by provider libvirt")

    @model_validator(mode="after")
    def _provider_settings(self) -> ScalingConfig:
        if self.provider == "libvirt" and self.libvirt is None:
            raise ValueError("provider libvirt needs a libvirt table (apiservers, uri, storage_pool...)")
        return self

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        try:
            NodeRequest(labels=v)  # the provider's own rules, checked once at load
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None
        return v

    @classmethod
    def load(cls, path: Path) -> ScalingConfig:
        return load_config(cls, path)

    def request(self, name: str) -> NodeRequest:
        return NodeRequest(name=name, labels=dict(self.labels), cpus=self.cpus, memory_mib=self.memory_mib)


def build_provider(
    config: ScalingConfig,
    *,
    port: int,
    secret: str,
    secret_file: Path | None,
    scratch: Path,
    shared_layers: Path,
) -> NodeProvider:
    """The provider ``config.provider`` names, for an apiserver listening on ``port``
    (``InvalidRequest`` naming what is missing)."""
    if config.provider == "libvirt":
        assert config.libvirt is not None  # the model requires it
        return LibvirtProvider(config.libvirt.settings, config.libvirt.apiservers, secret)
    if secret_file is None:
        raise InvalidRequest(
            "provider local-netns hands its edges the cluster secret as a file: give --secret-file"
        )
    LocalNetnsProvider.require_tools()
    opts = config.local_netns
    return LocalNetnsProvider(
        opts.apiserver_ports or [port],
        shared_layers,
        secret_file,
        opts.data_root or scratch / "nodes",
        edge_args=opts.edge_args,
        edge_port=opts.edge_port,
        start_timeout_s=opts.start_timeout_s,
    )


async def release_provider(provider: NodeProvider) -> None:
    """What an apiserver that exits does with its provider. Local edges are its children in
    namespaces only it knows of: they stop with it. VMs outlive it: the next apiserver's
    scaler adopts them (``Scaler.start``), so only the connection is closed."""
    if isinstance(provider, LocalNetnsProvider):
        await provider.close()
    elif isinstance(provider, LibvirtProvider):
        await provider.disconnect()


class FencingWatcher(Watcher):
    """The watcher, with nodes fenced from placement: their snapshot entry says
    ``capacity: 0, fenced: true`` (what an edge that fenced itself reports), so placement finds
    no room there and utilisation does not count them. Fencing takes effect at once: the
    snapshot is replaced, which placement notices as it notices a poll."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fenced: set[str] = set()
        self._polled: dict[str, dict[str, Any]] = self.snapshot  # as the edges said it

    async def poll(self) -> None:
        await super().poll()
        self._polled = self.snapshot
        if self.fenced:
            self.snapshot = self._marked(self._polled)

    def polled(self, name: str) -> dict[str, Any]:
        """Node ``name`` as its edge last reported it (not as this watcher marks it)."""
        return self._polled.get(name, {})

    def fence(self, name: str) -> None:
        self.fenced.add(name)
        self.snapshot = self._marked(self._polled)

    def unfence(self, name: str) -> None:
        self.fenced.discard(name)
        self.snapshot = self._marked(self._polled)

    def _marked(self, snapshot: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out = dict(snapshot)
        for name in self.fenced & out.keys():
            out[name] = {**out[name], "capacity": 0, "fenced": True}
        return out


@dataclass
class _Tracked:
    name: str
    state: str  # starting, running, fenced, stopping
    idle_since: float | None = None
    fenced_at: float | None = None


class Scaler:
    """The policy over one provider. ``links``: the cluster's edge links (the edge is asked
    before its node is stopped); ``clock``: monotonic seconds (tests pass a fake)."""

    def __init__(
        self,
        config: ScalingConfig,
        provider: NodeProvider,
        watcher: FencingWatcher,
        placement: Placement,
        links: Mapping[str, EdgeLink],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.provider = provider
        self.watcher = watcher
        self.placement = placement
        self.links = links
        self.clock = clock
        self.nodes: dict[str, _Tracked] = {}
        self.above_since: float | None = None
        self.pending: set[asyncio.Task[None]] = set()  # starts under way
        # (clock, what, node), the latest few: what benches and an operator's debugger read.
        self.events: deque[tuple[float, str, str]] = deque(maxlen=1000)
        self._count = 0
        self._task: asyncio.Task[None] | None = None

    # -- one decision ---------------------------------------------------------------------------

    def utilisation(self) -> float:
        return utilisation(self.watcher.snapshot, self.placement.busy)

    def active(self) -> int:
        return sum(1 for t in self.nodes.values() if t.state != "stopping")

    async def tick(self) -> None:
        now = self.clock()
        load = self.utilisation()
        if not any(s.get("healthy") and s.get("capacity") for s in self.watcher.snapshot.values()):
            # No node answers (yet): an apiserver's start before its edges register, or all
            # down. utilisation() says 1.0 then, right for overflow (create elsewhere), but
            # it is no load: a restart would otherwise start a node every time.
            self.above_since = None
        elif load >= self.config.threshold:
            if self.above_since is None:
                self.above_since = now
            elif now - self.above_since >= self.config.sustain_s and self.active() < self.config.max_nodes:
                self.above_since = now  # the next node needs load sustained past this one
                self._start_one()
        else:
            self.above_since = None
        for tracked in list(self.nodes.values()):
            if tracked.state == "running":
                await self._watch_idle(tracked, now, load)
            elif tracked.state == "fenced":
                await self._drain(tracked, now)

    def _start_one(self) -> None:
        self._count += 1
        name = f"{self.config.name_prefix}-{self._count}"
        while name in self.nodes:
            self._count += 1
            name = f"{self.config.name_prefix}-{self._count}"
        self.nodes[name] = _Tracked(name, "starting")
        self._event("start", name)
        task = asyncio.create_task(self._start(name))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _start(self, name: str) -> None:
        try:
            await self.provider.start(self.config.request(name))
        except Exception as exc:  # the provider stopped what it started; try again under load
            log.warning("scale-out: node %s did not start: %s", name, exc)
            self.nodes.pop(name, None)
            self._event("failed", name)
            return
        self.nodes[name].state = "running"
        self._event("running", name)

    def _holds_anything(self, name: str) -> bool:
        s = self.watcher.snapshot.get(name)
        if not s or not s.get("healthy"):
            return True  # not seen (yet, or any more): nothing is known, so not idle
        held = int(s.get("running", 0)) + int(s.get("paused", 0)) + int(s.get("creating", 0))
        return held > 0 or self.placement.busy(name) > 0

    async def _watch_idle(self, tracked: _Tracked, now: float, load: float) -> None:
        if self.watcher.polled(tracked.name).get("fenced"):
            # Kept after a drain, but the unfence did not reach the edge: it refuses creates.
            await self._fence_edge(tracked.name, False)
        if self._holds_anything(tracked.name):
            tracked.idle_since = None
            return
        if tracked.idle_since is None:
            tracked.idle_since = now
        if now - tracked.idle_since >= self.config.idle_s and load < self.config.threshold:
            self.watcher.fence(tracked.name)  # this apiserver's placement: at once
            if not await self._fence_edge(tracked.name, True):  # every apiserver's
                self.watcher.unfence(tracked.name)
                tracked.idle_since = None  # not fenced, so not drained: try again once idle
                return
            tracked.state, tracked.fenced_at = "fenced", now
            self._event("fenced", tracked.name)

    async def _fence_edge(self, name: str, fenced: bool) -> bool:
        """The edge itself refuses creates (or stops refusing), so that every apiserver's
        placement skips it, not only this one's; False if it could not be told."""
        link = self.links.get(name)
        if link is None:
            return False
        why = "scale-in drains this idle provider node" if fenced else "scale-in keeps this node"
        try:
            await asyncio.wait_for(link.fence(fenced, why), 10)
        except Exception as exc:
            what = "fenced" if fenced else "unfenced"
            log.warning("scale-in: node %s could not be %s: %s", name, what, exc)
            return False
        return True

    async def _drain(self, tracked: _Tracked, now: float) -> None:
        assert tracked.fenced_at is not None
        if now - tracked.fenced_at < self.config.drain_s:
            return
        if not await self._edge_is_empty(tracked.name):
            await self._fence_edge(tracked.name, False)  # else retried while it runs
            self.watcher.unfence(tracked.name)
            tracked.state, tracked.idle_since, tracked.fenced_at = "running", None, None
            self._event("unfenced", tracked.name)
            return
        tracked.state = "stopping"
        self._event("stop", tracked.name)
        try:
            await self.provider.stop(tracked.name)
        except Exception as exc:
            log.error("scale-in: stopping node %s failed: %s", tracked.name, exc)
            tracked.state = "fenced"  # still fenced: tried again next tick
            return
        self.watcher.fenced.discard(tracked.name)
        del self.nodes[tracked.name]
        self._event("stopped", tracked.name)

    async def _edge_is_empty(self, name: str) -> bool:
        """The edge's own word, just before the stop: no sandbox running, paused or being made."""
        link = self.links.get(name)
        if link is None:
            return False
        try:
            stats = await asyncio.wait_for(link.stats(), 10)
            ids = await asyncio.wait_for(link.sandbox_ids(), 10)
        except Exception as exc:
            log.warning("scale-in: node %s did not answer, kept: %s", name, exc)
            return False
        if not stats.get("fenced"):
            log.warning("scale-in: node %s no longer refuses creates (restarted?), kept", name)
            return False
        held = int(stats.get("running", 0)) + int(stats.get("paused", 0)) + int(stats.get("creating", 0))
        return held == 0 and not ids

    def _event(self, what: str, name: str) -> None:
        self.events.append((self.clock(), what, name))
        log.info("scaling: %s %s", what, name)

    # -- running --------------------------------------------------------------------------------

    async def start(self) -> None:
        # Nodes the provider already runs (an apiserver restarted; a VM outlives it) are this
        # scaler's to count against the max and to stop once idle.
        for node in await self.provider.list():
            if node.state in ("starting", "running") and node.name not in self.nodes:
                self.nodes[node.name] = _Tracked(node.name, "running")
                self._event("adopted", node.name)
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("a scaling decision failed")

    async def close(self) -> None:
        """Stop deciding; the provider's nodes are the provider's to close."""
        tasks = [t for t in (self._task, *self.pending) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
