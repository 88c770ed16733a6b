"""The E2B front: E2B's REST API and envd beside DSec's own, in the same apiserver.

An E2B SDK needs only ``E2B_API_URL``, ``E2B_SANDBOX_URL`` (and for volumes'
content ``E2B_VOLUME_API_URL``) set to the apiserver's URL and ``E2B_API_KEY`` set to an
``e2b_`` key DSec issued (``dsec key issue PROJECT --e2b``). Errors on
E2B's routes are E2B's body (``{"code": <status>, "message": ...}``), never DSec's wire form:
the SDKs parse the body before they look at the status.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from dsec.apiserver.e2b.envd import EnvdRoutes, is_envd_path
from dsec.apiserver.e2b.lifecycle import LifecycleRoutes, NotSupported
from dsec.apiserver.e2b.logs import LogRoutes
from dsec.apiserver.e2b.metrics import MetricsRoutes
from dsec.apiserver.e2b.models import error_body
from dsec.apiserver.e2b.secret_refill import SecretRefill
from dsec.apiserver.e2b.secret_store import SecretStore
from dsec.apiserver.e2b.secrets import SecretRoutes, is_secrets_path
from dsec.apiserver.e2b.snapshots import SnapshotRoutes
from dsec.apiserver.e2b.templates import Templates
from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.e2b.traffic import TrafficRoutes
from dsec.apiserver.e2b.volumes import VolumeRoutes
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.images.store import LayerStore
from dsec.protocol.errors import DSecError
from dsec.protocol.http import client_went
from dsec.protocol.models import invalid_request

log = logging.getLogger("dsec.apiserver.e2b")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_TEMPLATE = "debian:bookworm"  # what `dsec up` builds as its base layer
# Where E2B's control-plane API lives; DSec's own is under /v1/ and never collides.
E2B_API_PREFIXES = ("/sandboxes", "/v2/sandboxes", "/templates", "/v2/templates", "/v3/templates",
                    "/default-templates", "/snapshots", "/volumes", "/volumecontent/",
                    "/secrets")  # fmt: skip
_NO_TEMPLATE_ROUTE = "this template route is not supported by DSec: build with Template() (e2b/templates.py)"
# Paths of E2B's API that DSec does not offer, each with the reason the 501 gives.
_UNSUPPORTED = (
    # What templates.py does not take (tags, v1 builds, updates): build with Template().
    ("/templates{tail:.*}", _NO_TEMPLATE_ROUTE),
    ("/v2/templates{tail:.*}", _NO_TEMPLATE_ROUTE),
    ("/v3/templates{tail:.*}", _NO_TEMPLATE_ROUTE),
)


@dataclass
class E2BOptions:
    token_secret: bytes | None = None  # None: a random one (tokens die with this process)
    default_template: str = DEFAULT_TEMPLATE  # what templateID "base" means
    # Sandbox hosts are PORT-ID.<domain> (wildcard DNS to the apiservers; e2b/traffic.py),
    # answered to the SDKs as each sandbox's ``domain``. None: traffic by headers only.
    domain: str | None = None


def is_e2b_api_path(path: str) -> bool:
    return path.startswith(E2B_API_PREFIXES)


def _e2b_error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


@web.middleware
async def e2b_errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors of E2B's REST routes in E2B's form (envd routes answer their own)."""
    if not is_e2b_api_path(request.path):
        return await handler(request)
    response = await _e2b_answer(request, handler)
    if is_secrets_path(request.path):
        response.headers["Cache-Control"] = "no-store"  # E2B's NoStoreSecrets: errors too
    return response


async def _e2b_answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (DSecError, NotSupported) as exc:
        return _e2b_error(exc.status, str(exc) if isinstance(exc, NotSupported) else exc.message)
    except ValidationError as exc:
        return _e2b_error(400, invalid_request(exc).message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _e2b_error(exc.status, exc.reason)
    except Exception as exc:
        if (went := client_went(request, exc)) is not None:
            return went
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _e2b_error(500, f"internal error: {type(exc).__name__}: {exc}")


class E2BFront:
    def __init__(
        self, sandboxes: SandboxRoutes, store: LayerStore, options: E2BOptions | None = None
    ) -> None:
        self.options = options or E2BOptions()
        self.store = store
        self.tokens = EnvdTokens(self.options.token_secret)
        self.lifecycle = LifecycleRoutes(sandboxes, store, self.tokens, self.options.default_template)
        self.envd = EnvdRoutes(sandboxes, self.tokens)
        self.lifecycle.domain = lambda: self.options.domain
        self.traffic = TrafficRoutes(sandboxes, self.tokens, lambda: self.options.domain)
        self.metrics = MetricsRoutes(sandboxes)
        self.logs = LogRoutes(sandboxes)
        self.snapshots = SnapshotRoutes(sandboxes, store, self.lifecycle._created)
        self.lifecycle.snapshot_defaults = self.snapshots.defaults_for
        lc = self.lifecycle
        self.templates = Templates(sandboxes, store, lc._default, lc._offers_internet)
        self.templates.delete_fallback = self.snapshots.delete  # an ID no template has
        lc.templates = self.templates
        self.volumes = VolumeRoutes(sandboxes, self.tokens)
        lc.volumes = self.volumes
        # E2B's secrets, kept beside its templates; values sealed under the token secret.
        self.secrets = SecretStore(Path(store.root) / "e2b-secrets", self.options.token_secret)
        self.secret_routes = SecretRoutes(self.secrets, SecretRefill(sandboxes, self.secrets).changed)
        lc.secrets = self.secrets  # network rules' ${e2b.secrets.*}

    def register(self, r: web.UrlDispatcher) -> None:
        self.templates.register(r)  # first: its DELETE /templates/{id} hands snapshots on
        self.snapshots.register(r)  # before the 501s: DELETE /templates/{id} deletes a snapshot
        # First: /sandboxes/metrics must not be taken for the sandbox "metrics".
        self.metrics.register(r)
        self.logs.register(r)
        self.volumes.register(r)
        self.secret_routes.register(r)
        r.add_get("/default-templates", self.default_templates)
        for path, why in _UNSUPPORTED:
            r.add_route("*", path, _unsupported(why))
        self.lifecycle.register(r)
        self.envd.register(r)

    async def default_templates(self, request: web.Request) -> web.Response:
        """E2B's platform templates (the SDKs' generated client still asks; E2B's own API no
        longer serves it): ``base``, as this apiserver means it, made on its layers."""
        ref = await self.lifecycle._default()
        layers = await asyncio.to_thread(self.store.resolve_image, ref)
        build = uuid.uuid5(uuid.NAMESPACE_URL, "dsec:" + "+".join(layer.digest for layer in layers))
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(layer.created_at for layer in layers)))
        base = {
            "templateID": "base", "buildID": str(build), "cpuCount": 2, "memoryMB": 1024,
            "diskSizeMB": 0, "public": True, "isDefault": True, "aliases": ["base"], "names": ["base"],
            "createdAt": made, "updatedAt": made, "createdBy": None, "lastSpawnedAt": None,
            "spawnCount": 0, "buildCount": 1, "envdVersion": "dsec", "buildStatus": "ready",
        }  # fmt: skip
        return web.json_response([base])

    async def close(self) -> None:
        await self.templates.close()
        await self.envd.close()


def _unsupported(why: str) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        raise NotSupported(why)

    return answer


__all__ = ["E2BFront", "E2BOptions", "e2b_errors_middleware", "is_e2b_api_path", "is_envd_path"]
