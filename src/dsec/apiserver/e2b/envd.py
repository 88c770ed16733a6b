"""E2B's in-sandbox API (``envd``), served by the apiserver for every sandbox.

(Being written: the Connect-protocol process and filesystem services and ``/files``.)
"""

from __future__ import annotations

from aiohttp import web

from dsec.apiserver.sandboxes import SandboxRoutes

# Requests under these paths carry no API key: they are authorized by the sandbox's envd
# access token (``X-Access-Token``) for the sandbox named in ``E2b-Sandbox-Id``.
ENVD_PATH_PREFIXES = ("/health", "/files", "/process.Process/", "/filesystem.Filesystem/", "/envs")


def is_envd_path(path: str) -> bool:
    return path.startswith(ENVD_PATH_PREFIXES)


class EnvdRoutes:
    def __init__(self, sandboxes: SandboxRoutes) -> None:
        self.sandboxes = sandboxes

    def register(self, r: web.UrlDispatcher) -> None:
        pass
