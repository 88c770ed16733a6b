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
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from email.message import Message
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.hdrs import CONTENT_DISPOSITION

from dsec.apiserver._http import stream_bytes
from dsec.apiserver.e2b.connect import ConnectError, ServerStream, field, from_dsec, pump
from dsec.apiserver.e2b.envd_entries import Owners, entries
from dsec.edge.link import EdgeLink
from dsec.protocol.errors import DSecError, FileNotFound, InvalidReason, InvalidRequest
from dsec.protocol.models import FileStat, FileType
from dsec.protocol.processes import WatchEvent

_CHUNK = 1 << 20
_MAX_DEPTH = 16
_MAX_ENTRIES = 100_000
_WATCHER_EVENTS = 10_000  # kept per polling watcher between polls
_WATCHER_IDLE_S = 600.0  # a polling watcher nobody asked for in this long is dropped
# A gzip upload may decode to this many times its encoded size, or to the floor, whichever is
# more; a body without a length to _GZIP_MAX. Files compress 2-10x, a bomb of zeros 1000x.
_GZIP_RATIO = 64
_GZIP_FLOOR = 64 << 20
_GZIP_MAX = 16 << 30
_SETTLE_WAIT_S = 5.0  # a poll waits at most this long for an event whose entry is being read
_XATTR_READS_AT_ONCE = 64
_ENTRY_EVENTS = ("create", "write", "chmod")  # envd's opCarriesEntry: the entry still exists
# The edge writes NAME through a temporary ".NAME.dsec-<16 hex>" in the same directory
# (executor/files.py, NAME cut to 32 characters) renamed over NAME at the end.
_UPLOAD_TEMP = re.compile(r"(?:^|/)\.[^/]{0,32}\.dsec-[0-9a-f]{16}$")
_UPLOADS_TRACKED = 10_000
METADATA_PREFIX = "user.e2b."  # envd's extended attributes of file metadata
_METADATA_HEADER = "x-metadata-"
_METADATA_KEY_MAX = 255 - len(METADATA_PREFIX)
_METADATA_TOTAL_MAX = 4096
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


# -- /files -----------------------------------------------------------------------------------


async def download(request: web.Request, link: EdgeLink, sandbox_id: str, user: str) -> web.StreamResponse:
    path = absolute(request.query.get("path", ""), user)
    disposition = {"Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'}
    return await stream_bytes(request, link.read_stream(sandbox_id, path), disposition)


class _Decoded:
    """aiohttp has decoded a gzip body already (``Content-Encoding``): a second gunzip failed
    every upload. What bounds a bomb is the decoded size, over all files of the body: past the
    limit the upload fails (the edge's writes are atomic: the file being written is left out)."""

    def __init__(self, request: web.Request) -> None:
        gzip = request.headers.get("Content-Encoding", "").strip().lower() == "gzip"
        sent = request.content_length
        bound = _GZIP_MAX if sent is None else min(_GZIP_MAX, max(_GZIP_FLOOR, _GZIP_RATIO * sent))
        self.limit = bound if gzip else None
        self.seen = 0

    async def bound(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.seen += len(chunk)
            if self.limit is not None and self.seen > self.limit:
                raise InvalidRequest(f"the gzip-encoded body decodes to more than {self.limit} bytes")
            yield chunk


def _written(info: FileStat, metadata: dict[str, str]) -> dict[str, Any]:
    kind = "dir" if info.type == FileType.dir else "file"
    out: dict[str, Any] = {"name": info.name, "type": kind, "path": info.path}
    if metadata:
        out["metadata"] = metadata
    return out


def upload_metadata(request: web.Request) -> dict[str, str]:
    """envd 0.6.2's file metadata: each ``X-Metadata-<key>`` header becomes the ``user.e2b.<key>``
    extended attribute of every uploaded file (keys lowercased), checked as envd does."""
    found: dict[str, str] = {}
    total = 0
    for name, value in request.headers.items():
        if not name.lower().startswith(_METADATA_HEADER):
            continue
        key = name[len(_METADATA_HEADER) :].lower()
        if not key or key in found:  # a repeated header: envd keeps the first value
            continue
        if len(key) > _METADATA_KEY_MAX:
            raise InvalidRequest(f"invalid metadata: key {key[:64]!r} exceeds {_METADATA_KEY_MAX} bytes")
        for what, text in (("key", key), (f"value for key {key!r}", value)):
            if not (text.isascii() and text.isprintable()):
                raise InvalidRequest(f"invalid metadata: {what} contains non-printable-ASCII characters")
        found[key] = value
        total += len(METADATA_PREFIX) + len(key) + len(value)
    if total > _METADATA_TOTAL_MAX:
        raise InvalidRequest(
            f"invalid metadata: total metadata size {total} exceeds {_METADATA_TOTAL_MAX} bytes"
        )
    return found


async def upload(request: web.Request, link: EdgeLink, sandbox_id: str, user: str) -> web.Response:
    """Octet-stream (one file, ``?path=``) or multipart (one part per file, each named by its
    filename, or by ``?path=`` when there is one); streamed to the edge, never held whole."""
    ctype = request.content_type
    decoded = _Decoded(request)
    metadata = upload_metadata(request)
    written: list[dict[str, Any]] = []

    async def write(path: str, chunks: AsyncIterator[bytes]) -> None:
        info = await link.write_stream(sandbox_id, path, decoded.bound(chunks))
        kept = metadata
        if metadata:
            try:
                await link.set_xattrs(sandbox_id, path, METADATA_PREFIX, metadata)
            except InvalidRequest:
                kept = {}  # envd too: the file stays, its answer shows no metadata kept
        written.append(_written(info, kept))

    if ctype == "multipart/form-data":
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("nested multipart bodies are not supported")
            if part.name != "file":
                continue  # envd writes only the parts named "file"
            name = request.query.get("path") or _part_path(part)
            if not name:
                raise InvalidRequest("each file part needs a filename (its path) or ?path=")
            await write(absolute(name, user), _part(part))
    else:
        await write(absolute(request.query.get("path", ""), user), request.content.iter_chunked(_CHUNK))
    return web.json_response(written)


def _part_path(part: BodyPartReader) -> str | None:
    # aiohttp's part.filename strips leading slashes ("/tmp/a" becomes "tmp/a", then a path in
    # the home directory); envd takes the filename whole, and the JS SDK sends absolute paths.
    disposition = Message()
    disposition["content-disposition"] = part.headers.get(CONTENT_DISPOSITION, "")
    return disposition.get_filename()


async def _part(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(_CHUNK):
        yield chunk


# -- filesystem.Filesystem ----------------------------------------------------------------------


class _UploadEvents:
    """envd writes an upload in place (open, truncate, write); the edge writes a temporary and
    renames it over the file. A watcher sees envd's events: the temporary's own are dropped,
    and its rename onto NAME becomes CREATE NAME, CHMOD NAME (envd's chown) and, when data was
    written, WRITE NAME. Only names of the edge's form are taken for temporaries."""

    def __init__(self) -> None:
        self._wrote: dict[str, bool] = {}
        self._renamed: tuple[str, bool] | None = None  # (its directory, whether it was written)

    def translate(self, event: WatchEvent) -> list[WatchEvent]:
        renamed, self._renamed = self._renamed, None
        if _UPLOAD_TEMP.search(event.name):
            if event.t == "create" and len(self._wrote) < _UPLOADS_TRACKED:
                self._wrote[event.name] = False
            elif event.t == "write" and event.name in self._wrote:
                self._wrote[event.name] = True
            elif event.t in ("rename", "remove"):
                wrote = self._wrote.pop(event.name, True)
                if event.t == "rename":
                    self._renamed = (posixpath.dirname(event.name), wrote)
            return []
        if renamed is not None and event.t == "create" and posixpath.dirname(event.name) == renamed[0]:
            then = ("chmod", "write") if renamed[1] else ("chmod",)
            return [event, *(event.model_copy(update={"t": t}) for t in then)]
        return [event]


class _EnvdEvents:
    """The edge's raw watch events as envd's ``FilesystemEvent`` messages; with
    ``include_entry`` an event of an entry that still exists carries it (best effort, as envd)."""

    def __init__(self, link: EdgeLink, sandbox_id: str, root: str, include_entry: bool) -> None:
        self.link, self.sandbox_id, self.root, self.include_entry = link, sandbox_id, root, include_entry
        self.uploads = _UploadEvents()
        self.owners: Owners | None = None

    async def of(self, raw: WatchEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in self.uploads.translate(raw):
            message: dict[str, Any] = {"name": event.name, "type": _EVENTS[event.t]}
            if self.include_entry and event.t in _ENTRY_EVENTS:
                self.owners = self.owners or await Owners.of(self.link, self.sandbox_id)
                with contextlib.suppress(DSecError):
                    info = await self.link.stat(self.sandbox_id, posixpath.join(self.root, event.name))
                    [entry] = await entries(self.link, self.sandbox_id, self.owners, [info])
                    message["entry"] = await _with_metadata(entry, info, self.link, self.sandbox_id)
            out.append(message)
        return out


async def envd_events(
    events: AsyncGenerator[WatchEvent, None], mapper: _EnvdEvents
) -> AsyncGenerator[dict[str, Any] | None, None]:
    """None once the watch is in place, then envd's ``FilesystemEvent`` messages."""
    try:
        async for raw in events:
            if raw.t == "start":
                yield None
                continue
            for message in await mapper.of(raw):
                yield message
    finally:
        await events.aclose()


class _Watcher:
    """A polling watcher: the events of one watch, kept until asked for. An event the edge
    has delivered but whose entry is still being read (``include_entry``: a few file calls)
    is not yet pending; a poll then waits for it (``settled``), so a poll right after a write
    sees the write, as envd's in-process watcher shows it."""

    def __init__(self, events: AsyncGenerator[WatchEvent, None], mapper: _EnvdEvents) -> None:
        self.events, self.mapper = events, mapper
        self.pending: list[dict[str, Any]] = []
        self.error: ConnectError | None = None
        self.last_poll = time.monotonic()
        self.task: asyncio.Task[None] | None = None
        self.settled = asyncio.Event()
        self.settled.set()

    async def run(self) -> None:
        try:
            async for raw in self.events:
                self.settled.clear()
                try:
                    for message in await self.mapper.of(raw):
                        if len(self.pending) < _WATCHER_EVENTS:
                            self.pending.append(message)
                finally:
                    self.settled.set()
        except DSecError as exc:
            self.error = from_dsec(exc)
        finally:
            self.settled.set()
            await self.events.aclose()


def _watch_message(event: dict[str, Any] | None) -> dict[str, Any]:
    return {"start": {}} if event is None else {"filesystem": event}


def _depth(msg: dict[str, Any]) -> int:
    raw = field(msg, "depth", 0) or 1
    # proto3 JSON may carry an integer as a string; 1e400 or a list is no depth (was a 500).
    digits = isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) < 6
    depth = int(raw) if isinstance(raw, int) or digits else 0
    if not 1 <= depth <= _MAX_DEPTH:
        raise ConnectError("invalid_argument", f"depth must be between 1 and {_MAX_DEPTH}")
    return depth


async def _with_metadata(
    entry: dict[str, Any], info: FileStat, link: EdgeLink, sandbox_id: str
) -> dict[str, Any]:
    """``entry`` with the file's envd metadata (its ``user.e2b.*`` attributes), as envd's
    Stat, Move, ListDir and watch entries carry it."""
    if info.type == FileType.file:
        with contextlib.suppress(FileNotFound, InvalidRequest):  # gone or replaced meanwhile
            if metadata := await link.xattrs(sandbox_id, info.path, METADATA_PREFIX):
                entry["metadata"] = metadata
    return entry


async def _all_with_metadata(
    out: list[dict[str, Any]], infos: list[FileStat], link: EdgeLink, sandbox_id: str
) -> list[dict[str, Any]]:
    """Each file's metadata into its entry: one attribute read per file, as envd's walk does,
    ``_XATTR_READS_AT_ONCE`` in flight (a listing holds up to ``_MAX_ENTRIES``)."""
    files = [n for n, i in enumerate(infos) if i.type == FileType.file]
    for start in range(0, len(files), _XATTR_READS_AT_ONCE):
        batch = files[start : start + _XATTR_READS_AT_ONCE]
        await asyncio.gather(*(_with_metadata(out[n], infos[n], link, sandbox_id) for n in batch))
    return out


class FilesystemService:
    def __init__(self) -> None:
        self._watchers: dict[str, tuple[str, _Watcher]] = {}  # id -> (sandbox, watcher)

    async def stat(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str) -> dict[str, Any]:
        info = await link.stat(sandbox_id, absolute(field(msg, "path", ""), user))
        [entry] = await entries(link, sandbox_id, await Owners.of(link, sandbox_id), [info])
        return {"entry": await _with_metadata(entry, info, link, sandbox_id)}

    async def list_dir(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        """envd walks depth first in name order (Go's WalkDir): each directory's entries follow
        it. Fetched a level at a time, all of a level's directories at once, then ordered."""
        depth = _depth(msg)
        root = absolute(field(msg, "path", ""), user)
        top = await link.stat(sandbox_id, root)
        if top.type != FileType.dir:
            raise ConnectError("invalid_argument", f"path is not a directory: {root}")
        owners = await Owners.of(link, sandbox_id)
        below: dict[str, list[FileStat]] = {}
        level, count = [root], 0
        for step in range(depth):
            listings = (link.list_dir(sandbox_id, d) for d in level)
            found = await asyncio.gather(*listings, return_exceptions=True)
            folders, level = level, []
            for folder, listing in zip(folders, found, strict=True):
                # A deep listing of / reaches /proc: the file API refuses kernel file systems,
                # which a walk skips (the directory itself is listed), as it never enters them.
                if isinstance(listing, InvalidRequest) and listing.reason == InvalidReason.kernel_fs and step:
                    continue
                if isinstance(listing, BaseException):
                    raise listing
                below[folder] = listing
                count += len(listing)
                level.extend(i.path for i in listing if i.type == FileType.dir)
            if count > _MAX_ENTRIES:
                raise ConnectError("resource_exhausted", f"more than {_MAX_ENTRIES} entries below {root}")
        ordered: list[FileStat] = []
        stack = list(reversed(below.get(root, [])))
        while stack:
            info = stack.pop()
            ordered.append(info)
            stack.extend(reversed(below.get(info.path, [])))
        listed = await entries(link, sandbox_id, owners, ordered)
        return {"entries": await _all_with_metadata(listed, ordered, link, sandbox_id)}

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
        entry = (await Owners.of(link, sandbox_id)).entry(info)
        return {"entry": await _with_metadata(entry, info, link, sandbox_id)}  # kept by rename(2)

    async def remove(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str) -> dict[str, Any]:
        # envd's Remove is Go's RemoveAll: a path that is not there is removed already.
        with contextlib.suppress(FileNotFound):
            await link.remove(sandbox_id, absolute(field(msg, "path", ""), user), recursive=True)
        return {}

    @staticmethod
    async def _watch(
        msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> tuple[AsyncGenerator[WatchEvent, None], _EnvdEvents]:
        """The edge's watch, in place (its ``start`` read; a refusal raises here), and the
        mapper of its events to envd's."""
        path = absolute(field(msg, "path", ""), user)
        events = link.watch_dir(sandbox_id, path, bool(field(msg, "recursive", False)))
        try:
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        assert first.t == "start", first
        return events, _EnvdEvents(link, sandbox_id, path, bool(field(msg, "includeEntry", False)))

    async def watch_dir(
        self, request: web.Request, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> web.StreamResponse:
        async def messages() -> AsyncGenerator[dict[str, Any] | None, None]:
            events, mapper = await self._watch(msg, link, sandbox_id, user)
            try:
                yield None
            except BaseException:  # closed before the events are read: end the edge's watch
                await events.aclose()
                raise
            async for message in envd_events(events, mapper):
                yield message

        return await pump(ServerStream(request), messages(), _watch_message, {"keepalive": {}})

    async def create_watcher(
        self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str
    ) -> dict[str, Any]:
        self._expire()
        events, mapper = await self._watch(msg, link, sandbox_id, user)
        watcher = _Watcher(events, mapper)
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
        with contextlib.suppress(TimeoutError):  # an entry slower than this comes next poll
            await asyncio.wait_for(watcher.settled.wait(), _SETTLE_WAIT_S)
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
