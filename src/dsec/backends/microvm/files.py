""":class:`~dsec.executor.file_ops.FileOps` for a microVM: every call is a request to its guest
agent, which resolves paths inside the guest's sandbox root (``openat2(RESOLVE_IN_ROOT)``).
Errors come back as errno values and map onto the DSec tree exactly as a container's do."""

from __future__ import annotations

import posixpath
import stat as st
import struct
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable

from dsec.backends.microvm.channel import (
    OP_LIST,
    OP_MKDIR,
    OP_REMOVE,
    OP_RENAME,
    OP_STAT,
    STAT,
    AgentChannel,
    AgentError,
    cstr,
)
from dsec.executor._paths import _file_type, _map_oserror, _normalize
from dsec.executor.file_ops import DEFAULT_FILE_MODE
from dsec.protocol.errors import FileNotFound, InvalidRequest
from dsec.protocol.models import FileStat

ChannelOf = Callable[[], Awaitable[AgentChannel]]


def _stat(path: str, record: bytes) -> FileStat:
    mode, uid, gid, size, mtime_ns = STAT.unpack(record)
    return FileStat(
        path=path,
        name=posixpath.basename(path) or "/",
        type=_file_type(mode),
        size=size,
        mode=st.S_IMODE(mode),
        mtime=mtime_ns / 1e9,
        uid=uid,
        gid=gid,
    )


class VmFileOps:
    def __init__(self, channel: ChannelOf, uid: int, gid: int) -> None:
        self._channel = channel
        self.uid, self.gid = uid, gid

    async def _fop(self, op: int, args: bytes, path: str) -> bytes:
        try:
            return await (await self._channel()).fop(op, args)
        except AgentError as exc:
            raise _map_oserror(exc, path) from exc

    async def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        full = _normalize(path, "/")
        chunks = (await self._channel()).read(full)
        try:
            async for chunk in chunks:
                yield chunk
        except AgentError as exc:
            raise _map_oserror(exc, full) from exc
        finally:
            await chunks.aclose()

    async def write_stream(
        self, path: str, chunks: AsyncIterable[bytes], mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        full = _normalize(path, "/")
        try:
            await (await self._channel()).write(full, chunks, mode=mode, uid=self.uid, gid=self.gid)
        except AgentError as exc:
            raise _map_oserror(exc, full) from exc
        return await self.stat(full)

    async def stat(self, path: str) -> FileStat:
        full = _normalize(path, "/")
        return _stat(full, await self._fop(OP_STAT, cstr(full), full))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def list_dir(self, path: str) -> list[FileStat]:
        full = _normalize(path, "/")
        body = await self._fop(OP_LIST, cstr(full), full)
        (count,) = struct.unpack_from("<I", body)
        pos, out = 4, []
        for _ in range(count):
            end = body.index(b"\0", pos)
            name = body[pos:end].decode(errors="surrogateescape")
            pos = end + 1
            out.append(_stat(posixpath.join(full, name), body[pos : pos + STAT.size]))
            pos += STAT.size
        return sorted(out, key=lambda f: f.name)

    async def mkdir(self, path: str, parents: bool = True) -> FileStat:
        full = _normalize(path, "/")
        await self._fop(OP_MKDIR, struct.pack("<IB", 0o755, int(parents)) + cstr(full), full)
        return await self.stat(full)

    async def remove(self, path: str, recursive: bool = False) -> None:
        full = _normalize(path, "/")
        await self._fop(OP_REMOVE, struct.pack("<B", int(recursive)) + cstr(full), full)

    async def set_xattrs(self, path: str, prefix: str, attrs: dict[str, str]) -> None:
        if attrs:  # the guest agent has no call for them
            raise InvalidRequest("extended attributes are not served on microVM sandboxes")

    async def xattrs(self, path: str, prefix: str) -> dict[str, str]:
        return {}

    async def move(self, source: str, destination: str) -> FileStat:
        src, dst = _normalize(source, "/"), _normalize(destination, "/")
        await self._fop(OP_RENAME, cstr(src) + cstr(dst), src)
        return await self.stat(dst)
