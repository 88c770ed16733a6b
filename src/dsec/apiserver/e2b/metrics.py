"""E2B's sandbox metrics routes, from the samples each edge keeps (:mod:`dsec.edge.metrics`).

Routes (what ``Sandbox.get_metrics`` in the SDKs 2.34 and 2.63 calls, and E2B's list form)::

    GET /sandboxes/{id}/metrics?start=&end=     -> [SandboxMetric], oldest first
    GET /sandboxes/metrics?sandbox_ids=a,b,...  -> {"sandboxes": {id: SandboxMetric}} (latest)

As E2B's API: ``start``/``end`` are unix seconds (0 or more), each open by default (from the
sandbox's start, to now), ``start`` after ``end`` is a 400; samples are 5 s apart; at most 100
IDs in the list form, where an ID that names no sandbox the key may see is left out. Unlike
E2B (which keeps figures in ClickHouse after a sandbox ends), a sandbox that has ended answers
404: its edge forgets it. An edge keeps each sandbox's last 30 minutes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL
from dsec.apiserver.e2b.lifecycle import not_found_message
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.metrics import INTERVAL_S
from dsec.protocol.errors import Forbidden, InfraFailure, InvalidRequest, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.metrics import MAX_UNIX_S, MetricSample
from dsec.protocol.models import SandboxState

log = logging.getLogger("dsec.apiserver.e2b")

MAX_SANDBOX_IDS = 100  # E2B's maxSandboxMetricsCount
_MAX_IDS_PARAM = MAX_SANDBOX_IDS * 128  # characters of sandbox_ids read at most
_LIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)
# The list form's window for "latest": the edge's fresh reading always falls in it, an edge
# clock up to this far behind the apiserver's too.
_LATEST_WINDOW_S = 6 * INTERVAL_S


def _unix_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 11 or int(raw) > MAX_UNIX_S:
        raise InvalidRequest(
            f"query parameter {name!r} must be a unix time in seconds from 0 to {MAX_UNIX_S}"
        )
    return int(raw)


def wire(s: MetricSample) -> dict[str, Any]:
    """One sample as E2B's ``SandboxMetric`` (every field the SDKs' ``from_dict`` requires)."""
    when = dt.datetime.fromtimestamp(s.ts, dt.UTC)
    return {
        "timestamp": when.isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(s.ts),
        "cpuCount": s.cpu_count,
        "cpuUsedPct": s.cpu_used_pct,
        "memUsed": s.mem_used,
        "memTotal": s.mem_total,
        "memCache": s.mem_cache,
        "diskUsed": s.disk_used,
        "diskTotal": s.disk_total,
    }


class MetricsRoutes:
    def __init__(self, sandboxes: SandboxRoutes) -> None:
        self.sandboxes = sandboxes

    def register(self, r: web.UrlDispatcher) -> None:
        # Before the lifecycle's GET /sandboxes/{id}: "metrics" is no sandbox ID.
        r.add_get("/sandboxes/metrics", self.many)
        r.add_get("/sandboxes/{id}/metrics", self.one)

    async def one(self, request: web.Request) -> web.Response:
        start, end = _unix_param(request, "start"), _unix_param(request, "end")
        if start is not None and end is not None and start > end:
            raise InvalidRequest("Invalid time range for metrics: start time cannot be after end time")
        raw = request.match_info["id"]
        try:
            SandboxId.parse(raw)
        except InvalidRequest:
            raise SandboxNotFound(not_found_message(raw)) from None
        link, sid = await self.sandboxes.owned(request)
        if (await link.get(sid)).state not in _LIVE:
            raise SandboxNotFound(not_found_message(sid))
        # Whole seconds, as the caller reads them (timestampUnix): `end` takes its second.
        samples = await link.metrics(sid, start, None if end is None else end + 0.999)
        return web.json_response([wire(s) for s in samples])

    async def many(self, request: web.Request) -> web.Response:
        raw = request.query.get("sandbox_ids")
        if raw is None:
            raise InvalidRequest("query parameter 'sandbox_ids' is required")
        if len(raw) > _MAX_IDS_PARAM:
            raise InvalidRequest(f"Too many sandboxes requested, maximum is {MAX_SANDBOX_IDS}")
        ids = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
        if len(ids) > MAX_SANDBOX_IDS:
            raise InvalidRequest(f"Too many sandboxes requested, maximum is {MAX_SANDBOX_IDS}")
        since = time.time() - _LATEST_WINDOW_S
        latest = await asyncio.gather(*(self._latest(request, sid, since) for sid in ids))
        found = {sid: wire(s) for sid, s in zip(ids, latest, strict=True) if s is not None}
        return web.json_response({"sandboxes": found})

    async def _latest(self, request: web.Request, raw: str, since: float) -> MetricSample | None:
        """The sandbox's newest sample, None if the key may not see it or it is gone."""
        try:
            link = self.sandboxes.link_for(raw)
            info = await link.get(raw)
            self.sandboxes.tenancy.check_visible(request[PRINCIPAL], raw, info.project)
            if info.state not in _LIVE:
                return None
            samples = await link.metrics(raw, since, None)
        except (InvalidRequest, SandboxNotFound, Forbidden):
            return None
        except InfraFailure as exc:  # one unreachable node does not fail the others' figures
            log.warning("metrics of %s: %s", raw[:100], exc)
            return None
        return samples[-1] if samples else None
