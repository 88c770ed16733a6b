"""envd's files: the ``/files`` upload and download routes and the ``filesystem.Filesystem``
service, over the edge's file calls (which resolve every path inside the sandbox's root).

E2B resolves a relative path against the user's home directory; so do we. Owners are shown
by name, read from the sandbox's own ``/etc/passwd`` and ``/etc/group`` (what ``ls -l``
inside would print), once per call.

Polling watchers (``CreateWatcher``/``GetWatcherEvents``, what the sync SDK uses) keep their
events in the apiserver that created them: a cluster behind a load balancer needs sticky
routing for them (the streaming ``WatchDir`` has no such need).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import stat
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime
from typing import Any

from aiohttp import BodyPartReader, web

from dsec.apiserver._http import stream_bytes
from dsec.apiserver.e2b.connect import ConnectError, ServerStream, field, from_dsec, pump
from dsec.edge.link import EdgeLink
from dsec.protocol.errors import DSecError, FileNotFound, InvalidRequest
from dsec.protocol.models import FileStat, FileType
from dsec.protocol.processes import WatchEvent

_CHUNK = 1 << 20
_NAMES_MAX = 1 << 20
_MAX_DEPTH = 16
_MAX_ENTRIES = 100_000
_WATCHER_EVENTS = 10_000  # kept per polling watcher between polls
_WATCHER_IDLE_S = 600.0  # a polling watcher nobody asked for in this long is dropped
_TYPES = {FileType.file: "FILE_TYPE_FILE", FileType.dir: "FILE_TYPE_DIRECTORY"}
_EVENTS = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}


def home_of(user: str) -> str:
    return "/root" if user in ("root", "0") else f"/home/{user}"


def absolute(path: str, user: str) -> str:
    # From a JSON message or a query: any type, any character (NUL would reach the OS).
    if not isinstance(path, str) or not path:
        raise InvalidRequest("path is required (a string)")
    if "\0" in path or len(path) > 4096:
        raise InvalidRequest("path must be at most 4096 characters, without NUL")
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home_of(user), path))


async def _names(link: EdgeLink, sandbox_id: str, path: str) -> dict[int, str]:
    """id -> name from an /etc/passwd-style file in the sandbox ({} if it has none)."""
    data = bytearray()
    try:
        async for chunk in link.read_stream(sandbox_id, path):
            data += chunk
            if len(data) > _NAMES_MAX:
                return {}
    except (FileNotFound, InvalidRequest):
        return {}
    out: dict[int, str] = {}
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out.setdefault(int(parts[2]), parts[0])
    return out


class Owners:
    def __init__(self, users: dict[int, str], groups: dict[int, str]) -> None:
        self.users, self.groups = users, groups

    @classmethod
    async def of(cls, link: EdgeLink, sandbox_id: str) -> Owners:
        users, groups = await asyncio.gather(
            _names(link, sandbox_id, "/etc/passwd"), _names(link, sandbox_id, "/etc/group")
        )
        return cls(users, groups)

    def entry(self, info: FileStat) -> dict[str, Any]:
        """A FileStat as envd's ``EntryInfo`` (proto JSON: defaults left out)."""
        mode = info.mode & 0o7777
        kind = {FileType.dir: stat.S_IFDIR, FileType.symlink: stat.S_IFLNK}.get(info.type, stat.S_IFREG)
        out: dict[str, Any] = {
            "name": info.name,
            "type": _TYPES.get(info.type, "FILE_TYPE_FILE"),
            "path": info.path,
            "size": str(info.size),
            "mode": mode,
            "permissions": stat.filemode(kind | mode),
            "owner": self.users.get(info.uid, str(info.uid)),
            "group": self.groups.get(info.gid, str(info.gid)),
            "modifiedTime": datetime.fromtimestamp(info.mtime, UTC).isoformat().replace("+00:00", "Z"),
        }
        if info.type == FileType.symlink:
            out["isSymlink"] = True
        return out


# -- /files -----------------------------------------------------------------------------------


async def download(request: web.Request, link: EdgeLink, sandbox_id: str, user: str) -> web.StreamResponse:
    path = absolute(request.query.get("path", ""), user)
    disposition = {"Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'}
    return await stream_bytes(request, link.read_stream(sandbox_id, path), disposition)


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(wbits=31)
    try:
        async for chunk in chunks:
            if out := inflate.decompress(chunk):
                yield out
        if tail := inflate.flush():
            yield tail
    except zlib.error as exc:
        raise InvalidRequest(f"the gzip-encoded body is corrupt: {exc}") from exc


def _written(info: FileStat) -> dict[str, Any]:
    return {"name": info.name, "type": "dir" if info.type == FileType.dir else "file", "path": info.path}


async def upload(request: web.Request, link: EdgeLink, sandbox_id: str, user: str) -> web.Response:
    """Octet-stream (one file, ``?path=``) or multipart (one part per file, each named by its
    filename, or by ``?path=`` when there is one); streamed to the edge, never held whole."""
    ctype = request.content_type
    written: list[dict[str, Any]] = []
    if ctype == "multipart/form-data":
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("nested multipart bodies are not supported")
            name = request.query.get("path") or part.filename
            if not name:
                raise InvalidRequest("each file part needs a filename (its path) or ?path=")
            written.append(_written(await link.write_stream(sandbox_id, absolute(name, user), _part(part))))
    else:
        body: AsyncIterator[bytes] = request.content.iter_chunked(_CHUNK)
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = _gunzip(body)
        path = absolute(request.query.get("path", ""), user)
        written.append(_written(await link.write_stream(sandbox_id, path, body)))
    return web.json_response(written)


async def _part(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(_CHUNK):
        yield chunk


# -- filesystem.Filesystem ----------------------------------------------------------------------


class _Watcher:
    """A polling watcher: the events of one ``watch_dir`` stream, kept until asked for."""

    def __init__(self, events: AsyncGenerator[WatchEvent, None]) -> None:
        self.events = events
        self.pending: list[dict[str, Any]] = []
        self.error: ConnectError | None = None
        self.last_poll = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            async for event in self.events:
                if event.t != "start" and len(self.pending) < _WATCHER_EVENTS:
                    self.pending.append(_fs_event(event))
        except DSecError as exc:
            self.error = from_dsec(exc)
        finally:
            await self.events.aclose()


def _watch_message(event: WatchEvent) -> dict[str, Any]:
    return {"start": {}} if event.t == "start" else {"filesystem": _fs_event(event)}


def _fs_event(event: WatchEvent) -> dict[str, Any]:
    return {"name": event.name, "type": _EVENTS[event.t]}


class FilesystemService:
    def __init__(self) -> None:
        self._watchers: dict[str, tuple[str, _Watcher]] = {}  # id -> (sandbox, watcher)

    async def stat(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str) -> dict[str, Any]:
        info = await link.stat(sandbox_id, absolute(field(msg, "path", ""), user))
        return {"entry": (await Owners.of(link, sandbox_id)).entry(info)}

    async def list_dir(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        raw = field(msg, "depth", 0) or 1
        # proto3 JSON may carry an integer as a string; 1e400 or a list is no depth (was a 500).
        digits = isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) < 6
        depth = int(raw) if isinstance(raw, int) or digits else 0
        if not 1 <= depth <= _MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be between 1 and {_MAX_DEPTH}")
        root = absolute(field(msg, "path", ""), user)
        top = await link.stat(sandbox_id, root)
        if top.type != FileType.dir:
            raise ConnectError("invalid_argument", f"path is not a directory: {root}")
        owners = await Owners.of(link, sandbox_id)
        entries: list[dict[str, Any]] = []
        level = [root]
        for step in range(depth):
            below: list[str] = []
            listings = (link.list_dir(sandbox_id, d) for d in level)
            found = await asyncio.gather(*listings, return_exceptions=True)
            for listing in found:
                # A deep listing of / reaches /proc: the file API refuses kernel file systems,
                # which a walk skips (the directory itself is listed), as it never enters them.
                if isinstance(listing, InvalidRequest) and listing.reason == "kernel_fs" and step:
                    continue
                if isinstance(listing, BaseException):
                    raise listing
                for info in listing:
                    entries.append(owners.entry(info))
                    if info.type == FileType.dir:
                        below.append(info.path)
            if len(entries) > _MAX_ENTRIES:
                raise ConnectError("resource_exhausted", f"more than {_MAX_ENTRIES} entries below {root}")
            level = below
        return {"entries": entries}

    async def make_dir(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        path = absolute(field(msg, "path", ""), user)
        with contextlib.suppress(FileNotFound):
            await link.stat(sandbox_id, path)
            raise ConnectError("already_exists", f"already exists: {path}")
        info = await link.mkdir(sandbox_id, path, parents=True)
        return {"entry": (await Owners.of(link, sandbox_id)).entry(info)}

    async def move(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str) -> dict[str, Any]:
        source = absolute(field(msg, "source", ""), user)
        destination = absolute(field(msg, "destination", ""), user)
        info = await link.move(sandbox_id, source, destination)
        return {"entry": (await Owners.of(link, sandbox_id)).entry(info)}

    async def remove(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str) -> dict[str, Any]:
        await link.remove(sandbox_id, absolute(field(msg, "path", ""), user), recursive=True)
        return {}

    async def watch_dir(
        self, request: web.Request, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> web.StreamResponse:
        stream = ServerStream(request)
        path = absolute(field(msg, "path", ""), user)
        events = link.watch_dir(sandbox_id, path, bool(field(msg, "recursive", False)))
        return await pump(stream, events, _watch_message, {"keepalive": {}})

    async def create_watcher(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        self._expire()
        path = absolute(field(msg, "path", ""), user)
        events = link.watch_dir(sandbox_id, path, bool(field(msg, "recursive", False)))
        first = await anext(events)  # the watch is in place (or the error is the answer)
        assert first.t == "start", first
        watcher = _Watcher(events)
        watcher.task = asyncio.create_task(watcher.run())
        watcher_id = secrets.token_hex(8)
        self._watchers[watcher_id] = (sandbox_id, watcher)
        return {"watcherId": watcher_id}

    def _get(self, msg: dict[str, Any], sandbox_id: str) -> tuple[str, _Watcher]:
        watcher_id = str(field(msg, "watcherId", ""))
        found = self._watchers.get(watcher_id)
        if found is None or found[0] != sandbox_id:
            raise ConnectError(
                "not_found", f"no watcher {watcher_id!r} in this sandbox (watchers live in one apiserver)"
            )
        return watcher_id, found[1]

    async def get_watcher_events(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        _, watcher = self._get(msg, sandbox_id)
        watcher.last_poll = time.monotonic()
        if watcher.error is not None and not watcher.pending:
            raise watcher.error
        events, watcher.pending = watcher.pending, []
        return {"events": events}

    async def remove_watcher(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        watcher_id, watcher = self._get(msg, sandbox_id)
        del self._watchers[watcher_id]
        await self._stop(watcher)
        return {}

    @staticmethod
    async def _stop(watcher: _Watcher) -> None:
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher.task

    def _expire(self) -> None:
        now = time.monotonic()
        for watcher_id, (_, watcher) in list(self._watchers.items()):
            if now - watcher.last_poll > _WATCHER_IDLE_S:
                del self._watchers[watcher_id]
                if watcher.task is not None:
                    watcher.task.cancel()

    async def close(self) -> None:
        watchers = [w for _, w in self._watchers.values()]
        self._watchers.clear()
        await asyncio.gather(*(self._stop(w) for w in watchers))
