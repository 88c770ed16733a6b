"""How an edge joins its cluster: register through any apiserver, then keep heartbeating.

The edge sends its name, the URL apiservers reach it on, and the epoch its journal was
written under; the apiserver records it in the shared registry (``iam/registry.py``) and
answers with the epoch the edge must use. Heartbeats repeat the registration, so a registry
rebuilt from scratch fills itself again within one interval, and an edge learns at once when
another process has registered under its name (it then fences itself: see ``Edge.fence``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence

import aiohttp

from dsec.edge.edge import Edge
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, error_from_wire

log = logging.getLogger("dsec.edge.registration")

REGISTER_PATH = "/cluster/v1/register"


class ClusterRegistrar:
    """Registers one edge through the first of ``apiservers`` that answers."""

    def __init__(self, apiservers: Sequence[str], secret: str, node: str, *, timeout_s: float = 5.0) -> None:
        if not apiservers:
            raise ValueError("an edge needs at least one apiserver to register with")
        self.apiservers = [a.rstrip("/") for a in apiservers]
        self.node = node
        self.url = ""  # this edge's own URL, known once its server listens
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, claimed: int | None, *, heartbeat: bool = False) -> int:
        body = {"node": self.node, "url": self.url, "epoch": claimed, "heartbeat": heartbeat}
        failures = []
        # A random first choice spreads the heartbeats of many edges over the apiservers.
        start = random.randrange(len(self.apiservers))
        async with aiohttp.ClientSession(headers=self._headers, timeout=self._timeout) as http:
            for api in self.apiservers[start:] + self.apiservers[:start]:
                try:
                    async with http.post(api + REGISTER_PATH, json=body) as resp:
                        answer = await resp.json(content_type=None)
                        if resp.status >= 400:
                            raise error_from_wire(resp.status, answer)
                        return int(answer["epoch"])
                except DSecError as exc:
                    if exc.status < 500:
                        raise  # refused (wrong secret, invalid name): another apiserver says the same
                    failures.append(f"{api}: {exc}")
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as exc:
                    failures.append(f"{api}: {type(exc).__name__}: {exc}")
        raise InfraFailure(
            f"edge {self.node!r} could not register: " + "; ".join(failures), reason=InfraReason.registration
        )

    async def until_registered(self, claimed: int | None, *, retry_s: float = 1.0) -> int:
        """Register, retrying while no apiserver answers (a whole cluster may be starting)."""
        while True:
            try:
                return await self(claimed)
            except InfraFailure as exc:
                log.warning("%s; retrying in %.0f s", exc, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, 30.0)


class Heartbeat:
    """Re-registers every ``interval_s``; fences the edge if its epoch was taken over."""

    def __init__(self, edge: Edge, registrar: ClusterRegistrar, interval_s: float) -> None:
        self.edge = edge
        self.registrar = registrar
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_forever())

    async def beat(self) -> None:
        epoch = await self.registrar(self.edge.epoch, heartbeat=True)
        if epoch != self.edge.epoch:
            self.edge.fence(
                f"the cluster gave node {self.edge.config.node!r} epoch {epoch} (this edge has"
                f" {self.edge.epoch}): another edge registered under this name"
            )

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
