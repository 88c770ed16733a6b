"""An apiserver's view of the cluster's edges, rebuilt from the shared registry.

Edges register (and heartbeat) through any apiserver, which records them in the registry
(``iam/registry.py``) and answers with the epoch to use. Every apiserver reads the registry
every ``interval_s`` into its map of links, so a node registered through one instance is
known to all within an interval and an apiserver that restarts knows every node after its
first read: nothing here is durable. A link's epoch comes from the registry, which is what
lets an apiserver refuse an ID of a replaced incarnation without asking the edge. A node not
heard from (no registration or heartbeat) for ``lost_after_s`` is declared lost, and work on its
sandboxes answers ``node_lost`` (``apiserver/node_verdict.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver._http import read_body, respond
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.edge.link import EdgeLink
from dsec.edge.registration import REGISTER_PATH
from dsec.edge.server import check_secret
from dsec.iam import IamStore, NodeRecord
from dsec.observe import audit
from dsec.protocol.http import require_cluster_secret

log = logging.getLogger("dsec.apiserver.membership")


class Registration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str
    url: str
    epoch: int | None = Field(default=None, description="the epoch the edge's journal claims")
    heartbeat: bool = False


class Membership:
    def __init__(
        self,
        iam: IamStore,
        secret: str,
        links: dict[str, EdgeLink],
        *,
        interval_s: float = 1.0,
        lost_after_s: float = 30.0,
    ) -> None:
        self.iam = iam
        self._secret_text = check_secret(secret)
        self._secret = self._secret_text.encode()
        self.links = links  # shared with the routes, the watcher and tenancy: updated in place
        self.interval_s = interval_s
        self.lost_after_s = lost_after_s
        self._task: asyncio.Task[None] | None = None

    def register_routes(self, app: web.Application) -> None:
        app.router.add_post(REGISTER_PATH, self.register)

    async def register(self, request: web.Request) -> web.Response:
        require_cluster_secret(request, self._secret)
        reg: Registration = await read_body(request, Registration)
        record = await self.iam.register_node(reg.node, reg.url, reg.epoch, heartbeat=reg.heartbeat)
        self._apply(record, time.time())  # this instance knows at once; the others at their next read
        if not reg.heartbeat or record.epoch != reg.epoch:
            log.info("edge %s registered at %s with epoch %d", record.node, record.url, record.epoch)
            # A node joining or coming back as a new incarnation; not its every heartbeat.
            target = {"node": record.node, "url": record.url, "epoch": record.epoch}
            await audit.record(request, "node.register", target, who={"cluster_secret": True})
        return respond({"node": record.node, "epoch": record.epoch, "url": record.url})

    def _apply(self, record: NodeRecord, read_at: float) -> None:
        link = self.links.get(record.node)
        if link is None:
            link = RemoteEdgeLink(record.url, self._secret_text, record.node, epoch=record.epoch)
            self.links[record.node] = link
        if isinstance(link, RemoteEdgeLink):
            was_lost = link.view.lost
            link.view.lost_after_s, link.view.read_interval_s = self.lost_after_s, self.interval_s
            link.follow(record.url, record.epoch, record.last_seen, read_at)
            if link.view.lost != was_lost:
                log.warning("edge %s is %s", record.node, "lost" if link.view.lost else "back")

    async def refresh(self) -> None:
        records = await self.iam.list_nodes()
        read_at = time.time()  # only a read that succeeded judges how long a node was silent
        for record in records:
            self._apply(record, read_at)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception as exc:  # the registry's store is down: keep the last view
                log.warning("could not read the cluster registry: %s", exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
