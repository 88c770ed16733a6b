"""E2B's in-sandbox API (``envd``), served by the apiserver for every sandbox.

E2B runs a daemon inside each sandbox; DSec does not: a process inside could read or forge
what that daemon says. Here the apiserver answers envd's routes and routes each request by its
``E2b-Sandbox-Id`` header to the sandbox's edge, whose executor (outside the sandbox) does the
work. Requests carry no API key: the sandbox's envd access token (``X-Access-Token``, issued
with the sandbox) authorizes them.

Served: ``GET /health``; ``GET``/``POST /files`` (octet-stream, gzip and multipart uploads,
streamed both ways); ``process.Process`` (Start, Connect, List, SendInput, StreamInput,
CloseStdin, SendSignal, Update) and ``filesystem.Filesystem`` (Stat, ListDir, MakeDir, Move,
Remove, WatchDir, CreateWatcher, GetWatcherEvents, RemoveWatcher), Connect protocol, JSON.
The user a request acts as comes from its ``Authorization: Basic`` user name, else the
sandbox's ``init_user``.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Protocol

from aiohttp import web

from dsec.apiserver.e2b.connect import (
    ConnectError,
    from_dsec,
    read_client_stream,
    read_stream_request,
    read_unary,
    unary_error,
    unary_response,
)
from dsec.apiserver.e2b.envd_files import FilesystemService, download, upload
from dsec.apiserver.e2b.envd_process import ProcessService
from dsec.apiserver.e2b.lifecycle import auto_resumes
from dsec.apiserver.e2b.tokens import EXPIRED_SIGNATURE
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.protocol.errors import DSecError, InvalidRequest, SandboxNotFound, Unauthorized
from dsec.protocol.models import SandboxState

# Requests under these paths carry no API key: they are authorized by the sandbox's envd
# access token (``X-Access-Token``) for the sandbox named in ``E2b-Sandbox-Id``.
ENVD_PATH_PREFIXES = ("/health", "/files", "/process.Process/", "/filesystem.Filesystem/")
SANDBOX_HEADER = "E2b-Sandbox-Id"
TOKEN_HEADER = "X-Access-Token"
_INIT_USERS = 100_000
_ID_SHOWN = 100
_ALIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)


def is_envd_path(path: str) -> bool:
    return path.startswith(ENVD_PATH_PREFIXES)


class TokenCheck(Protocol):
    def check(self, sandbox_id: str, token: str | None) -> None:
        """Raise Unauthorized unless ``token`` is the sandbox's envd access token."""

    def check_signature(
        self,
        sandbox_id: str,
        path: str,
        operation: str,
        user: str | None,
        signature: str | None,
        expiration: int | None,
    ) -> None:
        """Raise Unauthorized unless ``signature`` signs this file operation (a signed URL)."""


def _user(request: web.Request) -> str | None:
    """The user name of ``Authorization: Basic base64(user:)``, how E2B SDKs pick a user (or
    ``?username=``, how they pick one for ``/files``)."""
    if request.query.get("username"):
        return request.query["username"]
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        name = base64.b64decode(header[6:], validate=True).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest("Authorization: Basic must carry base64 of 'user:'") from exc
    return name or None


def sandbox_gone(request: web.Request) -> web.Response:
    """What E2B's proxy answers in envd's place for a sandbox that does not exist (any more):
    502 with this JSON. The SDKs take a 502 from ``/health`` as "not running" and read
    "was not found" in the message to tell a killed sandbox from an unreachable one."""
    sandbox_id = request.headers.get(SANDBOX_HEADER, "")[:_ID_SHOWN]
    body = {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}
    return web.json_response(body, status=502)


def _signature_refusal(expiration: str | None) -> str:
    """envd's 401 message for a signed URL it does not accept (the SDKs' tests match it)."""
    try:
        expired = expiration is not None and int(expiration) < time.time()
    except ValueError:
        return "signature_expiration must be a Unix time"
    return EXPIRED_SIGNATURE if expired else "invalid signature"


def _files_error(exc: DSecError) -> web.Response:
    # envd's REST errors: JSON with the status as ``code``; the SDKs read ``message``.
    return web.json_response({"code": exc.status, "message": str(exc)}, status=exc.status)


class EnvdRoutes:
    def __init__(self, sandboxes: SandboxRoutes, tokens: TokenCheck) -> None:
        self.sandboxes = sandboxes
        self.tokens = tokens
        self.process = ProcessService()
        self.files = FilesystemService()
        self._init_users: dict[str, str] = {}  # a sandbox's init_user never changes

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/health", self.health)
        r.add_get("/files", self.get_file)
        r.add_post("/files", self.post_file)
        r.add_post("/process.Process/{method}", self.process_call)
        r.add_post("/filesystem.Filesystem/{method}", self.filesystem_call)

    async def close(self) -> None:
        await self.files.close()

    def _sandbox(self, request: web.Request) -> tuple[EdgeLink, str]:
        sandbox_id = request.headers.get(SANDBOX_HEADER)
        if not sandbox_id:
            if request.path == "/files" and "signature" in request.query:
                # A signed URL naming no sandbox that no running sandbox's token signs (the
                # finder of traffic.py skips expired ones): envd's answer to a bad signature.
                raise Unauthorized(_signature_refusal(request.query.get("signature_expiration")))
            raise InvalidRequest(f"envd requests name their sandbox in the {SANDBOX_HEADER} header")
        token = request.headers.get(TOKEN_HEADER)
        if token is None and "signature" in request.query and request.path == "/files":
            try:
                expiration = (
                    int(request.query["signature_expiration"])
                    if "signature_expiration" in request.query
                    else None
                )
            except ValueError as exc:
                raise InvalidRequest("signature_expiration must be a Unix time") from exc
            operation = "read" if request.method == "GET" else "write"
            path, user = request.query.get("path", ""), request.query.get("username")
            self.tokens.check_signature(
                sandbox_id, path, operation, user, request.query["signature"], expiration
            )
        else:
            self.tokens.check(sandbox_id, token)
        return self.sandboxes.link_for(sandbox_id), sandbox_id

    async def _user_of(self, request: web.Request, link: EdgeLink, sandbox_id: str) -> str:
        """The request's user, needed where a relative path means that user's home."""
        user = _user(request) or self._init_users.get(sandbox_id)
        if user is None:
            user = (await link.get(sandbox_id)).init_user
            if len(self._init_users) >= _INIT_USERS:
                self._init_users.pop(next(iter(self._init_users)))
            self._init_users[sandbox_id] = user
        return user

    async def health(self, request: web.Request) -> web.Response:
        if SANDBOX_HEADER in request.headers:
            try:
                link, sandbox_id = self._sandbox(request)
                info = await link.get(sandbox_id)
            except SandboxNotFound:
                return sandbox_gone(request)
            except DSecError as exc:
                return _files_error(exc)
            if info.state not in _ALIVE:
                return sandbox_gone(request)
            if info.state is SandboxState.paused:
                # E2B's proxy finds no running sandbox and resumes it only if it was created with
                # autoResume; otherwise it answers as for one that is gone (is_running() False).
                if not auto_resumes(info):
                    return sandbox_gone(request)
                try:
                    await link.resume(sandbox_id)
                except SandboxNotFound:
                    return sandbox_gone(request)
                except DSecError as exc:
                    return _files_error(exc)
        return web.Response(status=204)

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        try:
            link, sandbox_id = self._sandbox(request)
            return await download(request, link, sandbox_id, await self._user_of(request, link, sandbox_id))
        except SandboxNotFound:
            return sandbox_gone(request)
        except DSecError as exc:
            return _files_error(exc)

    async def post_file(self, request: web.Request) -> web.StreamResponse:
        try:
            link, sandbox_id = self._sandbox(request)
            return await upload(request, link, sandbox_id, await self._user_of(request, link, sandbox_id))
        except SandboxNotFound:
            return sandbox_gone(request)
        except DSecError as exc:
            return _files_error(exc)

    async def process_call(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        p = self.process
        try:
            link, sandbox_id = self._sandbox(request)
            if method in ("Start", "Connect"):
                msg = await read_stream_request(request)
                call = p.start if method == "Start" else p.connect
                return await call(request, msg, link, sandbox_id, _user(request))
            if method == "StreamInput":
                return unary_response(await p.stream_input(read_client_stream(request), link, sandbox_id))
            unary = {
                "List": p.list,
                "SendInput": p.send_input,
                "CloseStdin": p.close_stdin,
                "SendSignal": p.send_signal,
                "Update": p.update,
            }.get(method)
            if unary is None:
                raise ConnectError("unimplemented", f"process.Process/{method} is not served")
            return unary_response(await unary(await read_unary(request), link, sandbox_id))
        except SandboxNotFound:
            return sandbox_gone(request)
        except DSecError as exc:
            return unary_error(from_dsec(exc))
        except ConnectError as exc:
            return unary_error(exc)
        except ConnectionResetError:
            return web.Response(status=499)  # the client went away; nobody reads this

    async def filesystem_call(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        fs = self.files
        try:
            link, sandbox_id = self._sandbox(request)
            user = await self._user_of(request, link, sandbox_id)
            if method == "WatchDir":
                return await fs.watch_dir(request, await read_stream_request(request), link, sandbox_id, user)
            unary = {
                "Stat": fs.stat,
                "ListDir": fs.list_dir,
                "MakeDir": fs.make_dir,
                "Move": fs.move,
                "Remove": fs.remove,
                "CreateWatcher": fs.create_watcher,
                "GetWatcherEvents": fs.get_watcher_events,
                "RemoveWatcher": fs.remove_watcher,
            }.get(method)
            if unary is None:
                raise ConnectError("unimplemented", f"filesystem.Filesystem/{method} is not served")
            return unary_response(await unary(await read_unary(request), link, sandbox_id, user))
        except SandboxNotFound:
            return sandbox_gone(request)
        except DSecError as exc:
            return unary_error(from_dsec(exc))
        except ConnectError as exc:
            return unary_error(exc)
        except ConnectionResetError:
            return web.Response(status=499)
