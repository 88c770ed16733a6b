"""E2B's sandbox lifecycle REST API over DSec sandboxes.

Routes (what the official SDKs 2.34 and 2.63 call; bodies in :mod:`.models`)::

    POST   /sandboxes, /v2/sandboxes                 NewSandbox -> 201 Sandbox
    GET    /sandboxes, /v2/sandboxes                 ?metadata=&state=&limit=&nextToken= -> [ListedSandbox]
    GET    /sandboxes/{id}                           -> SandboxDetail
    DELETE /sandboxes/{id}                           -> 204 (404: no such running sandbox)
    POST   /sandboxes/{id}/connect, /v2/.../connect  ConnectSandbox -> 200 Sandbox (201: resumed)
    POST   /sandboxes/{id}/resume                    ResumeSandbox -> 201 Sandbox (409: running)
    POST   /sandboxes/{id}/pause                     -> 204 (409: already paused)
    POST   /sandboxes/{id}/timeout                   TimeoutRequest -> 204
    POST   /sandboxes/{id}/refreshes                 RefreshRequest -> 204
    PUT    /sandboxes/{id}/network                   NetworkUpdate -> 204 (:mod:`.network`)

A ``templateID`` names a DSec environment (:func:`template_refs`). ``timeout`` is an edge
deadline (``set_deadline``) that stops the sandbox, or pauses it with ``autoPause``; only
running time counts, and a resume starts it again. Everything else E2B offers answers 501
(:mod:`.front` registers those).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from dsec.apiserver._http import PRINCIPAL, read_body
from dsec.apiserver.e2b.models import (
    AUTO_RESUME_LABEL,
    PRIVATE_TRAFFIC_LABEL,
    ConnectSandbox,
    E2BState,
    Lifecycle,
    ListedSandbox,
    NetworkUpdate,
    NewSandbox,
    RefreshRequest,
    ResumeSandbox,
    Sandbox,
    SandboxDetail,
    TimeoutRequest,
)
from dsec.apiserver.e2b.network import INTERNET, check_iam, headers_info, to_headers, to_info, to_rules
from dsec.apiserver.e2b.secret_store import SecretStore
from dsec.apiserver.e2b.template_models import TemplateConfig
from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.layer_access import resolve_digests
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.images.base import E2B_BASE_REF, E2B_USER
from dsec.images.store import LayerStore
from dsec.protocol.egress_headers import used
from dsec.protocol.errors import Conflict, InvalidRequest, LayerNotFound, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec, DeadlineAction, SandboxInfo, SandboxState, invalid_request

if TYPE_CHECKING:
    from dsec.apiserver.e2b.snapshot_defaults import SnapshotDefaults
    from dsec.apiserver.e2b.templates import Templates
    from dsec.apiserver.e2b.volumes import VolumeRoutes

NEXT_TOKEN_HEADER = "X-Next-Token"
BASE_TEMPLATE = "base"  # what the SDKs send when the caller names no template
FALLBACK_TEMPLATE = "debian:bookworm"  # `base` when E2B's base layer is not built (yet)
LAYER_SEPARATOR = "+"  # "base:1+ws:3": an ordered layer list, base first
_MAX_PAGE = 1000
_ID_SHOWN = 100  # characters of a bad ID quoted back
_NO_END = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)  # endAt of a sandbox without a deadline
_LIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)
_OFFERS_TTL_S = 30.0  # how long a node's offered network permissions are taken as known


def template_refs(template_id: str, default: str) -> list[str]:
    """The layer references a ``templateID`` stands for: ``base`` is the node's default
    environment; ``a+b+c`` an ordered layer list (base first); anything else one layer or image
    (``name:version`` or a digest)."""
    if template_id == BASE_TEMPLATE:
        template_id = default
    refs = [r.strip() for r in template_id.split(LAYER_SEPARATOR)]
    if not all(refs):
        raise InvalidRequest(f"template {template_id!r}: empty layer name in a {LAYER_SEPARATOR!r} list")
    return refs


def not_found_message(sandbox_id: str) -> str:
    """E2B API's answer for a sandbox that is gone or never was (the ID cut to a sane length)."""
    return f"Sandbox {sandbox_id[:_ID_SHOWN]!r} doesn't exist or you don't have access to it"


def _when(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


def _state(info: SandboxInfo) -> E2BState:
    return "paused" if info.state is SandboxState.paused else "running"


def _end(info: SandboxInfo) -> dt.datetime:
    if info.state is SandboxState.paused and info.deadline_s is not None:
        return _when(time.time() + info.deadline_s)  # the clock restarts at resume
    return _NO_END if info.deadline_at is None else _when(info.deadline_at)


def _template_id(info: SandboxInfo) -> str:
    return LAYER_SEPARATOR.join(info.refs) or LAYER_SEPARATOR.join(info.layers)


_KEPT_LABELS = (AUTO_RESUME_LABEL, PRIVATE_TRAFFIC_LABEL)  # settings, not the caller's metadata


def _listed(info: SandboxInfo) -> dict[str, Any]:
    return {
        "template_id": _template_id(info),
        "sandbox_id": info.id,
        "client_id": info.node,
        "started_at": _when(info.created_at),
        "end_at": _end(info),
        "cpu_count": max(1, math.ceil(info.cpu_cores_limit)),
        "memory_mb": info.memory_limit_mb,
        "disk_size_mb": 0,  # DSec does not size a sandbox's disk unless disk_limit_mb is set
        "state": _state(info),
        "metadata": {k: v for k, v in info.labels.items() if k not in _KEPT_LABELS},
    }


def auto_resumes(info: SandboxInfo) -> bool:
    """Whether E2B's proxy would resume this sandbox on traffic (``autoResume`` at create)."""
    return info.labels.get(AUTO_RESUME_LABEL) == "true"


def _started_after(request: web.Request) -> dt.datetime | None:
    """``startedAfter``: an RFC 3339 time with its offset (E2B's API refuses one without),
    compared at microseconds as E2B's API does (a sandbox's own ``startedAt`` fed back keeps
    it in the list)."""
    raw = request.query.get("startedAfter")
    if raw is None:
        return None
    try:
        when = dt.datetime.fromisoformat(raw[:64])
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidRequest(f"startedAfter {raw[:64]!r} is not an RFC 3339 date-time with an offset")
    return when


def _cursor(info: SandboxInfo) -> str:
    return base64.urlsafe_b64encode(f"{info.created_at!r} {info.id}".encode()).decode()


def _after_cursor(token: str) -> tuple[float, str]:
    try:
        stamp, _, sid = base64.urlsafe_b64decode(token.encode()).decode().partition(" ")
        return float(stamp), sid
    except ValueError as exc:
        raise InvalidRequest("nextToken is not a token this API gave out") from exc


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """``metadata`` is ``k=v&k2=v2`` with keys and values percent-encoded once more."""
    if not raw:
        return {}
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=False)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _states(request: web.Request) -> set[str]:
    wanted = {s.strip() for raw in request.query.getall("state", []) for s in raw.split(",") if s.strip()}
    unknown = wanted - {"running", "paused"}
    if unknown:
        raise InvalidRequest(f"unknown state {sorted(unknown)[0]!r}: running or paused")
    return wanted or {"running", "paused"}


def _limit(request: web.Request) -> int:
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer") from exc
    if not 1 <= limit <= _MAX_PAGE:
        raise InvalidRequest(f"limit must be 1 to {_MAX_PAGE}")
    return limit


class LifecycleRoutes:
    def __init__(
        self, sandboxes: SandboxRoutes, store: LayerStore, tokens: EnvdTokens, default_template: str
    ) -> None:
        self.sandboxes = sandboxes
        self.store = store
        self.tokens = tokens
        self.default_template = default_template
        self.domain: Callable[[], str | None] = lambda: None  # the front's --e2b-domain
        self._offers: dict[str, tuple[float, bool]] = {}  # node -> (when learned, offers internet)
        self.templates: Templates | None = None  # built templates (e2b/templates.py), set by the front
        self.volumes: VolumeRoutes | None = None  # shared volumes (e2b/volumes.py), set by the front
        self.secrets: SecretStore | None = None  # the projects' secrets (e2b/secret_store.py), likewise
        # A snapshot's kept user, workdir and env (e2b/snapshots.py), set by the front.
        self.snapshot_defaults: Callable[[list[str]], Awaitable[SnapshotDefaults | None]] | None = None

    def register(self, r: web.UrlDispatcher) -> None:
        for prefix in ("", "/v2"):
            r.add_post(f"{prefix}/sandboxes", self.create)
            r.add_get(f"{prefix}/sandboxes", self.list)
            r.add_post(prefix + "/sandboxes/{id}/connect", self.connect)
        r.add_get("/sandboxes/{id}", self.get)
        r.add_delete("/sandboxes/{id}", self.kill)
        r.add_post("/sandboxes/{id}/resume", self.resume)
        r.add_post("/sandboxes/{id}/pause", self.pause)
        r.add_post("/sandboxes/{id}/timeout", self.set_timeout)
        r.add_post("/sandboxes/{id}/refreshes", self.refresh)
        r.add_put("/sandboxes/{id}/network", self.update_network)

    # -- answers --------------------------------------------------------------------------------

    def _created(self, info: SandboxInfo, status: int) -> web.Response:
        body = Sandbox.model_validate(
            {
                "template_id": _template_id(info),
                "sandbox_id": info.id,
                "client_id": info.node,
                "envd_access_token": self.tokens.issue(info.id),
                "traffic_access_token": self.tokens.issue_traffic(info.id)
                if info.labels.get(PRIVATE_TRAFFIC_LABEL) == "false"
                else None,
                "domain": self.domain(),
            }
        )
        return web.json_response(body.wire(), status=status)

    # -- create -------------------------------------------------------------------------------

    async def _default(self) -> str:
        """What ``base`` means: the configured template; E2B's base layer (``dsec base``
        builds it) only once it is there, DSec's own base until then."""
        if self.default_template != E2B_BASE_REF:
            return self.default_template
        built = self.store.has_tag(E2B_BASE_REF)  # one small record read: cheaper than a thread hop
        return E2B_BASE_REF if built else FALLBACK_TEMPLATE

    async def _refs(self, template_id: str) -> list[str]:
        refs = template_refs(template_id, await self._default() if template_id == BASE_TEMPLATE else "")
        for ref in refs:
            try:
                await resolve_digests(self.store, ref, None)
            except LayerNotFound as exc:
                raise LayerNotFound(f"template {template_id!r} not found: {exc}") from exc
        return refs

    async def _on_e2b_base(self, refs: list[str]) -> bool:
        """Whether the sandbox's bottom layers are E2B's base: the template itself, or a
        snapshot or template built on it (whose first ref is an image of those layers)."""
        if refs[0] == E2B_BASE_REF:
            return True
        try:
            base = await resolve_digests(self.store, E2B_BASE_REF, None)
            first = await resolve_digests(self.store, refs[0], None)
        except LayerNotFound:
            return False
        return first[: len(base)] == base

    async def create(self, request: web.Request) -> web.Response:
        req = await read_body(request, NewSandbox)
        if req.mcp:
            raise NotSupported("MCP gateways are not supported by DSec")
        check_iam(req.iam)
        if AUTO_RESUME_LABEL in (req.metadata or {}):
            raise InvalidRequest(f"metadata key {AUTO_RESUME_LABEL!r} is kept for the sandbox's autoResume")
        if PRIVATE_TRAFFIC_LABEL in (req.metadata or {}):
            raise InvalidRequest(f"metadata key {PRIVATE_TRAFFIC_LABEL!r} is kept for allow_public_traffic")
        network = (req.network or NetworkUpdate()).model_copy(
            update={"allow_internet_access": req.allow_internet_access}
        )
        to_rules(network, internet_offered=False)  # refuse what cannot be mapped before creating
        headers = to_headers(network)
        secrets = await self._secrets(request, headers)  # a missing secret: nothing is created
        labels = dict(req.metadata or {})
        if req.auto_resume is not None and req.auto_resume.enabled:
            labels[AUTO_RESUME_LABEL] = "true"
        if network.allow_public_traffic is False:
            labels[PRIVATE_TRAFFIC_LABEL] = "false"  # its ports want the trafficAccessToken
        built = await self.templates.resolve(request[PRINCIPAL], req.template_id) if self.templates else None
        refs = built.refs if built is not None else await self._refs(req.template_id)
        kept = await self.snapshot_defaults(refs) if built is None and self.snapshot_defaults else None
        if kept is not None:  # a snapshot: its source's user, workdir and env, as envd's memory
            built = TemplateConfig(refs=refs, env=kept.env, workdir=kept.workdir, user=kept.user)
        on_e2b_base = await self._on_e2b_base(refs)
        try:
            spec = ContainerSpec(
                image=refs[0] if len(refs) == 1 else None,
                layers=refs if len(refs) > 1 else None,
                cpu_cores_limit=2,
                memory_limit_mb=1024,
                labels=labels,
                env={**(built.env if built else {}), **(req.env_vars or {})},
                # envd runs a command as the template's default user when the SDK names none:
                # E2B's base has `user`; DSec's layers have root alone.
                init_user=(built and built.user) or (E2B_USER if on_e2b_base else "root"),
                # envd starts a command that names no cwd in the template's WORKDIR
                workdir=built.workdir if built else None,
                # ...whose passwordless sudo needs setuid to work. An E2B client already runs
                # anything as root (user="root"): sudo gives `user` no more than that.
                allow_setuid=on_e2b_base,
                volumes=await self.volumes.mounts(request[PRINCIPAL].project, req.volume_mounts)
                if req.volume_mounts and self.volumes is not None
                else {},
            )
        except ValidationError as exc:
            raise InvalidRequest(f"metadata or envVars: {invalid_request(exc)}") from exc
        principal = request[PRINCIPAL]
        spec = self.sandboxes.tenancy.admit(principal, None, spec)
        spec = await self.sandboxes.admit_layers(principal, spec)  # a template may be another's
        [info] = await self.sandboxes.create_many(principal, spec, 1, 120)
        link = self.sandboxes.link_for(info.id)
        try:
            rules = to_rules(network, internet_offered=await self._offers_internet(link, info.node))
            if rules or headers:
                info = await link.set_network_rules(info.id, rules, headers or None, secrets)
            if req.timeout > 0:
                info = await link.set_deadline(info.id, req.timeout, "pause" if req.auto_pause else "stop")
            if built is not None and self.templates is not None:
                await self.templates.start(link, info.id, built)  # start command, ready wait
        except BaseException:
            await asyncio.shield(self._stop(link, info.id))
            raise
        return self._created(info, 201)

    async def _offers_internet(self, link: EdgeLink, node: str) -> bool:
        """Whether the node's operator offers the ``internet`` permission (its stats name the
        permissions it offers), learned again every :data:`_OFFERS_TTL_S`."""
        now = time.monotonic()
        known = self._offers.get(node)
        if known is None or now - known[0] > _OFFERS_TTL_S:
            stats = await link.stats()
            offered = stats.get("network_permissions")
            known = (now, isinstance(offered, list) and INTERNET in offered)
            self._offers[node] = known
        return known[1]

    async def _stop(self, link: EdgeLink, sandbox_id: str) -> None:
        await link.stop(sandbox_id)
        await self.sandboxes.tenancy.release(sandbox_id)

    # -- one sandbox ----------------------------------------------------------------------------

    async def _live(self, request: web.Request) -> tuple[EdgeLink, SandboxInfo]:
        """The running or paused sandbox the request names, if its key may see it. Not found
        (404, E2B's words) also for an ID that is no DSec ID: it names no sandbox, and the SDKs
        take a 404 as an answer (``kill`` returns False) where a 400 raises."""
        raw = request.match_info["id"]
        try:
            SandboxId.parse(raw)
        except InvalidRequest:
            raise SandboxNotFound(not_found_message(raw)) from None
        link, sid = await self.sandboxes.owned(request)
        info = await link.get(sid)
        if info.state not in _LIVE:
            raise SandboxNotFound(not_found_message(sid))
        return link, info

    async def get(self, request: web.Request) -> web.Response:
        _, info = await self._live(request)
        on_timeout = "pause" if info.on_deadline == "pause" else "kill"
        detail = SandboxDetail.model_validate(
            {
                **_listed(info),
                "envd_access_token": self.tokens.issue(info.id),
                "lifecycle": Lifecycle(on_timeout=on_timeout, auto_resume=auto_resumes(info)),
                "network": to_info(info.network_rules, headers_info(info.egress_headers)),
                "domain": self.domain(),
            }
        )
        return web.json_response(detail.wire())

    async def kill(self, request: web.Request) -> web.Response:
        link, info = await self._live(request)
        await self._stop(link, info.id)
        return web.Response(status=204)

    async def _extend(self, link: EdgeLink, info: SandboxInfo, timeout: int | None) -> SandboxInfo:
        """E2B's connect: the new timeout applies only if it ends later than the current one."""
        if not timeout:
            return info
        if info.deadline_at is None and info.deadline_s is None:
            return info  # no deadline at all: nothing ends later than never
        if info.deadline_at is not None and info.deadline_at >= time.time() + timeout:
            return info
        return await link.set_deadline(info.id, timeout, info.on_deadline or "stop")

    async def connect(self, request: web.Request) -> web.Response:
        req = await read_body(request, ConnectSandbox)
        link, info = await self._live(request)
        resumed = info.state is SandboxState.paused
        if resumed:
            info = await link.resume(info.id)
        info = await self._extend(link, info, req.timeout)
        return self._created(info, 201 if resumed else 200)

    async def resume(self, request: web.Request) -> web.Response:
        req = await read_body(request, ResumeSandbox)
        link, info = await self._live(request)
        if info.state is not SandboxState.paused:
            raise Conflict(f"sandbox {info.id} is already running")
        await link.resume(info.id)
        action: DeadlineAction = "pause" if req.auto_pause else "stop"
        info = await link.set_deadline(info.id, req.timeout or None, action)
        return self._created(info, 201)

    async def pause(self, request: web.Request) -> web.Response:
        link, info = await self._live(request)
        if info.state is SandboxState.paused:
            raise Conflict(f"sandbox {info.id} is already paused")
        await link.pause(info.id)
        return web.Response(status=204)

    async def _set(self, request: web.Request, timeout: Callable[[SandboxInfo], int]) -> web.Response:
        link, info = await self._live(request)
        await link.set_deadline(info.id, timeout(info) or None, info.on_deadline or "stop")
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        """E2B's API sets the end to now + timeout, shorter or longer (``KeepAliveFor`` with
        ``allowShorter``): 0 ends the sandbox now, as its deadline would (kill, or pause with
        ``autoPause``), not "no deadline"."""
        req = await read_body(request, TimeoutRequest)
        if req.timeout > 0:
            return await self._set(request, lambda _: req.timeout)
        link, info = await self._live(request)
        if info.on_deadline == "pause":
            if info.state is not SandboxState.paused:
                await link.pause(info.id)
        else:
            await self._stop(link, info.id)
        return web.Response(status=204)

    async def update_network(self, request: web.Request) -> web.Response:
        """E2B replaces the whole egress configuration; so are the sandbox's DSec rules."""
        req = await read_body(request, NetworkUpdate)
        link, info = await self._live(request)
        rules = to_rules(req, internet_offered=await self._offers_internet(link, info.node))
        headers = to_headers(req)  # replaced too: rules left out are cleared
        await link.set_network_rules(info.id, rules, headers, await self._secrets(request, headers))
        return web.Response(status=204)

    async def _secrets(self, request: web.Request, headers: dict[str, dict[str, str]]) -> dict[str, str]:
        """The values of the secrets ``headers`` name, from the key's project (400 naming the
        first it lacks)."""
        names = used(headers)
        if not names:
            return {}
        if self.secrets is None:
            raise NotSupported("secrets are not kept by this apiserver")
        return await self.secrets.resolve(request[PRINCIPAL].project, names)

    async def refresh(self, request: web.Request) -> web.Response:
        req = await read_body(request, RefreshRequest)
        return await self._set(request, lambda info: req.duration or int(info.deadline_s or 0))

    # -- many sandboxes -----------------------------------------------------------------------

    async def list(self, request: web.Request) -> web.Response:
        labels = _metadata_filter(request.query.get("metadata"))
        states, limit = _states(request), _limit(request)
        template = request.query.get("template")
        since = _started_after(request)
        descending = request.query.get("order", "desc") != "asc"
        links = list(self.sandboxes.links.values())
        answers = await asyncio.gather(*(ln.list_sandboxes(labels) for ln in links), return_exceptions=True)
        found = [i for a in answers if not isinstance(a, BaseException) for i in a]
        found = [
            i
            for i in self.sandboxes.tenancy.visible(request[PRINCIPAL], found)
            if i.state in _LIVE
            and _state(i) in states
            and (template is None or template == LAYER_SEPARATOR.join(i.refs))
            and (since is None or _when(i.created_at) >= since)  # startedAt as the answers show it
        ]
        found.sort(key=lambda i: (i.created_at, i.id), reverse=descending)
        token = request.query.get("nextToken")
        if token:
            cursor = _after_cursor(token)
            found = [i for i in found if (k := (i.created_at, i.id)) != cursor and (k < cursor) == descending]
        page = found[:limit]
        resp = web.json_response([ListedSandbox.model_validate(_listed(i)).wire() for i in page])
        if len(found) > limit:
            resp.headers[NEXT_TOKEN_HEADER] = _cursor(page[-1])
        return resp


class NotSupported(Exception):
    """A part of E2B's API that DSec does not offer (answered 501). Not a DSecError: DSec's
    own API never raises it, so it stays out of DSec's error tree."""

    status = 501
