"""The node's package registry proxy: one aiohttp server in the edge, one port per registry on
the gateway address, reached by sandboxes over their links.

Who asks is the connection's source address: the kernel drops a link's packets that do not
carry the link's own address, and accepts this port only from links granted the registry's
permission (nftables, :mod:`dsec.netpolicy.nft`), so the edge's map of link address -> rules
names the sandbox and its cutoff. A request from an address holding no such grant gets 403.

What each registry serves:

- PyPI: ``/simple/NAME/`` (PEP 503 HTML or PEP 691 JSON, as the client's ``Accept`` asks),
  built from upstream's JSON page with the files uploaded on or after the cutoff taken out,
  every file link pointing back at this proxy; ``/pypi/NAME/json`` likewise;
- npm: ``/NAME`` and ``/@scope/NAME``, the full packument (its ``time`` is what the cutoff
  reads, so the abbreviated form is never asked upstream), tarball links pointing back here;
- Debian: an HTTP proxy for apt (``Acquire::http::Proxy``): absolute URLs on the allowed
  archive hosts only. Pool files are cached for good, index files for the index TTL.

Files are cached on disk and fetched upstream once however many sandboxes ask at the same
time (:mod:`.store`). The proxy fetches only from the registry's own origins (a file link is
its upstream URL, encoded, checked against them), so it opens nothing else.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import html
import json
import logging
import re
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from dsec.netpolicy.upstream import Upstream
from dsec.protocol.models import GrantOptions, NetworkRules
from dsec.registry import cutoff
from dsec.registry.config import CacheConfig, Registry, origin
from dsec.registry.fetcher import Fetcher, UpstreamError
from dsec.registry.store import FileCache

log = logging.getLogger(__name__)

IP_FREEBIND = 15  # bind the gateway address before any link carries it
PEP691 = "application/vnd.pypi.simple.v1+json"
FILES = "/-/dsec-files/"  # a file link: FILES + base64url(upstream URL) + "/" + file name
MAX_NAME = 214  # npm's limit on a package name; PyPI's are shorter

GrantsOf = Callable[[str], NetworkRules | None]
PERM = web.AppKey("perm", str)
REGISTRY = web.AppKey("registry", Registry)
CUTOFF: web.RequestKey[datetime.datetime | None] = web.RequestKey("cutoff")


def file_link(base: str, url: str) -> str:
    """The proxy's link for the upstream file ``url`` (its fragment, a hash pip checks, kept)."""
    bare, _, fragment = url.partition("#")
    name = urllib.parse.urlsplit(bare).path.rsplit("/", 1)[-1] or "file"
    token = base64.urlsafe_b64encode(bare.encode()).decode().rstrip("=")
    return f"{base}{FILES}{token}/{urllib.parse.quote(name)}" + (f"#{fragment}" if fragment else "")


def _unlink(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise web.HTTPBadRequest(text="not a file link of this proxy\n") from exc


class RegistryProxy:
    def __init__(
        self,
        registries: dict[str, Registry],
        cache: CacheConfig,
        cache_dir: Path,
        gateway: str,
        upstream: Upstream,
        grants_of: GrantsOf,
    ) -> None:
        self.registries = registries
        self.gateway = gateway
        self.grants_of = grants_of
        self.cache_config = cache
        self.files = FileCache(cache_dir, cache.max_mb << 20)
        self.fetcher = Fetcher(
            upstream,
            max_file=cache.max_file_mb << 20,
            max_doc=cache.max_index_mb << 20,
            doc_ttl_s=cache.index_ttl_s,
            ca_file=cache.ca_file,
        )
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        try:
            for perm, registry in sorted(self.registries.items()):
                app = web.Application(middlewares=[self._identify])
                app[PERM], app[REGISTRY] = perm, registry
                app.router.add_get(FILES + "{token}/{name}", self._file)
                handler = {"pypi": self._pypi, "npm": self._npm, "debian": self._debian}[registry.kind]
                app.router.add_get("/{path:.*}", handler)
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                self._runners.append(runner)
                await web.SockSite(runner, _listen(self.gateway, registry.port)).start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        await self.fetcher.close()

    def stats(self) -> dict[str, int]:
        return {
            "file_requests": self.files.requests,
            "file_fetches": self.files.upstream_fetches,
            "upstream_file_bytes": self.files.upstream_bytes,
            "index_fetches": self.fetcher.doc_fetches,
        }

    # -- requests ---------------------------------------------------------------------------

    @web.middleware
    async def _identify(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The asking sandbox's grant of this registry's permission (else 403), and its cutoff."""
        perm = request.app[PERM]
        rules = self.grants_of(request.remote or "")
        grant = (rules or {}).get(perm)
        if not grant:
            raise web.HTTPForbidden(text=f"this sandbox holds no {perm!r} network permission\n")
        day = grant.before if isinstance(grant, GrantOptions) else None
        request[CUTOFF] = cutoff.instant(day) if day is not None else None
        try:
            return await handler(request)
        except UpstreamError as exc:
            status = exc.status if exc.status in (404, 410) else 502
            raise _status(status, str(exc)) from exc

    def _base(self, request: web.Request) -> str:
        return f"http://{self.gateway}:{request.app[REGISTRY].port}"

    async def _file(self, request: web.Request) -> web.StreamResponse:
        registry: Registry = request.app[REGISTRY]
        url = _unlink(request.match_info["token"])
        try:
            allowed = origin(url) in registry.allowed_origins()
        except ValueError:
            allowed = False
        if not allowed:
            raise web.HTTPForbidden(text="that file is not on this registry's upstream\n")
        if request[CUTOFF] is not None:
            await self._visible_under_cutoff(request, registry, url)
        return await self._serve_cached(url)

    async def _serve_cached(self, url: str, max_age: float | None = None) -> web.StreamResponse:
        path = await self.files.get(url, self.fetcher.file, max_age)
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def _visible_under_cutoff(self, request: web.Request, registry: Registry, url: str) -> None:
        """Under a cutoff a file link is served only if the project's page (the packument), as
        this sandbox sees it, lists it: a link made up by the sandbox must not reach a newer file."""
        project = request.query.get("project", "")
        if registry.kind == "npm":
            doc = cutoff.npm_packument(await self._packument(registry, project), request[CUTOFF])
            tarballs = {
                m.get("dist", {}).get("tarball") for m in doc["versions"].values() if isinstance(m, dict)
            }
            if url not in tarballs:
                raise web.HTTPNotFound(text="no such file before this sandbox's cutoff\n")
            return
        if registry.kind != "pypi":
            return
        visible = {
            f.get("url", "").partition("#")[0]
            for f in (await self._pypi_page(request, project)).get("files", [])
        }
        if url not in visible:
            raise web.HTTPNotFound(text="no such file before this sandbox's cutoff\n")

    async def _pypi_page(self, request: web.Request, project: str) -> dict[str, Any]:
        registry: Registry = request.app[REGISTRY]
        name = _pypi_name(project)
        page_url = f"{registry.index}{name}/"
        doc = await self.fetcher.document(page_url, PEP691)
        if not isinstance(doc, dict):
            raise UpstreamError(502, "upstream page is not a JSON object")
        page = cutoff.pypi_simple(doc, request[CUTOFF])
        files = []
        for f in page["files"]:
            if isinstance(f.get("url"), str):
                absolute = urllib.parse.urljoin(page_url, f["url"])
                files.append({**f, "url": absolute})
        return {**page, "files": files}

    async def _pypi(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"].strip("/").split("/")
        if len(path) == 2 and path[0] == "simple":
            return await self._pypi_simple(request, path[1])
        if len(path) == 3 and path[0] == "pypi" and path[2] == "json":
            registry: Registry = request.app[REGISTRY]
            json_url = urllib.parse.urljoin(registry.index, f"/pypi/{_pypi_name(path[1])}/json")
            doc = await self.fetcher.document(json_url, "application/json")
            if not isinstance(doc, dict):
                raise UpstreamError(502, "upstream document is not a JSON object")
            return web.json_response(
                _pypi_json_links(cutoff.pypi_json(doc, request[CUTOFF]), self._base(request), path[1])
            )
        raise web.HTTPNotFound(text="this proxy serves /simple/NAME/ and /pypi/NAME/json\n")

    async def _pypi_simple(self, request: web.Request, project: str) -> web.StreamResponse:
        page = await self._pypi_page(request, project)
        base = self._base(request)
        name = _pypi_name(project)
        files = []
        for f in page["files"]:
            # pip would fetch a wheel's metadata beside it; without those keys it reads the wheel.
            kept = {
                k: v
                for k, v in f.items()
                if k not in ("core-metadata", "dist-info-metadata", "data-dist-info-metadata")
            }
            link = file_link(base, f["url"])
            bare, _, frag = link.partition("#")
            kept["url"] = f"{bare}?project={name}" + (f"#{frag}" if frag else "")
            files.append(kept)
        page = {**page, "files": files, "meta": {"api-version": "1.1"}}
        if PEP691 in request.headers.get("Accept", ""):
            return web.Response(text=json.dumps(page), content_type=PEP691)
        return web.Response(text=_pep503(name, files), content_type="text/html")

    async def _npm(self, request: web.Request) -> web.StreamResponse:
        registry: Registry = request.app[REGISTRY]
        raw = urllib.parse.unquote(request.match_info["path"])
        if "/-/" in raw:  # a tarball by its registry path (a lockfile's resolved URL)
            if request[CUTOFF] is not None:
                raise web.HTTPNotFound(text="under a cutoff, tarballs come through the packument's links\n")
            return await self._serve_cached(urllib.parse.urljoin(registry.index, raw.lstrip("/")))
        name = raw.strip("/")
        doc = cutoff.npm_packument(await self._packument(registry, name), request[CUTOFF])
        base = self._base(request)
        versions = {}
        for v, meta in doc.get("versions", {}).items():
            dist = meta.get("dist") if isinstance(meta, dict) else None
            if isinstance(dist, dict) and isinstance(dist.get("tarball"), str):
                link = file_link(base, dist["tarball"]) + "?project=" + urllib.parse.quote(name, safe="")
                meta = {**meta, "dist": {**dist, "tarball": link}}
            versions[v] = meta
        return web.json_response({**doc, "versions": versions})

    async def _packument(self, registry: Registry, name: str) -> dict[str, Any]:
        if not name or len(name) > MAX_NAME or name.count("/") > (1 if name.startswith("@") else 0):
            raise web.HTTPNotFound(text="not a package name\n")
        url = urllib.parse.urljoin(registry.index, urllib.parse.quote(name, safe="@"))
        doc = await self.fetcher.document(url, "application/json")
        if not isinstance(doc, dict) or not isinstance(doc.get("versions", {}), dict):
            raise UpstreamError(502, "upstream packument is not a JSON object")
        return doc

    async def _debian(self, request: web.Request) -> web.StreamResponse:
        registry: Registry = request.app[REGISTRY]
        url = request.raw_path  # apt asks a proxy with the absolute URL
        if not url.startswith("http://") or len(url) > 2048:
            raise web.HTTPBadRequest(text="this port is apt's HTTP proxy (Acquire::http::Proxy)\n")
        try:
            allowed = origin(url) in registry.allowed_origins()
        except ValueError:
            allowed = False
        if not allowed:
            raise web.HTTPForbidden(text="apt's proxy: only the Debian archive hosts of this permission\n")
        immutable = "/pool/" in request.path or "/by-hash/" in request.path
        return await self._serve_cached(url, None if immutable else self.cache_config.index_ttl_s)


def _status(status: int, text: str) -> web.HTTPException:
    kind = {404: web.HTTPNotFound, 410: web.HTTPGone}.get(status, web.HTTPBadGateway)
    return kind(text=text + "\n")


def _pypi_name(project: str) -> str:
    """PEP 503's normalized name (also what keeps a name from being a path)."""
    name = re.sub(r"[-_.]+", "-", project).lower()
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,198}[a-z0-9])?", name):
        raise web.HTTPNotFound(text="not a project name\n")
    return name


def _pypi_json_links(doc: dict[str, Any], base: str, project: str) -> dict[str, Any]:
    def relink(f: Any) -> Any:
        if isinstance(f, dict) and isinstance(f.get("url"), str):
            return {**f, "url": file_link(base, f["url"]) + f"?project={_pypi_name(project)}"}
        return f

    releases = {v: [relink(f) for f in files] for v, files in (doc.get("releases") or {}).items()}
    return {**doc, "releases": releases, "urls": [relink(f) for f in doc.get("urls", [])]}


def _pep503(name: str, files: list[dict[str, Any]]) -> str:
    rows = []
    for f in files:
        attrs = f' href="{html.escape(f["url"])}"'
        hashes = f.get("hashes") or {}
        if "sha256" in hashes and "#" not in f["url"]:
            attrs = f' href="{html.escape(f["url"])}#sha256={html.escape(hashes["sha256"])}"'
        if f.get("requires-python"):
            attrs += f' data-requires-python="{html.escape(f["requires-python"])}"'
        if f.get("yanked"):
            reason = f["yanked"] if isinstance(f["yanked"], str) else ""
            attrs += f' data-yanked="{html.escape(reason)}"'
        rows.append(f"<a{attrs}>{html.escape(str(f.get('filename', '')))}</a><br/>")
    title = f"<title>Links for {html.escape(name)}</title>"
    return (
        "<!DOCTYPE html>\n<html><head>" + title + "</head><body>\n" + "\n".join(rows) + "\n</body></html>\n"
    )


def _listen(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        sock.bind((address, port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
