"""The two halves of a cluster as separate processes: `dsec edge` and `dsec apiserver`.

An edge serves its node over HTTP to apiservers that hold the cluster secret, and registers
itself through any apiserver (``edge/registration.py``); apiservers learn the edges from the
shared registry (``apiserver/membership.py``), poll them (the watcher), place creates on them
and route every later request by the node in the sandbox ID. Apiservers hold no per-sandbox
state, so any number of them can serve the same edges; IAM with the registry (PostgreSQL) and
the layer store (a shared mount) are what they share.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from dsec.apiserver.app import ApiServer
from dsec.apiserver.e2b import E2BOptions
from dsec.apiserver.e2b.front import DEFAULT_TEMPLATE
from dsec.apiserver.e2b.tokens import secret_from_cluster
from dsec.apiserver.layer_access import LayerLimits
from dsec.apiserver.membership import Membership
from dsec.apiserver.overflow import Overflow, OverflowConfig
from dsec.apiserver.scaling import FencingWatcher, Scaler, ScalingConfig
from dsec.backends.base import Backend
from dsec.backends.container.backend import ContainerBackend
from dsec.edge.config import EdgeConfig
from dsec.edge.edge import Edge
from dsec.edge.link import EdgeLink
from dsec.edge.registration import ClusterRegistrar, Heartbeat
from dsec.edge.server import EdgeServer
from dsec.iam import IamStore, open_iam_store
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.node.embedded import NodeConfig, open_layer_store, vm_backends
from dsec.node.provider import NodeProvider
from dsec.observe.audit import AuditLog
from dsec.observe.metrics import serve_cluster_metrics
from dsec.placement.placement import Placement
from dsec.protocol.http import listen

log = logging.getLogger("dsec.cluster")


class EdgeNode:
    """One node's edge behind its HTTP server (`dsec edge`), registered with the cluster.

    ``apiservers``: where to register (any one that answers will do); ``advertise_url``:
    the URL apiservers reach this edge on, if not the one it listens on.
    """

    def __init__(
        self,
        config: NodeConfig,
        secret: str,
        apiservers: list[str],
        *,
        backend: Backend | None = None,
        advertise_url: str | None = None,
        heartbeat_s: float = 5.0,
    ) -> None:
        self.config = config
        self.store = open_layer_store(config)
        self.mounts = LayerMounts(config.data_dir / "mnt")
        self.backend = backend or ContainerBackend(config.data_dir, node=config.node)
        edge_config = EdgeConfig(data_dir=config.data_dir, node=config.node, **config.edge)
        self.more_backends = vm_backends(config, self.store)
        self.edge = Edge(edge_config, self.backend, self.store, self.mounts, more_backends=self.more_backends)
        self.server = EdgeServer(self.edge, secret)
        self.registrar = ClusterRegistrar(apiservers, secret, config.node)
        self.heartbeat = Heartbeat(self.edge, self.registrar, heartbeat_s)
        self.advertise_url = advertise_url
        self.url = ""

    async def start(self) -> str:
        """Serve; a start that fails or is cancelled part-way closes what it had started
        (LXCFS, mounts, cgroups), so nothing of the node is left behind."""
        try:
            return await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> str:
        # Listen first (the registration names the URL), but answer nothing until re-adopted.
        self.server.ready = False
        self.url = await self.server.start(self.config.host, self.config.port)
        self.registrar.url = self.advertise_url or self.url
        await self.edge.start(self.registrar.until_registered)
        self.server.ready = True
        self.heartbeat.start()
        return self.url

    async def close(self, *, stop_sandboxes: bool = False) -> None:
        """Stop serving; sandboxes keep running unless asked (the next start re-adopts them)."""
        await self.heartbeat.close()
        await self.server.close()
        await self.edge.close(stop_sandboxes=stop_sandboxes)
        if not self.edge.list_sandboxes():
            self.mounts.unmount_all()
            for backend in (self.backend, *self.more_backends):
                await backend.release_node()
        self.store.close()


@dataclass
class ApiServerConfig:
    secret: str
    store: LayerStore
    iam_url: str
    host: str = "127.0.0.1"
    port: int = 8642
    watch_interval_s: float = 1.0  # how often the registry is read and every edge polled
    placement_k: int = 2
    e2b_template: str = DEFAULT_TEMPLATE  # what E2B's templateID "base" means
    # A node not heard from for this long is lost: work on its sandboxes answers node_lost.
    node_lost_after_s: float = 30.0
    layer_limits: LayerLimits = field(default_factory=LayerLimits)  # caps on one layer import
    e2b_domain: str | None = None  # sandbox hosts are PORT-ID.<this> (E2B's get_host)
    audit_log: Path | None = None  # admin actions, one JSON line each; None: to the log only
    overflow: OverflowConfig | None = None  # other clusters creates go to when this one is full
    # Nodes on demand (apiserver/scaling.py): the policy, and the provider it drives (its
    # owner releases it: scaling.release_provider). Give them to one apiserver of the cluster.
    scaling: ScalingConfig | None = None
    node_provider: NodeProvider | None = None


class ClusterApiServer:
    """An apiserver over the edges that registered with the cluster (`dsec apiserver`)."""

    def __init__(self, config: ApiServerConfig) -> None:
        self.config = config
        self.links: dict[str, EdgeLink] = {}  # filled and kept current by the membership
        self.watcher = FencingWatcher(self.links, interval_s=config.watch_interval_s)
        self.placement = Placement(self.watcher, k=config.placement_k)
        self.iam: IamStore
        self.api: ApiServer
        self.membership: Membership
        self.overflow: Overflow | None = None
        self.scaler: Scaler | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        self.iam = await open_iam_store(self.config.iam_url)
        self.membership = Membership(
            self.iam,
            self.config.secret,
            self.links,
            interval_s=self.config.watch_interval_s,
            lost_after_s=self.config.node_lost_after_s,
        )
        await self.membership.start()
        # Every apiserver derives the same envd token secret: any of them checks any token.
        e2b = E2BOptions(
            secret_from_cluster(self.config.secret), self.config.e2b_template, self.config.e2b_domain
        )
        # Overflow targets join the routes' links (list, bulk, quota reconciliation span them),
        # not the watcher's: placement never sees them (apiserver/overflow.py).
        bursts = self.config.overflow
        self.overflow = None if bursts is None else Overflow(bursts, self.placement)
        links = self.links if self.overflow is None else ChainMap(self.links, self.overflow.links)
        self.api = ApiServer(
            links,
            self.placement,
            self.store,
            self.iam,
            e2b=e2b,
            layer_limits=self.config.layer_limits,
            audit=AuditLog(self.config.audit_log),
            overflow=self.overflow,
        )
        await self.watcher.start()
        app = self.api.app()
        self.membership.register_routes(app)
        serve_cluster_metrics(app, self.api.prom, self.config.secret)  # one credential scrapes all
        self._runner, self.url = await listen(app, self.config.host, self.config.port)
        self.api.tenancy.start(links)
        if self.overflow is not None:
            await self.overflow.start()
        if self.config.scaling is not None and self.config.node_provider is not None:
            self.scaler = Scaler(
                self.config.scaling, self.config.node_provider, self.watcher, self.placement, self.links
            )
            await self.scaler.start()
        return self.url

    @property
    def store(self) -> LayerStore:
        return self.config.store

    async def close(self) -> None:
        if self.scaler is not None:
            await self.scaler.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if hasattr(self, "api"):
            await self.api.tenancy.close()
            self.api.audit.close()
        if hasattr(self, "membership"):
            await self.membership.close()
        await self.watcher.close()
        if self.overflow is not None:
            await self.overflow.close()
        for link in self.links.values():
            close = getattr(link, "close", None)
            if close is not None:
                await close()
        if hasattr(self, "iam"):
            await self.iam.close()
