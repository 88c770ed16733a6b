"""The two halves of a cluster as separate processes: `dsec edge` and `dsec apiserver`.

An edge serves its node over HTTP to apiservers that hold the cluster secret; an apiserver
knows its edges by name and URL, polls them (the watcher), places creates on them and routes
every later request by the node in the sandbox ID. Apiservers hold no per-sandbox state, so
any number of them can serve the same edges; IAM (PostgreSQL) and the layer store (a shared
mount) are what they share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from dsec.apiserver.app import ApiServer
from dsec.apiserver.embedded import NodeConfig, open_layer_store
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.backends.base import Backend
from dsec.backends.container.backend import ContainerBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.link import EdgeLink
from dsec.edge.server import EdgeServer
from dsec.iam import IamStore, open_iam_store
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.http import listen
from dsec.protocol.ids import validate_node_name

log = logging.getLogger("dsec.cluster")


class EdgeNode:
    """One node's edge behind its HTTP server (`dsec edge`)."""

    def __init__(self, config: NodeConfig, secret: str, backend: Backend | None = None) -> None:
        self.config = config
        self.store = open_layer_store(config)
        self.mounts = LayerMounts(config.data_dir / "mnt")
        self.backend = backend or ContainerBackend(config.data_dir)
        edge_config = EdgeConfig(data_dir=config.data_dir, node=config.node, **config.edge)
        self.edge = Edge(edge_config, self.backend, self.store, self.mounts)
        self.server = EdgeServer(self.edge, secret)
        self.url = ""

    async def start(self) -> str:
        await self.edge.start()
        self.url = await self.server.start(self.config.host, self.config.port)
        return self.url

    async def close(self, *, stop_sandboxes: bool = False) -> None:
        """Stop serving; sandboxes keep running unless asked (the next start re-adopts them)."""
        await self.server.close()
        await self.edge.close(stop_sandboxes=stop_sandboxes)
        if not self.edge.list_sandboxes():
            self.mounts.unmount_all()
            await self.backend.release_node()
        self.store.close()


@dataclass
class ApiServerConfig:
    edges: dict[str, str]  # node name -> the edge's URL
    secret: str
    store: LayerStore
    iam_url: str
    host: str = "127.0.0.1"
    port: int = 8642
    watch_interval_s: float = 1.0


class ClusterApiServer:
    """An apiserver over remote edges (`dsec apiserver`)."""

    def __init__(self, config: ApiServerConfig) -> None:
        self.config = config
        self.links: dict[str, EdgeLink] = {
            validate_node_name(node): RemoteEdgeLink(url, config.secret, node)
            for node, url in config.edges.items()
        }
        self.watcher = Watcher(self.links, interval_s=config.watch_interval_s)
        self.placement = Placement(self.watcher)
        self.iam: IamStore
        self.api: ApiServer
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        self.iam = await open_iam_store(self.config.iam_url)
        self.api = ApiServer(self.links, self.placement, self.config.store, self.iam)
        await self.watcher.start()
        self._runner, self.url = await listen(self.api.app(), self.config.host, self.config.port)
        self.api.tenancy.start(self.links)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if hasattr(self, "api"):
            await self.api.tenancy.close()
        await self.watcher.close()
        for link in self.links.values():
            close = getattr(link, "close", None)
            if close is not None:
                await close()
        if hasattr(self, "iam"):
            await self.iam.close()


def parse_edges(items: list[str]) -> dict[str, str]:
    """``NODE=URL`` arguments into a mapping, with clear errors."""
    out = {}
    for item in items:
        node, sep, url = item.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise ValueError(f"--edge {item!r}: expected NODE=http://host:port")
        out[validate_node_name(node)] = url.rstrip("/")
    return out
