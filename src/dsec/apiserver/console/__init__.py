"""The web console: pages served by the apiserver at ``/console``, and a terminal WebSocket.

The console holds no authority of its own. Its pages are static; the browser keeps the API
key in ``sessionStorage`` and calls the same public ``/v1`` routes any client does, so a key
sees exactly its subtree there. The one route the console adds, the terminal's WebSocket,
authenticates the key on the upgrade and checks the sandbox as every sandbox route does
(:meth:`SandboxRoutes.owned`), then drives the edge's process table as ``dsec sandbox shell``
does. See docs/decisions.md ("web console") for why the key is not a cookie.
"""

from __future__ import annotations

from aiohttp import web

from dsec.apiserver.console.pages import PagesRoutes
from dsec.apiserver.console.terminal import TerminalRoutes
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.iam import IamStore

PREFIX = "/console"

__all__ = ["PREFIX", "is_console_path", "register_console"]


def is_console_path(path: str) -> bool:
    """The console's paths: their pages carry no key, the terminal checks its own."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def register_console(r: web.UrlDispatcher, sandboxes: SandboxRoutes, iam: IamStore) -> None:
    PagesRoutes(PREFIX).register(r)
    TerminalRoutes(PREFIX, sandboxes, iam).register(r)
