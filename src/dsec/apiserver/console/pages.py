"""The console's static pages and the terminal's xterm.js, served from fixed file lists.

xterm.js comes from the npm registry at build time (``.node-console/``, installed by
``setup.sh``) and is served from its ``node_modules`` dist files: nothing is fetched from a CDN
when a page loads. Without those files the console still loads, says how to install them, and
only the terminal is missing; the asset routes answer 404 with the same instruction.
"""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).parent / "static"
# The repository's .node-console/ (an editable install); DSEC_CONSOLE_NODE_MODULES for others.
_REPO_MODULES = Path(__file__).resolve().parents[4] / ".node-console" / "node_modules"
ENV_MODULES = "DSEC_CONSOLE_NODE_MODULES"

# name -> (file, content type): nothing outside these lists is ever read.
_PAGES = {
    "console.js": ("console.js", "text/javascript"),
    "console.css": ("console.css", "text/css"),
}
_VENDOR = {
    "xterm.js": ("@xterm/xterm/lib/xterm.js", "text/javascript"),
    "xterm.css": ("@xterm/xterm/css/xterm.css", "text/css"),
    "addon-fit.js": ("@xterm/addon-fit/lib/addon-fit.js", "text/javascript"),
}
INSTALL_HINT = (
    "The console's terminal needs xterm.js, installed at build time: run ./setup.sh up (or"
    " `npm ci --prefix .node-console` in the DSec checkout), or point DSEC_CONSOLE_NODE_MODULES"
    " at a node_modules holding @xterm/xterm and @xterm/addon-fit."
)
_NO_STORE = {"Cache-Control": "no-store"}
# The key sits in sessionStorage, so no script but the console's own may run on its pages, and
# no other site may frame them. xterm.js adds <style> elements: inline styles only, no scripts.
_PAGE_HEADERS = {
    **_NO_STORE,
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:;"
        " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_ASSET_CACHE = {"Cache-Control": "max-age=300"}


def node_modules() -> Path:
    """Read per request, so an install made while the apiserver runs is picked up."""
    return Path(os.environ.get(ENV_MODULES) or _REPO_MODULES)


def missing_assets() -> list[str]:
    root = node_modules()
    return [rel for rel, _ in _VENDOR.values() if not (root / rel).is_file()]


class PagesRoutes:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get(self.prefix, self.index)
        r.add_get(self.prefix + "/", self.index)
        r.add_get(self.prefix + "/static/{name}", self.static)
        r.add_get(self.prefix + "/vendor/{name}", self.vendor)

    async def index(self, request: web.Request) -> web.Response:
        """One page; the browser switches views by the URL's fragment (#/sandboxes ...)."""
        html = (STATIC / "index.html").read_text()
        missing = missing_assets()
        notice = (
            f'<div id="assets-missing" class="notice">{INSTALL_HINT} Missing: {", ".join(missing)}</div>'
            if missing
            else ""
        )
        html = html.replace("<!--ASSETS-NOTICE-->", notice)
        return web.Response(text=html, content_type="text/html", headers=_PAGE_HEADERS)

    async def static(self, request: web.Request) -> web.StreamResponse:
        entry = _PAGES.get(request.match_info["name"])
        if entry is None:
            raise web.HTTPNotFound(reason="no such console file")
        name, ctype = entry
        return web.Response(body=(STATIC / name).read_bytes(), content_type=ctype, headers=_NO_STORE)

    async def vendor(self, request: web.Request) -> web.StreamResponse:
        entry = _VENDOR.get(request.match_info["name"])
        if entry is None:
            raise web.HTTPNotFound(reason="no such console asset")
        rel, ctype = entry
        path = node_modules() / rel
        if not path.is_file():
            return web.Response(status=404, text=INSTALL_HINT, headers=_NO_STORE)
        return web.Response(body=path.read_bytes(), content_type=ctype, headers=_ASSET_CACHE)
